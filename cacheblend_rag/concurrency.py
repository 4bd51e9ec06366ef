"""Serving a blocking engine to async callers. Shared by the LlamaIndex and LangChain integrations."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")

_ITEM, _ERROR, _DONE = "item", "error", "done"


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield the items of a blocking iterator that runs entirely in one worker thread.

    One thread for the whole iteration (not one per item), so that locks taken inside the
    iterator are acquired and released by the same thread; the caller's context variables
    (callback managers, tracing) are copied into it. Leaving early stops the iterator at its
    next item, so a decode does not run on for nobody.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def send(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def produce() -> None:
        iterator = make_iterator()
        try:
            for item in iterator:
                send(_ITEM, item)
                if stop.is_set():
                    break
        except BaseException as exc:  # handed to the awaiting side, which re-raises it
            send(_ERROR, exc)
        else:
            send(_DONE, None)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(produce,), name="cacheblend-stream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        stop.set()


async def run_in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``await`` a blocking call run in a thread of its own, with the caller's context variables.

    Not ``asyncio.to_thread``: its default executor has ``min(32, cores + 4)`` threads (6 on two
    cores), which would cap how many requests an ``asyncio.gather`` can hand the scheduler at once.
    The thread only waits for the scheduler's worker, which does the computing."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def work() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            # Bound now: Python unbinds ``exc`` when the except block ends, before the loop runs the callback.
            settle(lambda exc=exc: done.cancelled() or done.set_exception(exc))
        else:
            settle(lambda: done.cancelled() or done.set_result(value))

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(work,), name="cacheblend-call", daemon=True).start()
    return await done
