"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status each deserves.

Every failure a request can meet becomes an :class:`APIError` here, in one table, so that the routes, the
stream (an error after the first chunk) and the metrics agree on its status and code, and a client's
OpenAI library raises the exception it would raise against OpenAI (``BadRequestError`` for 400,
``RateLimitError`` for 429...). Nothing here imports FastAPI.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from cacheblend_rag.errors import BlendInputError, CacheBlendError
from cacheblend_rag.serving.admission import KVBudgetError
from cacheblend_rag.serving.request_handle import RequestCancelled
from cacheblend_rag.serving.scheduler import SchedulerFullError
from cacheblend_rag.store.urls import redact

INVALID = "invalid_request_error"
# Seconds a client told "queue full" waits before it tries again (Retry-After).
RETRY_AFTER_S = 1
_WINDOW = re.compile(r"more than the model's context window")


class APIError(Exception):
    """One error response: its status, OpenAI's four fields and any headers (``Retry-After``)."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        message = redact(message)  # an exception's text may quote a URL: the response never shows its password
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def bad(cls, message: str, param: Optional[str] = None, code: Optional[str] = None) -> "APIError":
        """A 400: the request asks for something this server cannot do, ``param`` naming the field."""
        return cls(400, message, param=param, code=code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def context_length_error(message: str, param: str = "messages") -> APIError:
    return APIError.bad(message, param=param, code="context_length_exceeded")


def loading_error(status: str) -> APIError:
    """What a request gets before the model is ready (503; clients retry)."""
    return APIError(503, f"the model is not ready yet ({status}); retry in a moment, or wait for GET /health "
                    "to answer 200", type="service_unavailable", code="model_loading",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def api_error(exc: BaseException, param: Optional[str] = None) -> APIError:
    """The response ``exc`` deserves: bad input a 400 naming ``param`` where it is known, overload a 429,
    a timeout a 504, anything unexpected a 500 with the exception's type and message (never a traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SchedulerFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, KVBudgetError):
        return APIError.bad(str(exc), code="kv_budget_exceeded")
    if isinstance(exc, BlendInputError) and _WINDOW.search(str(exc)):
        return context_length_error(str(exc))
    if isinstance(exc, CacheBlendError) and isinstance(exc, ValueError):  # ConfigError, BlendInputError...
        return APIError.bad(str(exc), param=param)
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc) or "the request took longer than its timeout", type="timeout_error",
                        code="timeout")
    if isinstance(exc, RequestCancelled) or (isinstance(exc, RuntimeError) and "scheduler is closed" in str(exc)):
        return APIError(503, f"the request was cancelled: {exc} (the server is shutting down?)",
                        type="service_unavailable", code="cancelled")
    if _is_template_error(exc):
        return APIError.bad(f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}",
                            param="messages", code="chat_template_error")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error")


def _is_template_error(exc: BaseException) -> bool:
    """A jinja error raised by the chat template (``raise_exception('Conversation roles must alternate')``)."""
    return any(cls.__module__.startswith("jinja2") for cls in type(exc).__mro__)


__all__ = ["APIError", "INVALID", "RETRY_AFTER_S", "api_error", "context_length_error", "loading_error"]
