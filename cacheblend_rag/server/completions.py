"""``POST /v1/chat/completions``: one request's turn run off the event loop, answered whole or as a stream.

Each request gets a thread of its own (:func:`~cacheblend_rag.concurrency.iterate_in_thread`) that checks
and renders it (:func:`~cacheblend_rag.server.translate.prepare_turn`) and iterates
:func:`~cacheblend_rag.serving.chat_turn.run_turn`; the thread only waits on the scheduler, which blends and
decodes the requests in flight together, so many concurrent requests reach it at once and the loop stays free.

A stream's first event is awaited before the response starts, so that what fails before the answer begins
(a full queue, a prompt beyond the window) still gets its own status; an error after that is one
``data: {"error": ...}`` event before ``[DONE]``. A client that leaves cancels its request: a stream's
iteration is cancelled by Starlette when the client disconnects, a whole answer's by a watcher of the
connection; either way the thread closes the ``run_turn`` generator at its next token, which cancels the
request on the scheduler and frees its slot and KV.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Iterator, Optional, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cacheblend_rag.concurrency import iterate_in_thread
from cacheblend_rag.server.errors import api_error
from cacheblend_rag.server.metrics import ServerMetrics
from cacheblend_rag.server.protocol import ChatCompletionRequest
from cacheblend_rag.server.responses import (Answer, ChunkWriter, completion, completion_id, finish_reason, sse,
                                             tool_calls)
from cacheblend_rag.server.state import ServerState
from cacheblend_rag.server.translate import prepare_turn
from cacheblend_rag.serving.chat_turn import ReasoningDelta, TextDelta, ToolCalls, TurnEnd, TurnEvent, run_turn

T = TypeVar("T")
# What a request whose client left is logged with (nginx's "client closed request"); nobody reads it.
CLIENT_CLOSED = 499
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class TurnRun:
    """One chat completion's events, from a thread of its own, with its time to first token."""

    def __init__(self, state: ServerState, metrics: ServerMetrics, request: ChatCompletionRequest) -> None:
        self.state = state
        self.metrics = metrics
        self.request = request
        self.started = time.perf_counter()
        self.first_at: Optional[float] = None

    def _events(self) -> Iterator[TurnEvent]:  # in the request's thread
        turn = prepare_turn(self.state, self.request)
        yield from run_turn(self.state.settings, turn)

    async def events(self) -> AsyncIterator[TurnEvent]:
        async for event in iterate_in_thread(self._events):
            if self.first_at is None:  # the first text, reasoning or call; the end, for an empty answer
                self.first_at = time.perf_counter()
            if isinstance(event, TurnEnd):
                self.metrics.observe_turn(event, self.first_at - self.started)
            yield event


async def answer(state: ServerState, metrics: ServerMetrics, body: ChatCompletionRequest,
                 request: Request) -> Response:
    """The response to ``body``: a stream when it asks for one, else the whole completion."""
    run = TurnRun(state, metrics, body)
    if body.stream:
        return await _stream(run, metrics, request)
    try:
        result = await _until_disconnected(request, _collect(run))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:  # noqa: BLE001 - every failure is answered in OpenAI's shape
        raise api_error(exc) from exc
    return JSONResponse(completion(result, id=completion_id(), created=int(time.time()), model=state.name,
                                   replica=state.config.replica_id))


async def _collect(run: TurnRun) -> Answer:
    result = Answer()
    async for event in run.events():
        if isinstance(event, TextDelta):
            result.text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            result.reasoning.append(event.text)
        elif isinstance(event, ToolCalls):
            result.calls.extend(event.calls)
        elif isinstance(event, TurnEnd):
            result.end = event
    return result


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (ClientGone)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done or watcher.exception() is not None:
            return await task  # answered, or the connection could not be watched: the answer still counts
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done; this handler's own cancellation cancels the work too


async def _stream(run: TurnRun, metrics: ServerMetrics, request: Request) -> Response:
    events = run.events()
    try:
        first: Optional[TurnEvent] = await _until_disconnected(request, events.__anext__())
    except StopAsyncIteration:
        first = None
    except ClientGone:  # before the first token: the request is cancelled as a stream's would be
        await events.aclose()
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:  # noqa: BLE001 - before the stream starts: the error's own status
        await events.aclose()
        raise api_error(exc) from exc
    options = run.request.stream_options
    writer = ChunkWriter(run.state.name, include_usage=bool(options and options.include_usage),
                         replica=run.state.config.replica_id)
    return StreamingResponse(_chunks(writer, first, events, metrics), media_type="text/event-stream",
                             headers=_STREAM_HEADERS)


async def _chunks(writer: ChunkWriter, first: Optional[TurnEvent], events: AsyncIterator[TurnEvent],
                  metrics: ServerMetrics) -> AsyncIterator[str]:
    """The stream's events: the role, text and reasoning deltas, the calls, the finish, the usage, ``[DONE]``."""
    yield sse(writer.chunk({"role": "assistant", "content": ""}))
    calls: list[Any] = []
    try:
        pending = [first] if first is not None else []
        while True:
            event = pending.pop() if pending else await _next(events)
            if event is None:
                break
            if isinstance(event, TextDelta):
                yield sse(writer.chunk({"content": event.text}))
            elif isinstance(event, ReasoningDelta):
                yield sse(writer.chunk({"reasoning_content": event.text}))
            elif isinstance(event, ToolCalls):
                calls.extend(event.calls)
                yield sse(writer.chunk({"tool_calls": tool_calls(event.calls, indexed=True)}))
            elif isinstance(event, TurnEnd):
                yield sse(writer.chunk({}, finish_reason(event, calls)))
                if writer.include_usage:
                    yield sse(writer.usage_chunk(event))
    except Exception as exc:  # noqa: BLE001 - after the stream started: one error event, then [DONE]
        error = api_error(exc)
        metrics.observe_error(error.code)
        yield sse(error.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


async def _next(events: AsyncIterator[TurnEvent]) -> Optional[TurnEvent]:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


__all__ = ["CLIENT_CLOSED", "TurnRun", "answer"]
