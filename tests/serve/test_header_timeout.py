"""A request head must arrive within --request-header-timeout (slowloris): 408 and the connection
closed; complete requests, kept-alive connections and slow-but-in-time clients are unaffected."""

from __future__ import annotations

import socket
import time

import pytest

from atomc.config import EngineConfig
from atomc.serve.server import ServerThread, check_serve_config


async def hello_app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server():
    cfg = EngineConfig()
    cfg.serve.request_header_timeout_s = 0.5
    cfg.serve.timeout_keep_alive_s = 5
    with ServerThread(hello_app, cfg) as st:
        yield st


def connect(st) -> socket.socket:
    sock = socket.create_connection((st.host, st.port), timeout=5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_that_never_completes_gets_408_and_is_closed(server):
    sock = connect(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
    t0 = time.monotonic()
    data = read_all(sock)  # returns when the server closes
    assert data.startswith(b"HTTP/1.1 408")
    assert 0.4 < time.monotonic() - t0 < 3


def test_a_connection_that_sends_nothing_is_closed(server):
    sock = connect(server)
    t0 = time.monotonic()
    assert read_all(sock).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 3


def test_slow_but_in_time_and_kept_alive_requests_are_served(server):
    sock = connect(server)
    for part in (b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
        sock.sendall(part)
        time.sleep(0.15)  # 0.45 s in all, under the 0.5 s deadline
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    time.sleep(0.8)  # idle past the header deadline: the keep-alive timeout (5 s) applies, not it
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the next head stalls: its own deadline
    assert b"408" in read_all(sock)


def test_the_deadline_must_be_positive():
    cfg = EngineConfig()
    cfg.serve.request_header_timeout_s = 0
    with pytest.raises(ValueError, match="--request-header-timeout"):
        check_serve_config(cfg)
