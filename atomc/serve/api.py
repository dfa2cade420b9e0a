"""The FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

Handlers read the body themselves (size limit and read timeout, then JSON, then pydantic), so every
failure has OpenAI's error shape: 413 too large, 408 too slow, 400 not JSON or invalid; the routes
declare their request models in the OpenAPI document all the same (`openapi_extra`). A 500 never
carries an exception's text (it is logged).
A request reaches the engine only once it validated; from then on every exit path (done, client
gone, engine failure, shutdown) aborts whatever still runs, so KV blocks never leak.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from atomc.config import EngineConfig
from atomc.serve import anthropic_api, responses_api
from atomc.serve.anthropic_api import AnthropicMessagesRequest, MessagesStream
from atomc.serve.api_errors import APIError, bad_request
from atomc.serve.async_engine import AsyncEngine, EngineDeadError
from atomc.serve.chat_request import ChatCompletionRequest
from atomc.serve.completion_request import CompletionRequest
from atomc.serve.jobs import VERSION, CompletionJob, ServerState, respond
from atomc.serve.metrics import HTTPMetricsMiddleware
from atomc.serve.request_body import parse_request
from atomc.serve.responses_api import ResponseShell, ResponsesRequest, ResponsesStream
from atomc.serve.tokenize_request import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_request_model,
)
from atomc.serve.translated_job import TranslatedJob

logger = logging.getLogger("atomc.serve")


# ---------------------------------------------------------------- app


async def read_json(request: Request, limit: int, timeout_s: float | None = None):
    """The body as JSON: 413 past `limit` bytes, 408 when it takes longer than `timeout_s` to arrive
    (a Content-Length longer than what is sent would otherwise hold the connection forever), 400 when
    it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")

    async def receive() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        return body

    try:
        body = await asyncio.wait_for(receive(), timeout_s)
    except ClientDisconnect:  # gone mid-upload: nobody reads the answer, but do not log a crash
        raise bad_request("client disconnected while sending the body") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    try:
        return json.loads(body)
    except RecursionError:  # deeper than the parser's stack: never valid for these routes
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None


async def _read_body(request: Request, model):
    """The body validated by `model`, or by `model(data)` when the shape picks the model."""
    cfg = _srv(request).config.serve
    data = await read_json(request, cfg.max_request_bytes, cfg.request_body_timeout_s)
    if not isinstance(model, type):
        model = model(data)
    return parse_request(model, data)


def _srv(request: Request) -> ServerState:
    return request.app.state.atomc


def _key_matches(given: str, key: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), key.encode())


async def _check_api_key(request: Request) -> None:
    key = _srv(request).config.serve.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not _key_matches(token, key):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


async def _check_anthropic_api_key(request: Request) -> None:
    """Anthropic's clients send the key as `x-api-key`; `Authorization: Bearer` works too."""
    key = _srv(request).config.serve.api_key
    if key and "x-api-key" in request.headers:
        if not _key_matches(request.headers["x-api-key"], key):
            raise APIError(401, "invalid x-api-key", code="invalid_api_key")
        return
    await _check_api_key(request)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])
anthropic_v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_anthropic_api_key)])


def _body_schema(*models) -> dict:
    """`openapi_extra` for a route that reads its own body: the request model (or one of several)
    as its requestBody (the schemas themselves are added to the document's components by `_openapi`)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# every request model the routes read, declared in the OpenAPI document
REQUEST_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    ResponsesRequest,
    AnthropicMessagesRequest,
)


@v1.post("/completions", openapi_extra=_body_schema(CompletionRequest))
async def create_completion(request: Request) -> Response:
    srv = _srv(request)
    req = await _read_body(request, CompletionRequest)
    srv.check_model(req.model)
    params = req.sampling_params(srv.engine.sampling_defaults)
    prompts = req.prompts()
    srv.limits.check(prompts, params)
    await srv.check_constraint(params, req.constraint_field)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = await srv.submit(request_id, prompts, params)
    return await respond(request, CompletionJob(srv, req, request_id, stream, params))


@v1.post("/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    srv = _srv(request)
    req = await _read_body(request, ChatCompletionRequest)
    job = await srv.start_chat(req, f"chatcmpl-{uuid.uuid4().hex}")
    return await respond(request, job)


@v1.post("/responses", openapi_extra=_body_schema(ResponsesRequest))
async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, answered by the chat pipeline (responses_api.py)."""
    srv = _srv(request)
    req = await _read_body(request, ResponsesRequest)
    try:
        chat = parse_request(ChatCompletionRequest, responses_api.to_chat_request(req))
        job = await srv.start_chat(chat, f"chatcmpl-{uuid.uuid4().hex}")
    except APIError as e:
        raise responses_api.rename_chat_error(e) from None
    shell = ResponseShell(req, srv.model_name)
    return await respond(request, TranslatedJob(job, req, shell.from_chat, lambda: ResponsesStream(shell)))


@anthropic_v1.post("/messages", openapi_extra=_body_schema(AnthropicMessagesRequest))
async def create_message(request: Request) -> Response:
    """Anthropic's Messages API, answered by the chat pipeline (anthropic_api.py); its errors
    take that API's shape (_error_response)."""
    srv = _srv(request)
    req = await _read_body(request, AnthropicMessagesRequest)
    try:
        chat = parse_request(ChatCompletionRequest, anthropic_api.to_chat_request(req))
        job = await srv.start_chat(chat, f"chatcmpl-{uuid.uuid4().hex}")
    except APIError as e:
        raise anthropic_api.rename_chat_error(e) from None
    msg_id, model = anthropic_api.new_id("msg"), srv.model_name

    def whole(chat_body: dict) -> dict:
        return anthropic_api.message_from_chat(chat_body, msg_id, model)

    return await respond(request, TranslatedJob(job, req, whole, lambda: MessagesStream(msg_id, model)))


def _model_card(srv: ServerState) -> dict:
    return {
        "id": srv.model_name,
        "object": "model",
        "created": srv.created,
        "owned_by": "atomc",
        "root": srv.model_name,  # never the checkpoint's path on this machine
        "max_model_len": srv.engine.max_model_len,
    }


@v1.get("/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(_srv(request))]}


@v1.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict:
    """OpenAI's models.retrieve: the served model's card; 404 (model_not_found) for any other id."""
    srv = _srv(request)
    srv.check_model(model_id)
    return _model_card(srv)


# vLLM's tokenizer routes, beside /v1 as vLLM serves them; behind --api-key like /v1/*
tokenizer_routes = APIRouter(dependencies=[Depends(_check_api_key)])


@tokenizer_routes.post("/tokenize", openapi_extra=_body_schema(TokenizeCompletionRequest, TokenizeChatRequest))
async def tokenize(request: Request) -> dict:
    """A prompt (or chat messages, rendered by the chat template) as the engine tokenizes it."""
    srv = _srv(request)
    req = await _read_body(request, tokenize_request_model)
    srv.check_model(req.model)
    inputs = srv.engine.inputs
    if isinstance(req, TokenizeChatRequest):
        messages, field = req.template_messages(), "messages"

        def run() -> tuple[list[int], list[str] | None]:
            try:
                text = inputs.apply_chat_template(
                    messages,
                    srv.chat_template,
                    tools=req.tools or None,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    **(req.chat_template_kwargs or {}),
                )
            except Exception as e:  # template errors (jinja's own, raise_exception) are the request's fault
                raise ValueError(f"cannot apply the chat template: {e}") from e
            return _tokens(inputs, text, req)
    else:
        field = "prompt"

        def run() -> tuple[list[int], list[str] | None]:
            return _tokens(inputs, req.prompt, req)

    ids, strs = await _on_engine_thread(srv, run, field)
    body: dict = {"count": len(ids), "max_model_len": srv.engine.max_model_len, "tokens": ids}
    if strs is not None:
        body["token_strs"] = strs
    return body


def _tokens(inputs, text: str, req) -> tuple[list[int], list[str] | None]:
    ids = inputs.tokenize(text, req.add_special_tokens)
    strs = inputs.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return ids, strs


@tokenizer_routes.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
async def detokenize(request: Request) -> dict:
    srv = _srv(request)
    req = await _read_body(request, DetokenizeRequest)
    srv.check_model(req.model)
    vocab = srv.engine.inputs.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be token ids in [0, {vocab}); got {bad[:5]}", "tokens")
    return {"prompt": await _on_engine_thread(srv, lambda: srv.decode(req.tokens), "tokens")}


async def _on_engine_thread(srv: ServerState, fn, field: str):
    try:
        return await srv.aengine.call(fn)
    except ValueError as e:
        raise bad_request(str(e), field) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None


ops = APIRouter()


@ops.get("/health")
async def health(request: Request) -> Response:
    """200 {"status": "ok"} while the engine loop takes requests; 503 (OpenAI's error shape) else."""
    aengine = _srv(request).aengine
    if not aengine.healthy:
        reason = "the engine failed; see the server log" if aengine.error else "the engine is not running"
        raise APIError(503, reason, type="server_error", code="engine_unavailable")
    return JSONResponse({"status": "ok"})


@ops.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@ops.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _srv(request).metrics.render()
    return Response(body, media_type=content_type)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document plus the request models, which the routes read themselves (see _body_schema)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = doc
    return app.openapi_schema


def _docs_router(app: FastAPI) -> APIRouter:
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    docs = APIRouter(dependencies=[Depends(_check_api_key)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @docs.get("/docs")
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="atomc")

    @docs.get("/redoc")
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="atomc")

    return docs


def _error_response(request: Request, e: APIError) -> JSONResponse:
    # Anthropic's clients read their own error shape: every error of its route has it
    if request.url.path.rstrip("/").startswith("/v1/messages"):
        return JSONResponse(anthropic_api.error_body(e), status_code=e.status)
    return JSONResponse(e.body(), status_code=e.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(request, e)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(request, bad_request(str(e.errors()[:1])))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(request, APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception) -> JSONResponse:
        # the exception's text stays in the log: it can hold paths, prompts or other clients' data
        logger.exception("unhandled error on %s", request.url.path)
        error = APIError(500, "internal server error", type="server_error", code="internal_error")
        return _error_response(request, error)


def build_app(async_engine: AsyncEngine, config: EngineConfig) -> FastAPI:
    """The app owns the engine thread: started on startup, stopped (aborting leftovers) on shutdown."""
    if config.serve.api_key is not None and not config.serve.api_key.strip():
        raise ValueError("--api-key is empty, which would turn authentication off; leave the flag out instead")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()

    # the API description follows --api-key like /v1/* does: mounted below, behind the same check
    app = FastAPI(title="atomc", version=VERSION, lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.atomc = srv = ServerState(async_engine, config)
    app.include_router(v1)
    app.include_router(anthropic_v1)
    app.include_router(tokenizer_routes)
    app.include_router(ops)
    app.openapi = lambda: _openapi(app)
    app.include_router(_docs_router(app))
    _install_error_handlers(app)
    app.add_middleware(HTTPMetricsMiddleware, metrics=srv.metrics)
    return app
