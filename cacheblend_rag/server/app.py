"""``create_app``: the FastAPI app of ``cacheblend-rag serve``, OpenAI-compatible, with documents per request.

Routes: ``POST /v1/chat/completions`` (:mod:`~cacheblend_rag.server.completions`), ``POST
/v1/documents/warm``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``; docs/serving.md has their
shapes. The model loads in the lifespan's background (the socket is up at once, ``/health`` says 503 until
the model has answered a one-token request); at shutdown, after uvicorn has drained the running requests,
the scheduler is closed. Every error is OpenAI's shape (:mod:`~cacheblend_rag.server.errors`), FastAPI's own
validation errors included, and none takes the server down.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from cacheblend_rag.concurrency import run_in_thread
from cacheblend_rag.server.completions import answer
from cacheblend_rag.server.errors import APIError, api_error, loading_error
from cacheblend_rag.server.metrics import ServerMetrics
from cacheblend_rag.server.middleware import ServerGate
from cacheblend_rag.server.options import ServerConfig
from cacheblend_rag.server.protocol import ChatCompletionRequest, WarmRequest
from cacheblend_rag.server.schemas import (CHAT_ERRORS, READ_ERRORS, STREAM_EVENT, WARM_ERRORS, ChatCompletion, Health,
                                           ModelList, WarmResponse, errors)
from cacheblend_rag.server.state import FAILED, READY, ServerState
from cacheblend_rag.serving.settings import CacheBlendSettings
from cacheblend_rag.store.urls import redact


def create_app(source: Union[CacheBlendSettings, ServerConfig, None] = None, *,
               on_failure: Optional[Callable[[BaseException], None]] = None, **options: Any) -> FastAPI:
    """The server's app for ``source``: settings already loaded (the app then never closes their scheduler),
    or a :class:`ServerConfig` to load in the background (``None``: the default model, in memory).
    ``options`` set :class:`ServerConfig`'s HTTP fields (``served_model_name``, ``api_key``,
    ``max_body_bytes``, ``default_max_tokens``, ``warmup``, ``replica_id``); ``on_failure`` is called if loading
    fails."""
    if source is None:
        source = ServerConfig()
    if isinstance(source, ServerConfig):
        config = dataclasses.replace(source, **options)
    else:
        config = ServerConfig(model=source.model, **options)
    state = ServerState(source, config, on_failure)
    metrics = ServerMetrics(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        yield
        await run_in_thread(state.close)  # uvicorn drained the running requests first

    app = FastAPI(title="cacheblend-rag", summary="OpenAI-compatible chat completions with CacheBlend KV reuse",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.metrics = metrics
    _install_error_handlers(app, metrics)
    _add_routes(app, state, metrics)
    app.add_middleware(ServerGate, state=state, metrics=metrics)
    return app


def _ready(state: ServerState) -> CacheBlendSettings:
    if state.status != READY or state.settings is None:
        raise loading_error(state.status)
    return state.settings


def _add_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics) -> None:
    # What each route answers is declared for the OpenAPI schema (schemas.py), the stream's media type too.
    @app.post("/v1/chat/completions", responses={
        **CHAT_ERRORS, 200: {"model": ChatCompletion, "description": "The answer; with \"stream\": true, "
                             "Server-Sent Events of chat.completion.chunk objects, then [DONE]",
                             "content": {"text/event-stream": {"schema": STREAM_EVENT}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _ready(state)
        if body.model not in (None, state.name):
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves {state.name!r}",
                           param="model", code="model_not_found")
        return await answer(state, metrics, body, request)

    # exclude_none: a server without a replica_id answers without a "replica" key, not with a null one.
    @app.post("/v1/documents/warm", response_model=WarmResponse, response_model_exclude_none=True,
              responses=WARM_ERRORS)
    async def warm_documents(body: WarmRequest) -> dict[str, Any]:
        settings = _ready(state)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        try:
            summary = await run_in_thread(settings.service.warm, texts, salt=body.cache_salt or "")
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            raise api_error(exc, param="documents") from exc
        metrics.warmed.labels(result="computed").inc(summary.new)
        metrics.warmed.labels(result="already_stored").inc(summary.present)
        metrics.warmed.labels(result="failed").inc(summary.failed)
        return {"object": "documents.warm", "documents": len(texts), "computed": summary.new,
                "already_stored": summary.present, "failed": summary.failed, "replica": state.config.replica_id}

    @app.get("/v1/models", response_model=ModelList, responses=READ_ERRORS)
    async def list_models() -> dict[str, Any]:
        _ready(state)
        return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                            "owned_by": "cacheblend-rag", "max_model_len": state.context_window}]}

    @app.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
    async def health() -> Response:
        if state.status == READY:
            return JSONResponse({"status": "ok"})
        body = {"status": state.status}
        if state.status == FAILED and state.error is not None:
            body["error"] = redact(f"{type(state.error).__name__}: {state.error}")
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", response_class=Response, responses={**errors(401), 200: {
        "description": "Prometheus' text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(await run_in_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _validation_param(location: tuple[Any, ...]) -> Optional[str]:
    """``("body", "messages", 0, "content")`` as ``messages[0].content``; pydantic's names of a union's members
    (``DocumentIn``, ``str``, ``list[ContentPart]``) are left out, as no client wrote them."""
    param = ""
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not (part[:1].isupper() or part in _TYPE_TAGS or "[" in part):
            param += f".{part}" if param else part
    return param or None


async def _json_error(request: Request, errors: list[dict[str, Any]]) -> Optional[str]:
    """Why the body is not JSON, if it is not (FastAPI reads a body sent without a JSON content type as text
    and reports a type error instead)."""
    invalid = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if invalid is not None:
        return str(invalid.get("ctx", {}).get("error", "malformed JSON"))
    if not any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return None
    try:
        json.loads(await request.body())
    except ValueError as exc:
        return str(exc)
    return None


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def respond(error: APIError) -> JSONResponse:
        metrics.observe_error(error.code)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        malformed = await _json_error(request, errors)
        if malformed is not None:
            return respond(APIError.bad(f"the body is not valid JSON: {malformed}", code="invalid_json"))
        first = errors[0] if errors else {}
        param = _validation_param(tuple(first.get("loc", ())))
        described = "; ".join(f"{_validation_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}"
                              for e in errors[:3])
        return respond(APIError.bad(f"invalid request: {described}", param=param, code="invalid_type"
                                    if first.get("type") != "missing" else "missing_field"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return respond(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                                headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(api_error(exc))


__all__ = ["create_app"]
