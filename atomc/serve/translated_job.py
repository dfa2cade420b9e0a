"""A chat job answered in another API's shape (OpenAI's Responses API, Anthropic's Messages API).

Those APIs are served by translating the request into a chat-completions request and running the
ordinary `ChatJob` (same validation, template, engine path, stop-string holdback, tool-call parsing
once chat has it); only the output is re-shaped. `TranslatedJob` is what `respond()` takes in place
of a job: a whole response is the chat body translated at once, a stream is the chat chunks fed
through the API's `StreamTranslator`, which turns them into that API's named SSE events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from atomc.serve.api_errors import APIError
from atomc.serve.async_engine import EngineDeadError, RequestFailedError
from atomc.serve.jobs import ChatJob, engine_error


class StreamTranslator(Protocol):
    """Chat chunks in, the API's events out (each a dict whose `type` is the SSE event name)."""

    def start(self, chat_usage: Callable[[], dict]) -> list[dict]: ...

    def feed(self, chunk: dict) -> list[dict]: ...

    def finish(self, chat_usage: dict) -> list[dict]: ...

    def fail(self, error: APIError) -> list[dict]: ...


def sse_event(event: dict) -> str:
    """One named server-sent event, as both APIs send them: `event: <type>` then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class TranslatedJob:
    """`respond()`'s view of a translated request: `req.stream`, `close()`, `response()`, `events()`."""

    def __init__(
        self,
        chat: ChatJob,
        req: Any,
        translate_body: Callable[[dict], dict],
        translator: Callable[[], StreamTranslator],
    ):
        self.chat, self.req = chat, req
        self._translate_body, self._translator = translate_body, translator

    def close(self) -> None:
        self.chat.close()

    async def response(self) -> JSONResponse:
        return JSONResponse(self._translate_body(await self.chat.body()))

    async def events(self) -> AsyncIterator[str]:
        tr = self._translator()
        for ev in tr.start(self.chat.usage):
            yield sse_event(ev)
        try:
            async for chunk in self.chat.chunks():
                for ev in tr.feed(chunk):
                    yield sse_event(ev)
            done = tr.finish(self.chat.usage())
        except (EngineDeadError, RequestFailedError) as e:  # headers are out: report in-band
            done = tr.fail(engine_error(e))
        for ev in done:
            yield sse_event(ev)
