"""The OpenAI-compatible HTTP server: FastAPI routes, API key, body limit, errors; `run_server` for the CLI.

Every failure a client can cause is a 4xx with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`; a 500 never carries a stack trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import hmac
import json
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kestrel
from kestrel.config import ConfigError
from kestrel.engine.serving_gc import tune_for_serving
from kestrel.entrypoints.async_engine import (
    SHUTTING_DOWN_MESSAGE,
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
    ServerShuttingDownError,
)
from kestrel.entrypoints.chat import special_token_texts
from kestrel.entrypoints.core_client import CoreClient
from kestrel.entrypoints.engine_factory import core_process_by_default, engine_config
from kestrel.entrypoints.grammar_pool import COMPILE_WORKER_MODULES, GrammarCompilePool
from kestrel.entrypoints.metrics import ServerMetrics
from kestrel.entrypoints.playground import add_playground_routes
from kestrel.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    validation_error_info,
)
from kestrel.entrypoints.protocol_responses import RESPONSES_HINTS, ResponsesRequest
from kestrel.entrypoints.server_config import ServerConfig
from kestrel.entrypoints.serving import (
    ClientDisconnectedError,
    ModelNotFoundError,
    OpenAIServing,
    _until_disconnect,
    error_body,
)
from kestrel.entrypoints.serving_audio import RESPONSE_CONTENT, OpenAIServingAudio, openapi_form
from kestrel.entrypoints.serving_embeddings import OpenAIServingEmbeddings
from kestrel.entrypoints.serving_pooling import OpenAIServingPooling
from kestrel.entrypoints.serving_responses import OpenAIServingResponses
from kestrel.entrypoints.text_workers import TextWorkers, UnservedModelError, tokenize_input
from kestrel.fork_server import start_fork_server, stop_fork_server
from kestrel.loader.tokenizer import tokenizer_modules
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import SamplingParamsError
from kestrel.structured.limits import GrammarLimits

logger = logging.getLogger("kestrel.server")

# Every path is behind the API key but these: /health, /ping and /version for probes, and the playground page (/,
# /static/), which holds no secret and sends the key its user types. /metrics (model name, traffic, latencies)
# opens with `--public-metrics` (vLLM's behaviour), the API's documentation (OpenAPI document, Swagger UI, ReDoc)
# with `--public-docs`. A path is open where it equals one of the paths or lies under one that ends in "/".
OPEN_PATHS = ("/health", "/ping", "/version", "/", "/static/")
METRICS_PATHS = ("/metrics",)
DOCS_PATHS = ("/openapi.json", "/docs", "/docs/", "/redoc")
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 503, 504)
}
_SSE = ("With `stream: true`, a `text/event-stream` of `data: <chunk JSON>` lines ({chunk} objects), an error "
        "event `data: {{\"error\": ...}}` if the request fails mid-stream, and `data: [DONE]` last.")


def _event_stream(description: str) -> dict[str, Any]:
    """The `text/event-stream` content of a route's 200 (a stream's events as `event:` / `data:` lines)."""
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "description": description,
                                             "properties": {"data": {"type": "string"},
                                                            "event": {"type": "string"}}}}}


def _generation_responses(whole: type, chunk: str) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation route: the whole response as JSON, or server-sent events."""
    return {200: {"model": whole, "description": "The completion.", "content": _event_stream(_SSE.format(chunk=chunk))},
            **_ERROR_RESPONSES}


def build_app(engine: AsyncEngine, served_model_name: str | Sequence[str],
              api_key: str | Sequence[str] | None = None, *, config: ServerConfig | None = None,
              **settings: Any) -> FastAPI:
    """The app for a started AsyncEngine, with `config`'s settings (`settings`: ServerConfig fields that replace
    its values). Several apps can coexist: each has its own metrics registry."""
    config = dataclasses.replace(config or ServerConfig(tokenizer_workers=0, grammar_compile_workers=0), **settings)
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    keys = () if not api_key else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    metrics = ServerMetrics(engine, names[0])
    # Strings that must stay text inside chat messages (none: they may become control tokens, as in vLLM).
    specials = () if config.special_tokens_in_content else special_token_texts(engine.tokenizer)
    text = TextWorkers(engine.tokenizer, specials, tokenizer_path=engine.tokenizer_path,
                       processes=config.tokenizer_processes, chat_template=config.chat_template_text(),
                       tool_parser=config.tool_call_parser,
                       exclude_tools_when_none=config.exclude_tools_when_tool_choice_none,
                       content_format=config.chat_template_content_format,
                       trust_remote_code=engine.core.config.model.trust_remote_code,
                       timeout=config.tokenize_timeout, max_tokenize_bytes=config.max_tokenize_bytes)
    grammars = _grammar_pool(engine, config)
    # Both pools exist before either starts: their workers' fork server then imports what each pool preloads.
    text.start()
    if grammars is not None:
        grammars.start()
    serving = OpenAIServing(engine, names, metrics, text, config, grammars)
    # No trailing-slash redirects: they are built from the Host header, which the client controls.
    app = FastAPI(title="kestrel", version=kestrel.__version__, redirect_slashes=False,
                  root_path=config.root_path or "", description="OpenAI-compatible API of the kestrel inference "
                  "engine.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.text_workers = text
    app.state.grammar_pool = grammars
    _add_routes(app, engine, serving, metrics)
    add_playground_routes(app)  # GET /: the browser playground, open like /health (the key is typed into it)
    _add_error_handlers(app)
    _standard_limits_in_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout_s=config.body_read_timeout)
    if keys:
        open_paths = (OPEN_PATHS + (METRICS_PATHS if config.public_metrics else ())
                      + (DOCS_PATHS if config.public_docs else ()))
        app.add_middleware(ApiKeyMiddleware, api_keys=keys, open_paths=open_paths)
    app.add_middleware(DrainMiddleware, engine=engine)  # outside the key: probes without it see the drain too
    if config.allowed_origins:  # outermost: browsers' preflight requests carry no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    return app


def _grammar_pool(engine: AsyncEngine, config: ServerConfig) -> GrammarCompilePool | None:
    """The compile pool of the engine's grammar backend (None: the engine has none), not started yet."""
    backend = engine.core.structured
    if backend is None:
        return None
    limits = GrammarLimits(max_bytes=config.max_grammar_bytes, max_choices=config.max_grammar_choices,
                           max_properties=config.max_schema_properties)
    return GrammarCompilePool(backend.tokenizer_info, processes=config.grammar_compile_workers,
                              timeout_s=config.grammar_compile_timeout, limits=limits,
                              cache_bytes=config.grammar_cache_bytes, cache_entries=config.grammar_cache_entries,
                              max_threads=backend.max_threads, engine_compiles=engine.compiles_grammars)


def _add_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    tokenizer = engine.tokenizer

    def parsed_in_worker(schema: Any, param: str,
                         endpoint: Callable[[Any, Request], Awaitable[Response]]) -> type[APIRoute]:
        """The route class of an endpoint whose large bodies are parsed and validated in a tokenizer worker
        (megabytes of JSON cost FastAPI up to seconds of the event loop), then served as parsed here."""

        async def handle(raw: Request, chunks: list[bytes]) -> Response:
            body = await _until_disconnect(raw, serving.text.parse_body(schema, chunks, param))
            return await endpoint(body, raw)

        return raw_large_bodies(handle, RAW_BODY_BYTES)

    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    app.router.add_api_route("/v1/completions", create_completion, methods=["POST"],
                             responses=_generation_responses(CompletionResponse, "CompletionStreamResponse"),
                             route_class_override=parsed_in_worker(CompletionRequest, "prompt", create_completion))

    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    app.router.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"],
                             responses=_generation_responses(ChatCompletionResponse, "ChatCompletionChunk"),
                             route_class_override=parsed_in_worker(ChatCompletionRequest, "messages",
                                                                   create_chat_completion))

    responses = OpenAIServingResponses(serving)

    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create_response(body, raw)

    app.router.add_api_route("/v1/responses", create_response, methods=["POST"],
                             responses={200: {"description": "The Response object; with `stream: true`, a "
                                              "`text/event-stream` of the Responses API's events (`event: <type>` "
                                              "and `data: <event JSON>`), response.completed last.",
                                              "content": _event_stream("The Responses API's events.")},
                                        **_ERROR_RESPONSES},
                             route_class_override=parsed_in_worker(ResponsesRequest, "input", create_response))

    @app.get("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def retrieve_response(response_id: str, raw: Request) -> Response:
        return responses.retrieve_response(response_id, raw.query_params)

    @app.delete("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def delete_response(response_id: str) -> Response:
        return responses.delete_response(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERROR_RESPONSES)
    async def cancel_response(response_id: str) -> Response:
        return responses.cancel_response(response_id)

    audio = OpenAIServingAudio(serving)

    async def create_transcription(raw: Request) -> Response:
        return await audio.create("transcription", raw)

    async def create_translation(raw: Request) -> Response:
        return await audio.create("translation", raw)

    for path, task, endpoint in (("/v1/audio/transcriptions", "transcription", create_transcription),
                                 ("/v1/audio/translations", "translation", create_translation)):
        app.router.add_api_route(path, endpoint, methods=["POST"], openapi_extra=openapi_form(task),
                                 responses={200: {"description": "The transcript: JSON ({'text': ...}, or "
                                                  "verbose_json's segments), plain text, SRT or WebVTT; with "
                                                  "stream=true (transcriptions) an SSE stream of "
                                                  "transcript.text.delta events and transcript.text.done",
                                                  "content": RESPONSE_CONTENT},
                                            **_ERROR_RESPONSES})

    embeddings = OpenAIServingEmbeddings(serving)

    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create_embedding(body, raw)

    app.router.add_api_route("/v1/embeddings", create_embedding, methods=["POST"],
                             responses={200: {"model": EmbeddingResponse}, **_ERROR_RESPONSES},
                             route_class_override=parsed_in_worker(EmbeddingRequest, "input", create_embedding))

    for route in OpenAIServingPooling(serving).routes():
        for path in route.paths:
            app.router.add_api_route(path, route.endpoint, methods=["POST"],
                                     responses={200: {"model": route.response}, **_ERROR_RESPONSES},
                                     route_class_override=parsed_in_worker(route.schema, route.param,
                                                                           route.endpoint))

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(name, engine) for name in serving.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return _model_card(model_id, engine)

    health_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "The engine is running (empty body).", "content": {}},
        503: {"model": ErrorResponse, "description": "The engine stopped, or the server is shutting down."}}

    # /ping: the same probe under the name SageMaker-style hosts (and vLLM) use, by GET or POST; the API's
    # documentation lists it once, as /health.
    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response, include_in_schema=False)
    @app.get("/health", response_class=Response, responses=health_responses)
    async def health() -> Response:
        # Open to anyone: a reason code, never the error itself (it may name processes and paths; it is logged).
        if engine.is_healthy:
            return Response(status_code=200)
        if engine.draining:
            return _error(503, SHUTTING_DOWN_MESSAGE, "server_error", code="server_shutting_down")
        return _error(503, "the engine is not running; see the server log", "server_error", code="engine_dead")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kestrel.__version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition format.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        401: {"model": ErrorResponse, "description": "No valid API key (unless --public-metrics)."},
                        503: {"model": ErrorResponse, "description": "The server is shutting down."}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize_raw(raw: Request, body: list[bytes]) -> Response:
        """A large /tokenize body, parsed and validated in a tokenizer worker: the serving process never decodes
        its prompt, and sends the reply in pieces."""
        try:
            reply = await _until_disconnect(raw, serving.text.tokenize_body(body, serving.model_names,
                                                                             engine.max_model_len))
        except UnservedModelError as error:
            serving.check_model(error.model)
            raise
        return PiecewiseResponse(reply, media_type="application/json")

    async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
        serving.check_model(body.model)
        prompt, add_special_tokens = tokenize_input(body)
        # Tokenizing and encoding the reply run in TextWorkers: a 4 MB prompt must not stall the event loop.
        reply = await _until_disconnect(raw, serving.text.tokenize_reply(prompt, add_special_tokens,
                                                                         engine.max_model_len,
                                                                         bool(body.return_token_strs)))
        return PiecewiseResponse(reply, media_type="application/json")  # type: ignore[return-value]

    app.router.add_api_route("/tokenize", tokenize, methods=["POST"], response_model=TokenizeResponse,
                             responses=_ERROR_RESPONSES,
                             route_class_override=raw_large_bodies(tokenize_raw, RAW_BODY_BYTES))

    async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        serving.check_model(body.model)
        limit = len(tokenizer)
        bad = next((t for t in body.tokens if t >= limit), None)
        if bad is not None:
            raise InvalidRequestError("tokens", f"token id {bad} is out of range: the vocabulary has {limit} tokens")
        reply = await _until_disconnect(raw, serving.text.detokenize_reply(body.tokens))
        return PiecewiseResponse(reply, media_type="application/json")  # type: ignore[return-value]

    app.router.add_api_route("/detokenize", detokenize, methods=["POST"], response_model=DetokenizeResponse,
                             responses=_ERROR_RESPONSES,
                             route_class_override=parsed_in_worker(DetokenizeRequest, "tokens", detokenize))


_LIMIT_KEYWORDS = (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum"))


def _standard_limits(node: Any) -> None:
    """pydantic writes the bounds of annotated numbers as ge/le, which JSON Schema (and so clients and fuzzers)
    do not read: rename them to minimum/maximum in place."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for ours, standard in _LIMIT_KEYWORDS:
                if ours in node:
                    node[standard] = node.pop(ours)
        for value in node.values():
            _standard_limits(value)
    elif isinstance(node, list):
        for value in node:
            _standard_limits(value)


def _standard_limits_in_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        _standard_limits(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _model_card(name: str, engine: AsyncEngine) -> ModelCard:
    # The directory's name only: the server's file-system layout is not the client's business.
    root = os.path.basename(os.path.normpath(engine.model_path)) if engine.model_path else None
    return ModelCard(id=name, root=root, max_model_len=engine.max_model_len)


# ----- large bodies --------------------------------------------------------------------------------

RAW_BODY_BYTES = 256 << 10  # larger JSON bodies are parsed in a tokenizer worker


def raw_large_bodies(handle: Callable[[Request, list[bytes]], Awaitable[Response]],
                     threshold: int) -> type[APIRoute]:
    """A route class whose JSON bodies above `threshold` bytes go to `handle` as the chunks they came in, neither
    joined nor parsed here: FastAPI would decode and validate them on the event loop (tens of milliseconds for
    megabytes). The route's declaration, and so the OpenAPI document, stays as it is."""

    class RawLargeBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            parsed = super().get_route_handler()

            async def route(request: Request) -> Response:
                chunks = [chunk async for chunk in request.stream()]
                if sum(map(len, chunks)) > threshold and _is_json(request.headers.get("content-type", "")):
                    return await handle(request, chunks)
                return await parsed(Request(request.scope, _replaying(chunks, request.receive)))

            return route

    return RawLargeBodyRoute


def _replaying(chunks: Sequence[bytes], receive: Receive) -> Receive:
    """`receive` with the body, already read, given once more first, in the chunks it came in (not joined: the
    app joins them once, Request.body(), or hands them on); each is let go as it is given."""
    pending = deque(chunks or [b""])

    async def replay() -> Message:
        if pending:
            chunk = pending.popleft()
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        return await receive()

    return replay


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class PiecewiseResponse(Response):
    """A large body sent in pieces of PIECE bytes, each after the socket took the last: the event loop serves
    other connections in between, and no buffer holds a second copy of the whole body."""

    PIECE = 256 << 10

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.body) <= self.PIECE:
            await super().__call__(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for start in range(0, len(self.body), self.PIECE):
            await send({"type": "http.response.body", "body": self.body[start:start + self.PIECE],
                        "more_body": start + self.PIECE < len(self.body)})


# ----- errors --------------------------------------------------------------------------------------

def _error(status: int, message: str, err_type: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        hints = RESPONSES_HINTS if request.url.path.endswith("/v1/responses") else None
        param, message = validation_error_info(list(exc.errors()), hints)
        return _error(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(SamplingParamsError)
    async def on_invalid_sampling(_: Request, exc: SamplingParamsError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", exc.param, "invalid_value")

    @app.exception_handler(ModelNotFoundError)
    async def on_unknown_model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return _error(404, str(exc), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(QueueFullError)
    async def on_queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(429, str(exc), "rate_limit_error", None, "queue_full",
                      headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "server_error", None, "engine_dead")

    @app.exception_handler(ServerShuttingDownError)
    async def on_shutting_down(_: Request, exc: ServerShuttingDownError) -> JSONResponse:
        return _error(503, str(exc), "server_error", None, "server_shutting_down")

    @app.exception_handler(RequestTimeoutError)
    async def on_timeout(_: Request, exc: RequestTimeoutError) -> JSONResponse:
        return _error(504, str(exc), "timeout_error", None, "request_timeout")

    @app.exception_handler(ClientDisconnectedError)
    async def on_disconnect(_: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        if exc.status_code == 404 and exc.detail == "Not Found":
            # No route: say which endpoint is not served (the path is capped: a client may send anything).
            path = request.url.path[:80]
            served = ", ".join(sorted({r.path for r in app.routes if r.path.startswith("/v1/")}))
            return _error(404, f"{path} is not an endpoint kestrel serves; the OpenAI endpoints served are: "
                          f"{served}", err_type, None, "unknown_endpoint", headers=exc.headers)
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's words for a body it could not read as JSON, such as one that is not UTF-8.
            return _error(400, "the request body could not be read: send JSON encoded as UTF-8", err_type, None,
                          "invalid_body", headers=exc.headers)
        return _error(exc.status_code, str(exc.detail), err_type, None, None, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request", exc_info=exc)
        return _error(500, "internal server error; see the server log", "server_error", None, "internal_error")


# ----- middleware ----------------------------------------------------------------------------------

async def _send_error(send: Send, status: int, message: str, err_type: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, err_type, None, code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class DrainMiddleware:
    """While the server drains before it stops, every new request is answered 503 `server_shutting_down` and its
    connection closed; the requests already running go on."""

    def __init__(self, app: ASGIApp, engine: AsyncEngine) -> None:
        self.app = app
        self._engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._engine.draining:
            await _send_error(send, 503, SHUTTING_DOWN_MESSAGE, "server_error", "server_shutting_down",
                              {"Connection": "close"})
            return
        await self.app(scope, receive, send)


def bearer_credentials(authorization: bytes) -> bytes | None:
    """The credentials of an `Authorization: Bearer <credentials>` header; the scheme is case-insensitive
    (RFC 7235). None for another scheme or none."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credentials.lstrip(b" ") or None


def route_path(scope: Scope) -> str:
    """The path the routes match (Starlette's rule): under a root path, uvicorn's scope["path"] starts with it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` with one of the server's keys on every path but the open ones (`OPEN_PATHS`:
    a path equal to one, or under one that ends in "/"), compared in constant time."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app = app
        # Digests: equal lengths, so the comparison's time tells nothing of a key's length either.
        self._expected = [_digest(key.encode()) for key in api_keys]
        self._open = frozenset(open_paths)
        self._open_folders = tuple(path for path in open_paths if path.endswith("/") and path != "/")

    def _is_open(self, path: str) -> bool:
        return path in self._open or path.startswith(self._open_folders)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The path the routes see: under --root-path, uvicorn's scope["path"] carries the prefix.
        if scope["type"] == "http" and not self._is_open(route_path(scope)):
            credentials = bearer_credentials(dict(scope["headers"]).get(b"authorization", b""))
            given = _digest(credentials or b"")
            # Every key is compared (constant time each), so the time does not tell which one matched.
            if not sum(hmac.compare_digest(given, key) for key in self._expected) or credentials is None:
                await _send_error(send, 401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                  "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


MAX_JSON_DEPTH = 64
_DEPTH_SLICE = 256 << 10
_NOT_JSON_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects (brackets inside strings do not count); a text that opens
    at most MAX_JSON_DEPTH of them in all gets that count, a bound that spares the scan."""
    openers = body.count(b"[") + body.count(b"{")
    if openers <= MAX_JSON_DEPTH:  # cannot nest deeper than it opens; counting is ~30x faster than the scan
        return openers
    deepest = 0
    for step in _depth_steps(body):
        deepest = step
    return deepest


def _openers_up_to(chunk: bytes, most: int) -> int:
    """How many brackets open in the chunk, counted up to `most` (memchr-fast for the few a body usually has)."""
    found = 0
    for opener in b"[{":
        at = chunk.find(opener)
        while at >= 0 and found < most:
            found += 1
            at = chunk.find(opener, at + 1)
    return found


async def _json_depth_yielding(body: bytes) -> int:
    """json_depth of a large body, the event loop served between the steps of the scan."""
    deepest = 0
    for step in _depth_steps(body):
        deepest = step
        await asyncio.sleep(0)
    return deepest


def _depth_steps(body: bytes) -> Iterator[int]:
    """The deepest nesting so far after each slice of the body: work linear in the body's size whatever it holds
    (bytes methods and numpy, no Python loop over brackets or strings), a millisecond or two a slice."""
    depth = deepest = 0
    in_string = False
    start = 0
    while start < len(body):
        piece = body[start:start + _DEPTH_SLICE]
        if start + len(piece) < len(body) and piece.endswith(b"\\"):
            # A slice ends before a run of backslashes, or inside one after an even number of them (the run begins
            # the slice): never between a backslash and what it escapes.
            piece = piece.rstrip(b"\\") or body[start:start + max(2, len(piece) & ~1)]
        start += len(piece)
        if b"\\" in piece:
            # Escaped backslashes go first; then a backslash before a quote escapes it: left are strings' quotes.
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        chars = np.frombuffer(piece.translate(None, _NOT_JSON_STRUCTURE), np.uint8)
        quotes = chars == ord('"')
        if chars.size and (in_string or quotes.any()):
            inside = np.bitwise_xor.accumulate(quotes.view(np.uint8)) ^ np.uint8(in_string)
            in_string = bool(inside[-1])
            chars = chars[(inside == 0) & ~quotes]
        if chars.size:
            running = np.cumsum(_BRACKET_STEP[chars], dtype=np.int64)
            deepest = max(deepest, depth + int(running.max()))
            depth += int(running[-1])
        yield deepest


class BodyLimitMiddleware:
    """Reads at most `max_bytes` of a request body (413 beyond) within `timeout_s` (408 after) and refuses JSON
    nested deeper than MAX_JSON_DEPTH (400), then replays it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = openers = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await _send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s (raise "
                                  "--body-read-timeout for slow clients)", "invalid_request_error", "body_timeout",
                                  {"Connection": "close"})
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if chunk:
                chunks.append(chunk)
                if openers <= MAX_JSON_DEPTH:  # counted as the chunks come, and only as far as the bound
                    openers += _openers_up_to(chunk, MAX_JSON_DEPTH + 1 - openers)
            if not message.get("more_body", False):
                break
        if openers > MAX_JSON_DEPTH:
            body = b"".join(chunks)
            depth = json_depth(body) if size <= _DEPTH_SLICE else await _json_depth_yielding(body)
            if depth > MAX_JSON_DEPTH:
                await _send_error(send, 400, f"the request body nests JSON {depth} levels deep; at most "
                                  f"{MAX_JSON_DEPTH} are accepted", "invalid_request_error", "json_too_deep")
                return
            chunks = [body]
        replay = _replaying(chunks, receive)
        del chunks  # the replay holds them, and lets each go as it is given
        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _send_error(send, 413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                          "invalid_request_error", "request_too_large")


# ----- running ---------------------------------------------------------------------------------------

def startup_summary(engine: AsyncEngine) -> list[str]:
    """What a started engine runs: model, precision, KV cache capacity and concurrency, CUDA-graph capture."""
    config, runner = engine.core.config, engine.core.runner
    saved = (config.model.hf_config.get("quantization_config") or {}).get("quant_method")
    quant = config.quant.method or (f"{saved} (checkpoint)" if saved else "none")
    tokens = engine.core.num_blocks * config.cache.block_size
    lines = [f"model {config.model.model} ({config.model.architecture}), dtype {getattr(runner, 'dtype', '?')}, "
             f"quantization {quant}, device {getattr(runner, 'device', config.device)}",
             f"KV cache: {engine.core.num_blocks} blocks of {config.cache.block_size} tokens ({tokens:,} tokens, "
             f"{config.cache.kv_cache_dtype}); max_model_len {engine.max_model_len}: "
             f"{tokens / engine.max_model_len:.1f}x concurrency at full length; max_num_seqs "
             f"{config.scheduler.max_num_seqs}, max_num_batched_tokens {config.scheduler.max_num_batched_tokens}"]
    capture = getattr(runner, "capture_seconds", None)
    if getattr(runner, "graphs_pending", False):
        lines.append("CUDA graphs: captured while serving (graph_capture=serving), one before each step and while "
                     "idle; a step runs eagerly until its graph exists")
    elif capture:
        lines.append(f"CUDA graphs captured in {capture:.1f} s")
    pooler = config.model.pooler
    if pooler is not None:
        lines.append(f"pooling runner ({pooler.task}): {pooler.pooling_type} pooling"
                     f"{', normalized' if pooler.normalize else ''} (from the {pooler.source}); routes: "
                     "/v1/embeddings, /pooling, /score, /rerank, /classify; generation is refused")
    lines.append("routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /pooling, /score, "
                 "/rerank, /classify, /v1/models, /tokenize, /detokenize, /health, /ping, /version, /metrics, /docs; "
                 "the playground at /")
    return lines


def check_port_free(host: str, port: int) -> None:
    """ConfigError if the server could not bind (host, port) now: another process holds it, or the host is no
    address of this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ConfigError(f"cannot serve on {host}:{port}: {error.strerror}; stop what holds the port or pass "
                              "another --port (or --host)") from None


def run_server(config: ServerConfig, model: str, engine_args: dict[str, Any] | None = None) -> int:
    """Load the model, start the engine thread and serve until SIGTERM / SIGINT, then drain (`kestrel serve`)."""
    from kestrel.entrypoints.http_server import serve

    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config.chat_template_text()  # a --chat-template that names no file is refused before the model loads
    check_port_free(config.host, config.port)  # and an address in use, rather than after minutes of loading
    try:
        built_config = engine_config(model, **(engine_args or {}))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    # The tokenizer and grammar workers' fork server imports their libraries while the model loads (a refused
    # configuration starts none).
    tokenizer_path = str((engine_args or {}).get("tokenizer") or model)
    preload = ((tokenizer_modules(tokenizer_path) if config.tokenizer_processes else ())
               + (COMPILE_WORKER_MODULES if config.grammar_compile_workers else ()))
    if preload:
        start_fork_server(preload)
    try:
        try:
            core_process = config.engine_core_process
            if core_process is None:
                core_process = core_process_by_default(built_config)
            logger.info("engine core: %s", "in its own process" if core_process else "in the server's process")
            if core_process:
                engine = CoreClient.from_config(built_config, model, max_queued_requests=config.max_queued_requests,
                                                request_timeout_s=config.request_timeout,
                                                log_level=logging.getLogger().getEffectiveLevel())
            else:
                engine = AsyncEngine.from_config(built_config, model, max_queued_requests=config.max_queued_requests,
                                                 request_timeout_s=config.request_timeout)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        try:
            engine.start()
            for line in startup_summary(engine):
                logger.info(line)
            names = config.served_model_name or (model,)
            app = build_app(engine, names, config.api_key, config=config)
        except BaseException:
            engine.shutdown()  # an engine core process, or the engine thread, must not outlive a refusal
            raise
    except BaseException:
        stop_fork_server()  # nor a fork server still importing, which holds the command's output
        raise
    logger.info("garbage collector set for serving: %d start-up objects frozen", tune_for_serving())
    scheme = "https" if config.ssl_certfile else "http"
    print(f"kestrel: serving {names[0]!r} at {scheme}://{config.host}:{config.port}{config.root_path or ''}/v1",
          flush=True)
    try:
        serve(app, engine, config)
    finally:
        app.state.text_workers.close()
        if app.state.grammar_pool is not None:
            app.state.grammar_pool.close()
        engine.shutdown()
        # The interpreter's exit runs the cycle collector over every object torch and the model left: a second
        # or more on a busy machine, for memory the process returns anyway. Frozen objects are not traversed.
        gc.freeze()
    return 0

