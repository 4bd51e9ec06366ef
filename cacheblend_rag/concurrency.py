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
