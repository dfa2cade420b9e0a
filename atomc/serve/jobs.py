"""The server's lifetime state (`ServerState`) and its per-request jobs, one HTTP generation
request each: cumulative engine outputs become OpenAI chunks (SSE) or one response, with
stop-string holdback and per-choice deltas. Every exit path (done, client gone, engine failure,
shutdown) closes the job, which aborts what still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atomc.config import EngineConfig
from atomc.engine import structured_outputs
from atomc.engine.structured_outputs import GrammarCompiler, GrammarError
from atomc.outputs import CompletionOutput, RequestOutput, best_of
from atomc.sampling_params import SamplingParams
from atomc.serve.api_errors import APIError, bad_request
from atomc.serve.async_engine import (
    AsyncEngine,
    ChatPrompt,
    EngineDeadError,
    OutputStream,
    RequestFailedError,
    ShuttingDownError,
)
from atomc.serve.chat_output import ChatOutputSetup, ChoiceParser
from atomc.serve.chat_request import ChatCompletionRequest
from atomc.serve.metrics import RequestTracker, ServerMetrics
from atomc.serve.request_limits import RequestLimits
from atomc.serve.response_parts import chat_logprobs, legacy_logprobs, merge_legacy, prompt_logprobs_json, usage

logger = logging.getLogger("atomc.serve")

# request fields the engine's input processor checks (atomc/engine/inputs.py): a 400 names them
_TOKEN_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")


def _version() -> str:
    try:
        return metadata.version("atomc")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


VERSION = _version()


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` takes a file or the template text itself, as vLLM's does."""
    if not value:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    return value


class ServerState:
    """What the routes share; one per app."""

    def __init__(self, async_engine: AsyncEngine, config: EngineConfig):
        self.aengine = async_engine
        self.engine = async_engine.engine
        self.config = config
        self.model_name: str = self.engine.model_name
        self.chat_template = load_chat_template(config.serve.chat_template)
        par = config.parallel
        layout = {
            "tensor_parallel_size": par.tensor_parallel_size,
            "pipeline_parallel_size": par.pipeline_parallel_size,
            "expert_parallel": str(par.enable_expert_parallel).lower(),
        }
        self.metrics = ServerMetrics(async_engine.stats, lambda: async_engine.healthy, layout)
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        self.jobs: set[_Job] = set()  # requests being answered (event-loop side only)
        serve = config.serve
        self.limits = RequestLimits(
            serve.max_prompts_per_request,
            serve.max_seqs_per_request,
            serve.max_logprob_entries_per_request,
            self.engine.max_model_len,
        )
        self._grammars: GrammarCompiler | None = None

    def begin_drain(self, drain_s: float) -> None:
        """Shutdown began (on the event loop): requests still running after `drain_s` are cut, each
        with an error (503, or an SSE error event then `[DONE]` in a stream), before uvicorn's own
        deadline (a little later) would cancel them mid-body."""
        asyncio.get_running_loop().call_later(drain_s, self.cut_requests)

    def cut_requests(self) -> None:
        if self.jobs:
            logger.warning("drain time is up: cutting %d request(s) still running", len(self.jobs))
        for job in list(self.jobs):
            job.stream._post_error(ShuttingDownError("the server is shutting down; the request was cut"))

    def token_str(self, token_id: int) -> str:
        # bounded by the vocabulary; decoding is a read-only call on the Rust tokenizer
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.engine.tokenizer.decode([token_id])
        return s

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def check_model(self, model: str | None) -> None:
        # without --served-model-name the --model value itself is accepted too, as vLLM serves it
        # (clients such as vLLM's benchmark send it), though only the folder's name is listed
        alias = None if self.config.model.served_model_name else self.config.model.model
        if model is not None and model != self.model_name and model != alias:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def start_chat(self, req: ChatCompletionRequest, request_id: str) -> ChatJob:
        """Check a chat request, render it and submit it: the one way into the engine for
        /v1/chat/completions and for the APIs translated into chat (/v1/responses, /v1/messages), so
        whatever chat knows (tools in the template, tool-call and reasoning parsing, the constraint
        of tool_choice "required" / a named function) they get too, from chat's own fields."""
        self.check_model(req.model)
        setup = req.output_setup(self.config.serve)
        params = req.sampling_params(self.engine.sampling_defaults, setup)
        self.limits.check([None], params)
        await self.check_constraint(params, req.constraint_field)
        prompt = ChatPrompt(req.template_messages(), self.chat_template, req.template_tools(), req.template_kwargs())
        stream = await self.submit(request_id, [prompt], params)
        return ChatJob(self, req, request_id, stream, params, setup)

    @property
    def grammars(self) -> GrammarCompiler:
        """An in-process engine's own compiler (one cache: the engine finds what the route compiled);
        beside an engine process, one of the server's (the engine process compiles again, once)."""
        if self._grammars is None:
            self._grammars = getattr(self.engine, "grammars", None) or GrammarCompiler(
                self.engine.tokenizer, self.engine.inputs.vocab_size
            )
        return self._grammars

    async def check_constraint(self, params: SamplingParams, field: str | None) -> None:
        """Compile the request's output constraint (cached) off the event loop; a constraint the
        grammar engine cannot compile is a 400 naming `field`, before the engine sees the request.
        Whatever sets `params.structured_outputs` (response_format, guided_*, a tool choice) calls it
        before `submit`; `field`: the request field to name in the error."""
        so = params.structured_outputs
        if so is None:
            return
        where = f"{field}: " if field else ""
        if not structured_outputs.available():
            raise bad_request(f"{where}structured outputs need the xgrammar package, which is not installed", field)
        try:
            if self.grammars.cached(so) is None:
                await asyncio.get_running_loop().run_in_executor(None, self.grammars.compile, so)
        except GrammarError as e:
            raise bad_request(f"{where}{e}", field) from None

    async def submit(self, base_id: str, prompts: list, params) -> OutputStream:
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.aengine.submit([(rid, p, params) for rid, p in zip(ids, prompts, strict=True)])
        except ValueError as e:  # the engine's verdict on the prompt (empty, too long, bad ids) or on a
            # field it checks against the vocabulary or the tokenizer (its message starts with the name)
            field = str(e).split(" ", 1)[0].rstrip(":")
            if field not in _TOKEN_FIELDS:
                field = "messages" if isinstance(prompts[0], ChatPrompt) else "prompt"
            raise bad_request(str(e), field) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None


# ---------------------------------------------------------------- per-request jobs


@dataclass
class _ChoiceState:
    ntok: int = 0  # generated tokens already sent
    text_len: int = 0  # characters of generated text already sent
    offset: int = 0  # running text_offset for legacy logprobs
    started: bool = False
    done: bool = False
    parser: ChoiceParser | None = None  # chat choices read for reasoning / tool calls


class _Job:
    """One HTTP generation request: turns cumulative engine outputs into OpenAI chunks / a response."""

    object_full = object_chunk = ""
    eager_first = False  # send a first chunk before any token (completions' echo of the prompt)

    def __init__(self, srv: ServerState, req, request_id: str, stream: OutputStream, params: SamplingParams):
        self.srv, self.req, self.id, self.stream, self.n = srv, req, request_id, stream, params.n
        self.created = int(time.time())
        self.tracker: RequestTracker = srv.metrics.tracker(len(stream.request_ids), stream.arrival_time)
        self.latest: dict[int, RequestOutput] = {}
        self.states: dict[tuple[int, int], _ChoiceState] = {}
        stops = [] if req.include_stop_str_in_output else params.stop
        self.holdback = max((len(s) - 1 for s in stops), default=0)
        srv.jobs.add(self)

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput, st: _ChoiceState, final: bool) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Every exit path: abort what still runs (frees its KV blocks), count it in the metrics."""
        self.srv.jobs.discard(self)
        self.stream.abort()
        self.tracker.close()

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.srv.model_name,
            "choices": choices,
        }

    def usage(self) -> dict:
        outs = self.latest.values()
        return usage(
            sum(len(o.prompt_token_ids) for o in outs),
            sum(len(c.token_ids) for o in outs for c in o.outputs),
            sum(o.num_cached_tokens for o in outs),
        )

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for i, out in self.stream:
            self.tracker.update(i, out)
            self.latest[i] = out
            yield i, out

    async def body(self) -> dict:
        """The whole (non-streamed) response body, once every output finished; APIError on failure."""
        try:
            async for _ in self._outputs():
                pass
        except (EngineDeadError, RequestFailedError) as e:
            raise engine_error(e) from None
        choices = []
        for i, out in sorted(self.latest.items()):
            returned = best_of(out, self.n)  # best_of > n: the n samples of highest cumulative logprob
            choices.extend(
                self.choice(i, returned, c, _ChoiceState(), final=True)
                for c in sorted(returned.outputs, key=lambda c: c.index)
            )
        body = self._envelope(self.object_full, choices)
        self.add_response_fields(body)
        body["usage"] = self.usage()  # every sample's tokens, best_of's unreturned ones included
        return body

    async def response(self) -> JSONResponse:
        return JSONResponse(await self.body())

    async def chunks(self) -> AsyncIterator[dict]:
        """The stream's chunks as dicts, one per choice per change (usage not included); raises
        EngineDeadError / RequestFailedError when the engine fails the request."""
        async for i, out in self._outputs():
            for c in out.outputs:
                st = self.states.setdefault((i, c.index), _ChoiceState())
                if st.done or not self._changed(c, st):
                    continue
                body = self._envelope(self.object_chunk, [self.choice(i, out, c, st, final=False)])
                body["usage"] = None
                yield body

    def add_response_fields(self, body: dict) -> None:
        """Fields of a whole (non-streamed) response beyond the choices; none by default."""

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        top_n = self.req.prompt_logprobs or 0
        return prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs, top_n, self.srv.token_str)

    async def events(self) -> AsyncIterator[str]:
        try:
            async for body in self.chunks():
                yield _sse(body)
            if self.req.include_usage:
                body = self._envelope(self.object_chunk, [])
                body["usage"] = self.usage()
                yield _sse(body)
        except (EngineDeadError, RequestFailedError) as e:  # headers are out already: report in-band, as vLLM does
            yield _sse(engine_error(e).body())
        yield "data: [DONE]\n\n"

    def _changed(self, c: CompletionOutput, st: _ChoiceState) -> bool:
        # a new token (even one whose text is held back) is a chunk, as in vLLM, so clients count tokens;
        # an output without tokens yet (prefill) is not, so the first chunk marks the first token
        grew = len(c.token_ids) > st.ntok or len(c.text) > st.text_len
        return grew or c.finish_reason is not None or (not st.started and self.eager_first)

    def _advance(self, c: CompletionOutput, st: _ChoiceState) -> tuple[str, list[int], list]:
        """The text, token ids and logprobs not sent yet; marks them sent."""
        ntok = len(c.token_ids)  # logprobs may grow in place on the engine thread: slice by the ids
        st.done = c.finish_reason is not None
        # a stop string can begin in text we would send now and end in a later step, which then cuts
        # it from the text: while running, hold back its possible beginning (as vLLM does)
        visible = len(c.text) if st.done else max(st.text_len, len(c.text) - self.holdback)
        text = c.text[st.text_len : visible]
        ids = c.token_ids[st.ntok : ntok]
        lps = (c.logprobs or [])[st.ntok : ntok]
        st.ntok, st.text_len, st.started = ntok, visible, True
        return text, ids, lps


class CompletionJob(_Job):
    object_full = object_chunk = "text_completion"

    @property
    def eager_first(self) -> bool:
        return self.req.echo

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput, st: _ChoiceState, final: bool) -> dict:
        first = not st.started
        text, ids, lps = self._advance(c, st)
        logprobs = None
        if first and self.req.echo:
            prompt_text = out.prompt if isinstance(out.prompt, str) else self.srv.decode(out.prompt_token_ids)
            text = prompt_text + text
            if self.req.logprobs is not None:
                plps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                logprobs = self._legacy(out.prompt_token_ids, plps, st)
        if self.req.logprobs is not None:
            logprobs = merge_legacy(logprobs, self._legacy(ids, lps, st))
        body = {
            "index": i * self.n + c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if final and self.req.prompt_logprobs is not None:  # vLLM's field, per choice in completions
            body["prompt_logprobs"] = self.prompt_logprobs(out)
        return body

    def _legacy(self, ids: list[int], lps: list, st: _ChoiceState) -> dict:
        d = legacy_logprobs(ids, lps, self.srv.token_str, st.offset)
        if d["tokens"]:
            st.offset = d["text_offset"][-1] + len(d["tokens"][-1])
        return d


class ChatJob(_Job):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, srv, req, request_id, stream, params: SamplingParams, setup: ChatOutputSetup | None = None):
        super().__init__(srv, req, request_id, stream, params)
        self.setup = setup if setup is not None and setup.active else None
        # the EOS token's text ends the output when special tokens are decoded for a tool parser
        self.decodes_special = not params.skip_special_tokens

    def add_response_fields(self, body: dict) -> None:
        if self.req.prompt_logprobs is not None and self.latest:  # vLLM's field, once per chat response
            body["prompt_logprobs"] = self.prompt_logprobs(self.latest[0])

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput, st: _ChoiceState, final: bool) -> dict:
        first = not st.started
        text, ids, lps = self._advance(c, st)
        logprobs = None
        if self.req.logprobs:
            top_n = self.req.top_logprobs or 0
            logprobs = {"content": chat_logprobs(ids, lps, self.srv.token_str, top_n)}
        finish_reason = c.finish_reason
        if self.setup is None:
            if final:
                key, msg = "message", {"role": "assistant", "content": text}
            else:  # the role rides on the first content delta, so the first chunk marks the first token
                key, msg = "delta", ({"role": "assistant", "content": text} if first else {"content": text})
        else:
            if st.parser is None:
                st.parser = self.setup.choice_parser(out.prompt if isinstance(out.prompt, str) else None)
            seen_text, seen_ids = self._parsed_output(c, st)
            if final:
                key, msg = "message", st.parser.message(seen_text, seen_ids)
            else:
                key, msg = "delta", st.parser.delta(seen_text, seen_ids, st.done)
                if first:
                    msg = {"role": "assistant", **msg}
                if not msg:
                    msg = {"content": ""}
            if st.parser.made_calls and finish_reason == "stop" and self.setup.tool_mode != "named":
                finish_reason = "tool_calls"  # as OpenAI: a forced named function still says "stop"
        return {
            "index": i * self.n + c.index,
            key: msg,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _parsed_output(self, c: CompletionOutput, st: _ChoiceState) -> tuple[str, list[int]]:
        """The text and ids sent so far, cumulative (parsers read the whole output)."""
        text, ids = c.text[: st.text_len], c.token_ids[: st.ntok]
        if st.done and self.decodes_special and c.finish_reason == "stop" and c.stop_reason is None and ids:
            eos = self.srv.token_str(ids[-1])
            if eos and text.endswith(eos):
                text = text[: -len(eos)]
        return text, ids


def engine_error(e: Exception) -> APIError:
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), type="server_error", code="server_shutting_down")
    return APIError(500, str(e), type="server_error", code="engine_failed")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """Streaming response that always runs `on_close`, even when the client leaves before the first
    chunk (then the body generator never starts, so its own `finally` could not abort anything)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(request: Request, job: _Job) -> Response:
    """Non-streaming: build the whole response, but give up (and abort) if the client leaves first."""
    if job.req.stream:
        return _SSEResponse(job.events(), on_close=job.close)
    work = asyncio.ensure_future(job.response())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
        job.close()
    if work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return work.result()
