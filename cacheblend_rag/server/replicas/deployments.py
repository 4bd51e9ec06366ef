"""The Ray Serve application: a front end that routes, and N engine replicas that each run the server.

``CacheBlendFront`` is the ingress (``@serve.ingress``): it reads a request, names its documents
(:func:`~cacheblend_rag.server.replicas.routing.request_documents`) and hands it to an engine replica
through a handle whose router is the chunk router, streaming the answer back as the replica's app
sends it. ``CacheBlendEngine`` is one engine and one scheduler, running the single server's own
FastAPI app in process (:mod:`~cacheblend_rag.server.replicas.asgi`), so each route answers exactly as
``cacheblend-rag serve`` does, plus ``x-cacheblend-replica`` and ``cacheblend.replica``. Every replica
opens the same shared store (Redis), in front of which each keeps its own memory tier.

A replica that dies mid-request fails only its own requests: one not yet answered gets a 503 in
OpenAI's error shape (clients retry it, and Ray sends the retry to a live replica), a stream already
under way ends with an error event.
"""

# No `from __future__ import annotations`: FastAPI reads the front end's route signature through Ray's
# wrapper, whose globals would not resolve a string annotation (``request`` became a query parameter).

import asyncio
import dataclasses
import json
import logging
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cacheblend_rag.server.options import ServerConfig
from cacheblend_rag.server.replicas.asgi import ForwardedRequest, InProcessApp, ResponseStart
from cacheblend_rag.server.replicas.routing import request_documents

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-cacheblend-replica"
# Hop-by-hop headers of the replica's response that the front end's own server sets itself.
_HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})
# The most document digests a replica reports (its memory tier holds at most this many chunks' worth).
MAX_REPORTED_DOCUMENTS = 65536
# A front end reads at most this much of a body when the server sets no bound of its own; the replica
# then applies the single server's own bound (413), which depends on the model's window.
FRONT_BODY_LIMIT = 64 << 20


class CacheBlendEngine:
    """One engine replica: the single server's app, in process; what its memory tier holds, reported."""

    async def __init__(self, config: ServerConfig, threads: Optional[int] = None) -> None:
        from ray import serve

        from cacheblend_rag.server.app import create_app
        from cacheblend_rag.server.state import FAILED

        if threads:
            import torch

            torch.set_num_threads(threads)  # replicas sharing a machine share its cores
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = InProcessApp(create_app(dataclasses.replace(config, replica_id=self.replica_id)))
        await self.app.startup()
        self.state = self.app.app.state.server
        # Ray sends requests once __init__ returns: only a loaded, warmed-up replica is one to send to.
        while not self.state.ready.is_set() and self.state.status != FAILED:
            await asyncio.sleep(0.1)
        if self.state.status == FAILED:
            raise RuntimeError(f"the model could not be loaded: {type(self.state.error).__name__}: {self.state.error}")
        self._served: OrderedDict[str, None] = OrderedDict()  # document digests, most recently answered last

    async def forward(self, request: ForwardedRequest,
                      documents: Sequence[str] = ()) -> AsyncIterator[Union[ResponseStart, bytes]]:
        """The app's response to ``request``; ``documents`` (their digests) are what the router routed by."""
        answered = False
        async for part in self.app.call(request):
            if isinstance(part, ResponseStart):
                answered = part.status == 200
                part = ResponseStart(part.status, (*part.headers, (REPLICA_HEADER, self.replica_id.encode())))
            yield part
        if answered:
            for digest in documents:
                self._served.pop(digest, None)
                self._served[digest] = None
            while len(self._served) > MAX_REPORTED_DOCUMENTS:
                self._served.popitem(last=False)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the chunk router reads of this replica: the documents its memory tier holds, approximated
        by the ones it answered last, as many as the tier holds chunks (a document is one chunk)."""
        settings = self.state.settings
        resident = getattr(getattr(settings, "service", None), "chunk_cache", None)
        tier = getattr(resident, "resident", None)
        held = tier.stats()["entries"] if tier is not None else 0
        recent = list(self._served)[-held:] if held else []
        return {"replica": self.replica_id, "documents": recent}

    def check_health(self) -> None:
        from cacheblend_rag.server.state import FAILED

        if self.state.status == FAILED:
            raise RuntimeError(f"the engine failed: {self.state.error}")

    async def __del__(self) -> None:
        await self.app.shutdown()  # the scheduler closes once Ray has drained this replica's requests


def replica_failure(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error body for a request whose replica stopped before it answered."""
    return {"error": {"message": f"the replica answering this request stopped ({type(exc).__name__}); retry it: "
                                 "the other replicas are answering, and Ray restarts this one",
                      "type": "service_unavailable", "param": None, "code": "replica_failed"}}


def front_deployment(body_limit: Optional[int]) -> Any:
    """The ingress class, its FastAPI app built here (Ray binds the routes to the class at decoration)."""
    from ray import serve

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the replica's app answers /openapi.json
    limit = body_limit or FRONT_BODY_LIMIT

    @serve.ingress(app)
    class CacheBlendFront:
        def __init__(self, engine: Any) -> None:
            self.engine = engine.options(stream=True)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
                       include_in_schema=False)
        async def forward(self, path: str, request: Request) -> Response:
            body = bytearray()
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    return JSONResponse({"error": {"message": f"the request body is over {limit} bytes", "type":
                                                   "invalid_request_error", "param": None,
                                                   "code": "request_too_large"}}, status_code=413)
            client = (request.client.host, request.client.port) if request.client else None
            forwarded = ForwardedRequest(request.method, request.url.path, request.url.query.encode("latin-1"),
                                         tuple(request.headers.raw), bytes(body), client)
            stream = self.engine.forward.remote(forwarded, documents=request_documents(forwarded.path, bytes(body)))
            try:
                start = await stream.__anext__()
            except Exception as exc:  # noqa: BLE001 - the replica died or could not be reached
                logger.warning("%s %s: its replica stopped: %s: %s", request.method, forwarded.path,
                               type(exc).__name__, exc)
                return JSONResponse(replica_failure(exc), status_code=503, headers={"Retry-After": "1"})
            response = StreamingResponse(_rest(stream, start), status_code=start.status)
            response.raw_headers = [(k, v) for k, v in start.headers if k.lower() not in _HOP_HEADERS]
            return response

    return CacheBlendFront


async def _rest(stream: Any, start: ResponseStart) -> AsyncIterator[bytes]:
    """The body after its start; a replica lost mid-stream ends a Server-Sent Events answer with an error event."""
    events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
    finished = False
    try:
        async for piece in stream:
            yield piece
        finished = True
    except Exception as exc:  # noqa: BLE001 - the client is told, in the stream's own format where it has one
        logger.warning("a stream's replica stopped mid-answer: %s: %s", type(exc).__name__, exc)
        finished = True
        if events:
            yield f"data: {json.dumps(replica_failure(exc))}\n\n".encode()
    finally:
        if not finished:  # the client went away: the replica's request is cancelled
            stream.cancel()


__all__ = ["CacheBlendEngine", "MAX_REPORTED_DOCUMENTS", "REPLICA_HEADER", "front_deployment", "replica_failure"]
