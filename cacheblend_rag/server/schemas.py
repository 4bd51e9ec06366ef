"""The response bodies as the OpenAPI schema declares them (``GET /openapi.json``), route by route.

``/v1/documents/warm`` and ``/v1/models`` return their bodies through their model (``response_model``); the
completion, the errors and ``/health`` are built elsewhere (:mod:`~cacheblend_rag.server.responses`,
:mod:`~cacheblend_rag.server.errors`) and returned as they are, so for them these models only document. What
they promise is checked by the fuzz test (tests/server/test_fuzz.py), which validates every response the
fuzzer gets against the schema: a body or status a route does not declare here fails it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape (:mod:`~cacheblend_rag.server.errors`)."""

    error: ErrorDetail


class FunctionOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]  # null when the answer is only tool calls
    reasoning_content: Optional[str] = None  # present when the model thought aloud
    tool_calls: Optional[List[ToolCallOut]] = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: None


class TokenDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: TokenDetails


class ChatCompletion(BaseModel):
    """A whole answer; with ``"stream": true`` the 200 is ``text/event-stream`` instead."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[Choice]
    usage: Usage
    cacheblend: Dict[str, Any]  # the turn's blend stats (docs/serving.md)


class WarmResponse(BaseModel):
    object: Literal["documents.warm"]
    documents: int
    computed: int
    already_stored: int
    failed: int
    replica: Optional[str] = None  # the server's replica_id; absent when it has none


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: List[ModelCard]


class Health(BaseModel):
    """``ok`` (200), else the loading status (503) and, once loading failed, why."""

    status: str
    error: Optional[str] = None


# One Server-Sent Event of a stream (OpenAPI 3.1: a text/event-stream's schema is each event's): its data is a
# chat.completion.chunk as JSON, an {"error": ...} object when the answer fails after it began, or [DONE].
STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chat.completion.chunk or an error object, as JSON; the last is [DONE]"}}}


def errors(*statuses: int) -> dict[Any, dict[str, Any]]:
    """``responses=`` entries for ``statuses``, each an :class:`ErrorResponse`, and ``4XX`` for the rest: a route
    that takes a body would otherwise be declared to answer FastAPI's 422, which this server never sends
    (its validation errors are 400s in OpenAI's shape)."""
    declared: dict[Any, dict[str, Any]] = {status: {"model": ErrorResponse} for status in statuses}
    declared["4XX"] = {"model": ErrorResponse, "description": "Any other client error, in the same shape"}
    return declared


# What each kind of route can answer besides its 200 (errors.api_error's table; 401 only with --api-key).
LOADING = (401, 503)
BODY = (400, 401, 413, 503)
WORK = (429, 500, 504)
CHAT_ERRORS = errors(*BODY, 404, *WORK)
WARM_ERRORS = errors(*BODY, *WORK)
READ_ERRORS = errors(*LOADING)


__all__ = ["CHAT_ERRORS", "ChatCompletion", "ErrorResponse", "Health", "ModelList", "READ_ERRORS", "STREAM_EVENT",
           "WARM_ERRORS", "WarmResponse", "errors"]
