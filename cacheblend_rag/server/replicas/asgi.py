"""The server's own FastAPI app, run inside an engine replica without a socket of its own.

A replica receives each request from the front end as a :class:`ForwardedRequest` and answers it by
calling the app as an ASGI server would: its lifespan once (the model loads, the scheduler closes at
the end), then one ``http`` call per request, whose response comes back as its start (status and
headers) and then its body's pieces as the app sends them, so a stream stays a stream. Every route,
check and error body is then exactly the single server's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the front end read it."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: Optional[tuple[str, int]] = None


@dataclass(frozen=True)
class ResponseStart:
    """A response's status and headers, before its body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = field(default_factory=tuple)


class InProcessApp:
    """An ASGI app served in this process: :meth:`startup`, :meth:`call` per request, :meth:`shutdown`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._state: dict[str, Any] = {}
        self._lifespan_in: "asyncio.Queue[dict[str, Any]]" = asyncio.Queue()
        self._lifespan_out: "asyncio.Queue[dict[str, Any]]" = asyncio.Queue()
        self._lifespan: Optional[asyncio.Task] = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self._state}
        self._lifespan = asyncio.ensure_future(self.app(scope, self._lifespan_in.get, self._lifespan_out.put))
        await self._lifespan_in.put({"type": "lifespan.startup"})
        message = await self._lifespan_out.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {message.get('message', message['type'])}")

    async def shutdown(self) -> None:
        if self._lifespan is None or self._lifespan.done():
            return
        await self._lifespan_in.put({"type": "lifespan.shutdown"})
        await self._lifespan_out.get()
        await self._lifespan

    async def call(self, request: ForwardedRequest) -> AsyncIterator[Union[ResponseStart, bytes]]:
        """The response to ``request``: one :class:`ResponseStart`, then the body's non-empty pieces. Closing
        the iterator early tells the app the client went away (a stream's request is then cancelled)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode("latin-1"), "query_string": request.query, "root_path": "",
                 "headers": [(k.lower(), v) for k, v in request.headers], "client": request.client,
                 "server": ("127.0.0.1", 0), "state": dict(self._state)}
        sent: "asyncio.Queue[Optional[dict[str, Any]]]" = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, sent.put)
            except Exception:  # noqa: BLE001 - the app answered 500 already, if it could; logged here
                logger.exception("%s %s failed", request.method, request.path)
            finally:
                await sent.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    yield ResponseStart(int(message["status"]), tuple(
                        (bytes(k), bytes(v)) for k, v in message.get("headers", ())))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=30)
            except asyncio.TimeoutError:
                task.cancel()


__all__ = ["ForwardedRequest", "InProcessApp", "ResponseStart"]
