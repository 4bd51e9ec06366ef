"""What every request passes before a route: the API key, the body-size bound, and its count and latency.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps a streamed response in a
task of its own, which delays a stream's chunks and hides a client's disconnect from the route. Here the
body is read (up to the bound, 413 beyond it, before any JSON is parsed) and replayed to the route, and
the messages that follow it (``http.disconnect``) go through unchanged, so the route sees a client leave.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any, Awaitable, Callable, Optional

from cacheblend_rag.server.errors import APIError
from cacheblend_rag.server.metrics import ServerMetrics
from cacheblend_rag.server.options import MAX_BODY_SLACK
from cacheblend_rag.server.state import ServerState

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths answered without the API key: a load balancer's health check carries none.
OPEN_PATHS = frozenset({"/health"})


class ServerGate:
    """Checks the key and the body's size, counts the request and times it (see the module)."""

    def __init__(self, app: ASGIApp, state: ServerState, metrics: ServerMetrics) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                receive, refusal = await self._bounded(scope, receive)
            if refusal is not None:
                self.metrics.observe_error(refusal.code)
                await send_error(counted, refusal)
                return
            await self.app(scope, receive, counted)
        finally:
            self.metrics.observe_request(scope["path"], status[0], time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> Optional[APIError]:
        """A 401 unless the request carries ``Authorization: Bearer <key>`` (when the server has a key)."""
        key = self.state.config.api_key
        if not key or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
            return None
        what = "no API key was sent" if not given else "the API key is not this server's"
        return APIError(401, f"{what}: send the header 'Authorization: Bearer <key>' with the key the server was "
                        "started with (--api-key or $CACHEBLEND_API_KEY)", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})

    async def _bounded(self, scope: Scope, receive: Receive) -> tuple[Receive, Optional[APIError]]:
        """The body read whole, if within the bound, and a ``receive`` that replays it; else a 413."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive, None
        limit = self.state.body_limit() or self.state.config.max_body_bytes or MAX_BODY_SLACK
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return receive, _too_large(int(declared), limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return _replay([message], receive), None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return receive, _too_large(size, limit, at_least=True)
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), None


def _too_large(size: int, limit: int, *, at_least: bool = False) -> APIError:
    return APIError(413, f"the request body has {'more than ' if at_least else ''}{size:,} bytes, more than this "
                    f"server's limit of {limit:,} (64 bytes a token of the context window and 1 MiB, unless "
                    "--max-body-bytes says otherwise)", code="request_too_large")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then what the client sends next (its disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


async def send_error(send: Send, error: APIError) -> None:
    """``error`` as a whole JSON response, straight on the ASGI connection."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["OPEN_PATHS", "ServerGate", "send_error"]
