"""The single server's own app run as an engine replica runs it (``InProcessApp``, no socket, no Ray): the tiny
model loads in the lifespan, ``/health`` turns 200, and a chat completion with documents answers with the
replica's name in its ``cacheblend`` stats, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
from cacheblend_rag.server.app import create_app  # noqa: E402
from cacheblend_rag.server.options import ServerConfig  # noqa: E402
from cacheblend_rag.server.replicas.asgi import ForwardedRequest, InProcessApp, ResponseStart  # noqa: E402

TINY_MODEL = "tiny-llama"  # tests/server/conftest.py's
JSON = ((b"content-type", b"application/json"),)


async def call(app: InProcessApp, method: str, path: str, body=None) -> tuple[ResponseStart, list[bytes]]:
    request = ForwardedRequest(method, path, headers=JSON if body is not None else (),
                               body=json.dumps(body).encode() if body is not None else b"")

    async def run():
        return [part async for part in app.call(request)]

    parts = await asyncio.wait_for(run(), 120)
    assert isinstance(parts[0], ResponseStart)
    return parts[0], parts[1:]


async def test_the_servers_app_answers_in_process_as_replica_r1(unique_documents):
    # close_on_shutdown=False: the tiny engine (and its scheduler) is shared with the other tests of the process.
    app = InProcessApp(create_app(ServerConfig(model=TINY_MODEL, store=None, replica_id="r1", close_on_shutdown=False)))
    await asyncio.wait_for(app.startup(), 30)
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            start, _ = await call(app, "GET", "/health")
            seen.append(start.status)
            if start.status == 200:
                break
            await asyncio.sleep(0.1)
        assert seen[-1] == 200 and set(seen) <= {503, 200}, seen

        body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "What do the reports say?"}],
                "documents": unique_documents[:2], "max_tokens": 2}
        start, pieces = await call(app, "POST", "/v1/chat/completions", body)
        answer = json.loads(b"".join(pieces))
        assert start.status == 200, answer
        assert isinstance(answer["cacheblend"], dict) and answer["cacheblend"]["replica"] == "r1"
        assert answer["choices"][0]["message"]["role"] == "assistant"

        start, pieces = await call(app, "POST", "/v1/chat/completions",
                                   {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert start.status == 200 and dict(start.headers)[b"content-type"].startswith(b"text/event-stream")
        events = [line.removeprefix(b"data: ") for line in b"".join(pieces).split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["cacheblend"]["replica"] == "r1"
        assert len(pieces) > 1  # streamed as the app sent it, not one buffered body
    finally:
        await asyncio.wait_for(app.shutdown(), 30)
