"""``InProcessApp`` (``cacheblend_rag.server.replicas.asgi``) over a small FastAPI app of the test's own: the
lifespan at startup and shutdown, a JSON answer, a stream that stays a stream, a route that raises (a 500,
no hang) and a client that goes away mid-stream (the app is told, and the call ends at once)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from cacheblend_rag.server.replicas.asgi import ForwardedRequest, InProcessApp, ResponseStart  # noqa: E402

TIMEOUT_S = 5.0


class Probe:
    """What the test app saw."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.gate = asyncio.Event()


def make_app(probe: Probe) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        probe.events.append("started")
        yield {"flag": "lifespan-state"}
        probe.events.append("stopped")

    app = FastAPI(lifespan=lifespan)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": await request.json(), "flag": request.state.flag, "query": dict(request.query_params),
                "header": request.headers.get("x-probe"), "method": request.method}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def pieces():
            yield b"piece-0;"
            await probe.gate.wait()  # the first piece must reach the caller before the app goes on
            yield b"piece-1;"
            yield b"piece-2;"

        return StreamingResponse(pieces(), media_type="text/plain")

    @app.get("/endless")
    async def endless(request: Request) -> StreamingResponse:
        async def pieces():
            try:
                while True:
                    if await request.is_disconnected():
                        probe.events.append("disconnected")
                        return
                    yield b"x"
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                probe.events.append("cancelled")
                raise

        return StreamingResponse(pieces())

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("boom")

    return app


async def collect(app: InProcessApp, request: ForwardedRequest) -> list:
    async def run() -> list:
        return [part async for part in app.call(request)]

    return await asyncio.wait_for(run(), TIMEOUT_S)


@pytest.fixture
async def served():
    probe = Probe()
    app = InProcessApp(make_app(probe))
    await asyncio.wait_for(app.startup(), TIMEOUT_S)
    yield app, probe
    await asyncio.wait_for(app.shutdown(), TIMEOUT_S)


async def test_startup_and_shutdown_run_the_lifespan():
    probe = Probe()
    app = InProcessApp(make_app(probe))
    await app.shutdown()  # before startup: nothing to do
    await asyncio.wait_for(app.startup(), TIMEOUT_S)
    assert probe.events == ["started"]
    await asyncio.wait_for(app.shutdown(), TIMEOUT_S)
    assert probe.events == ["started", "stopped"]
    await app.shutdown()  # twice: still nothing more
    assert probe.events == ["started", "stopped"]


async def test_a_lifespan_that_fails_fails_startup():
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        raise OSError("no model here")
        yield

    app = InProcessApp(FastAPI(lifespan=lifespan))
    with pytest.raises(RuntimeError, match="did not start"):
        await asyncio.wait_for(app.startup(), TIMEOUT_S)
    with pytest.raises(OSError):
        await app._lifespan  # retrieved, so that asyncio does not warn of an exception never retrieved


async def test_a_json_answer_comes_as_a_start_then_its_body(served):
    app, _ = served
    headers = ((b"Content-Type", b"application/json"), (b"X-Probe", b"yes"))
    request = ForwardedRequest("POST", "/echo", b"a=1&b=two", headers, json.dumps({"k": [1, 2]}).encode())
    parts = await collect(app, request)
    start, body = parts[0], b"".join(parts[1:])
    assert isinstance(start, ResponseStart) and start.status == 200
    assert all(isinstance(p, bytes) and p for p in parts[1:])
    assert dict(start.headers)[b"content-type"] == b"application/json"
    assert json.loads(body) == {"body": {"k": [1, 2]}, "flag": "lifespan-state", "query": {"a": "1", "b": "two"},
                                "header": "yes", "method": "POST"}


async def test_an_unknown_route_is_the_apps_own_404(served):
    app, _ = served
    parts = await collect(app, ForwardedRequest("GET", "/nowhere"))
    assert parts[0].status == 404 and json.loads(b"".join(parts[1:])) == {"detail": "Not Found"}


async def test_a_stream_stays_a_stream(served):
    app, probe = served
    parts = app.call(ForwardedRequest("GET", "/stream"))
    start = await asyncio.wait_for(parts.__anext__(), TIMEOUT_S)
    assert isinstance(start, ResponseStart) and start.status == 200
    assert await asyncio.wait_for(parts.__anext__(), TIMEOUT_S) == b"piece-0;"  # before the app may go on
    probe.gate.set()
    rest = await asyncio.wait_for(_rest(parts), TIMEOUT_S)
    assert rest == [b"piece-1;", b"piece-2;"]  # each piece on its own, none merged, no empty end piece


async def _rest(parts) -> list:
    return [p async for p in parts]


async def test_a_route_that_raises_answers_500_and_ends(served, caplog):
    app, _ = served
    with caplog.at_level(logging.ERROR, logger="cacheblend_rag.server.replicas.asgi"):
        parts = await collect(app, ForwardedRequest("GET", "/boom"))
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 500
    assert b"".join(parts[1:]) == b"Internal Server Error"  # starlette's ServerErrorMiddleware
    assert any("/boom failed" in r.getMessage() for r in caplog.records)
    again = await collect(app, ForwardedRequest("POST", "/echo", body=b"{}"))  # the app still answers
    assert again[0].status == 200


async def test_closing_the_call_early_tells_the_app_the_client_went_away(served):
    app, probe = served
    parts = app.call(ForwardedRequest("GET", "/endless"))
    assert (await asyncio.wait_for(parts.__anext__(), TIMEOUT_S)).status == 200
    assert await asyncio.wait_for(parts.__anext__(), TIMEOUT_S) == b"x"
    began = time.monotonic()
    await asyncio.wait_for(parts.aclose(), TIMEOUT_S)
    assert time.monotonic() - began < 2.0
    assert {"disconnected", "cancelled"} & set(probe.events), probe.events
    after = await collect(app, ForwardedRequest("POST", "/echo", body=b"[]"))  # and it goes on answering
    assert after[0].status == 200
