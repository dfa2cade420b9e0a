"""uvicorn's h11 protocol with a deadline for a request's header block.

uvicorn times out idle keep-alive connections but not a client that opens a connection and sends
its headers slowly or never (slowloris): each such client holds a connection and its buffers for
as long as it likes. Here a connection waiting for a request head (a fresh one, or a kept-alive one
once the next request's first bytes arrive) must complete it within `header_timeout_s`, or it gets a
408 and is closed. The body has its own deadline (`--request-body-timeout`, in the app).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = b"request header timeout"
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s: float = 20.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        # a kept-alive connection starts its next request head with these bytes
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete (h11 is past the request line)
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being written (pipelining): the app's deadlines apply
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's `http=` setting, with this deadline (uvicorn builds one
    instance per connection from the class, so the deadline rides on the class)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": float(seconds)})
