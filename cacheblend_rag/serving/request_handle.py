"""RequestHandle: one request submitted to the scheduler, as its caller reads it (text deltas, then its
result or its error) and as the scheduler's worker feeds it."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Generic, Iterator, TypeVar

from cacheblend_rag.engine.decode import Decoding
from cacheblend_rag.engine.results import GenerationResult
from cacheblend_rag.errors import CacheBlendError

R = TypeVar("R")


class RequestCancelled(CacheBlendError, RuntimeError):
    """The request was cancelled (its stream closed) before it finished."""


# TEXT_END: the last delta went out; the request's bookkeeping (its K/V kept for the next call) follows, then DONE.
DELTA, TEXT_END, DONE, ERROR = "delta", "text_end", "done", "error"


class RequestHandle(Generic[R]):
    """One submitted request: iterate for its text deltas (blocking; the iteration ends with the text, before
    the request's bookkeeping), :meth:`result` for its end, :meth:`close` (or :meth:`cancel`) to drop it. Safe
    to read from any one thread."""

    def __init__(self, start: Callable[[], Decoding], finish: Callable[[GenerationResult], R],
                 kv_tokens: Callable[[], int] | None = None) -> None:
        self._start = start
        self._finish = finish
        self._kv_tokens = kv_tokens
        self.kv_need: int | None = None  # bytes of KV it will hold, once the worker sized it
        self.kv_reserved = 0  # bytes the ledger holds for it while it runs
        self._events: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._result: R | None = None
        self._error: BaseException | None = None
        self._ended = False
        self._text_ended = False
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.decoding: Decoding | None = None  # the worker's, while the request runs
        # perf_counter() time by which the text must have ended (a call's timeout): waiting for a delta past
        # it cancels the request and raises TimeoutError, whether it is queued, prefilling or decoding.
        self.deadline: float | None = None

    # -- the caller's side
    def __iter__(self) -> Iterator[str]:
        return self

    def _next_event(self) -> tuple[str, Any]:
        if self.deadline is None:
            return self._events.get()
        try:
            return self._events.get(timeout=max(0.0, self.deadline - time.perf_counter()))
        except queue.Empty:
            self.cancel()
            self._text_ended = self._ended = True
            self._error = TimeoutError(f"the request took longer than its timeout "
                                       f"({self.deadline - self.submitted:.3g} s from submission); "
                                       "raise timeout or ask for fewer tokens")
            raise self._error from None

    def __next__(self) -> str:
        if not self._text_ended:
            kind, value = self._next_event()
            if kind == DELTA:
                return value
            self._text_ended = True
            if kind != TEXT_END:
                self._end(kind, value)
        raise StopIteration

    def _end(self, kind: str, value: Any) -> None:
        self._ended = True
        if kind == ERROR:
            self._error = value
            raise value
        self._result = self._finish(value)

    def result(self) -> R:
        """Wait for the request to finish; its result (or its exception, raised)."""
        for _ in self:
            pass
        if not self._ended:  # the text ended: its bookkeeping, then the end
            self._end(*self._events.get())
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        self.cancelled.set()

    close = cancel  # a stream closed early is a cancelled request

    # -- the worker's side
    def _send(self, kind: str, value: Any) -> None:
        self._events.put((kind, value))
