"""RequestScheduler: one worker thread per engine that blends and decodes every request together.

The engine computes one thing at a time and owns no thread; this is where concurrency lives.
Callers on any thread (or an event loop's worker thread) submit a request and read its text
deltas from a :class:`RequestHandle`. The worker, and only the worker, touches the engine and
torch. Each iteration it

1. runs one step of a queued job (a batch of chunk precompute for ``warm``, say), so jobs share
   the cores with requests instead of racing them;
2. admits waiting requests, first come first served, while the batch has room: their prompt is
   prepared and blended (prefill), ``max_prefills_per_step`` of them at most, so the requests
   already decoding wait for at most that many blends between two of their tokens;
3. runs one batched decode step for every running request (continuous batching: a request joins
   after its blend and leaves when it finishes), and hands each its text.

Every request keeps its own sampler, seed, stop strings and JSON constraint. A request whose
handle is closed (or whose task is cancelled) is dropped at the next step; a request that fails
fails alone; a reader that reads slowly never holds the worker, which only appends to its queue.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Generator, Generic, Iterator, TypeVar

import torch

from cacheblend_rag.config import SchedulerConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.engine.decode import Decoding, decode_logits
from cacheblend_rag.engine.results import GenerationResult
from cacheblend_rag.errors import CacheBlendError

logger = logging.getLogger(__name__)

R = TypeVar("R")
J = TypeVar("J")


class SchedulerFullError(CacheBlendError, RuntimeError):
    """The scheduler's waiting queue is full: the server is overloaded."""


class RequestCancelled(CacheBlendError, RuntimeError):
    """The request was cancelled (its stream closed) before it finished."""


_DELTA, _DONE, _ERROR = "delta", "done", "error"


class RequestHandle(Generic[R]):
    """One submitted request: iterate for its text deltas (blocking), :meth:`result` for its end,
    :meth:`close` (or :meth:`cancel`) to drop it. Safe to read from any one thread."""

    def __init__(self, start: Callable[[], Decoding], finish: Callable[[GenerationResult], R]) -> None:
        self._start = start
        self._finish = finish
        self._events: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._result: R | None = None
        self._error: BaseException | None = None
        self._ended = False
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.decoding: Decoding | None = None  # the worker's, while the request runs

    # -- the caller's side
    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        kind, value = self._events.get()
        if kind == _DELTA:
            return value
        self._ended = True
        if kind == _ERROR:
            self._error = value
            raise value
        self._result = self._finish(value)
        raise StopIteration

    def result(self) -> R:
        """Wait for the request to finish; its result (or its exception, raised)."""
        for _ in self:
            pass
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


class _Job(Generic[J]):
    """Work run on the worker between decode steps, one ``next()`` per iteration."""

    def __init__(self, steps: Generator[Any, None, J]) -> None:
        self.steps = steps
        self.future: "Future[J]" = Future()


class RequestScheduler:
    """Admits, batches and retires the requests of one engine (see the module's docstring).

    The worker thread starts with the first submission and runs until :meth:`close`."""

    def __init__(self, engine: CacheBlendEngine, config: SchedulerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle[Any]] = deque()
        self._jobs: deque[_Job[Any]] = deque()
        self._running: list[RequestHandle[Any]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # decode steps run
        self.step_tokens = 0  # tokens those steps decoded (their batch sizes summed)
        self.finished = 0
        self.failed = 0
        self.cancelled = 0
        self.rejected = 0

    # ------------------------------------------------------------ submitting
    def submit(self, start: Callable[[], Decoding], finish: Callable[[GenerationResult], R]) -> RequestHandle[R]:
        """Queue a request. ``start`` runs on the worker: it prepares and blends the prompt and
        returns its :class:`Decoding`; ``finish`` turns the engine's result into the handle's.
        Raises :class:`SchedulerFullError` when ``max_waiting`` requests already wait."""
        handle: RequestHandle[R] = RequestHandle(start, finish)
        with self._cond:
            self._check_open()
            if len(self._waiting) >= self.config.max_waiting:
                self.rejected += 1
                raise SchedulerFullError(
                    f"{len(self._waiting)} requests are already waiting (max_waiting={self.config.max_waiting}, "
                    f"{len(self._running)} running): retry later, or raise the limit with "
                    "scheduler_for(engine).configure(max_waiting=...)")
            self._waiting.append(handle)
            self._wake()
        return handle

    def run_job(self, steps: Generator[Any, None, J]) -> "Future[J]":
        """Run ``steps`` on the worker, one step per iteration between decode steps; the future
        holds the generator's return value (or its exception)."""
        job: _Job[J] = _Job(steps)
        with self._cond:
            self._check_open()
            self._jobs.append(job)
            self._wake()
        return job.future

    def call(self, fn: Callable[[], J]) -> J:
        """Run ``fn`` on the worker (between decode steps) and wait for its result."""
        def one_step() -> Generator[None, None, J]:
            return fn()
            yield  # a generator of no steps: all of fn runs as one

        return self.run_job(one_step()).result()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this scheduler is closed; make a new one (serving.scheduler_for) for new requests")

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"cacheblend-scheduler-{self.engine.model_name}",
                                            daemon=True)
            self._thread.start()
            # A daemon worker still in torch code (a request's K/V going into the prefix cache after its
            # answer was returned) when the interpreter finalizes aborts the process ("terminate called
            # without an active exception"): stop it first.
            atexit.register(self.close, 5.0)
        self._cond.notify()

    def configure(self, **limits: Any) -> SchedulerConfig:
        """Change limits (``SchedulerConfig`` fields) from the next iteration on."""
        values = {**self.config.__dict__, **limits}
        self.config = SchedulerConfig(**values)
        return self.config

    def stats(self) -> dict[str, Any]:
        with self._cond:
            running, waiting, jobs = len(self._running), len(self._waiting), len(self._jobs)
        return {"running": running, "waiting": waiting, "jobs": jobs, "decode_steps": self.steps,
                "mean_batch_size": self.step_tokens / self.steps if self.steps else 0.0,
                "finished": self.finished, "failed": self.failed, "cancelled": self.cancelled,
                "rejected": self.rejected, **self.config.__dict__}

    def close(self, timeout: float | None = 10.0) -> None:
        """Refuse new work, cancel what waits or runs, and stop the worker."""
        with self._cond:
            self._closed = True
            for handle in [*self._waiting, *self._running]:
                handle.cancel()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the worker
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._waiting or self._jobs or self._running or self._closed):
                        self._cond.wait()
                    if self._closed and not self._running and not self._waiting:
                        self._fail_jobs()
                        return
                try:
                    self._iteration()
                except BaseException as exc:  # a bug of ours: fail what runs, keep serving
                    logger.exception("scheduler iteration failed")
                    for handle in self._running:
                        self._retire(handle, error=exc)

    def _iteration(self) -> None:
        self._job_step()
        self._admit()
        self._drop_cancelled()
        if self._running:
            self._decode_step()

    def _job_step(self) -> None:
        with self._cond:
            job = self._jobs[0] if self._jobs else None
        if job is None:
            return
        try:
            next(job.steps)
            return
        except StopIteration as done:
            job.future.set_result(done.value)
        except BaseException as exc:
            job.future.set_exception(exc)
        with self._cond:
            self._jobs.popleft()

    def _admit(self) -> None:
        for _ in range(self.config.max_prefills_per_step):
            with self._cond:
                if not self._waiting or len(self._running) >= self.config.max_batch_size:
                    return
                handle = self._waiting.popleft()
            if handle.cancelled.is_set():
                self._retire(handle, error=RequestCancelled("the request was cancelled before it started"))
                continue
            try:
                handle.decoding = handle._start()
            except BaseException as exc:
                self._retire(handle, error=exc)
                continue
            with self._cond:
                self._running.append(handle)
            self._deliver(handle)  # the first token, sampled from the blend's logits

    def _drop_cancelled(self) -> None:
        for handle in [h for h in self._running if h.cancelled.is_set()]:
            self._retire(handle, error=RequestCancelled("the request was cancelled"))

    def _decode_step(self) -> None:
        batch = list(self._running)
        decodings = [h.decoding for h in batch]
        saved = [list(d.kv.lengths) if d.kv is not None else None for d in decodings]  # type: ignore[union-attr]
        try:
            logits = decode_logits(self.engine, decodings)  # type: ignore[arg-type]
        except BaseException:
            if len(batch) == 1:
                raise
            # Which request broke the step? Each alone, from where the step began.
            for decoding, lengths in zip(decodings, saved):
                if lengths is not None:
                    decoding.kv.lengths = lengths  # type: ignore[union-attr]
            self._decode_one_by_one(batch)
            return
        self.steps += 1
        self.step_tokens += len(batch)
        for row, handle in enumerate(batch):
            self._advance(handle, lambda d, row=row: d.advance(logits[row]))

    def _decode_one_by_one(self, batch: list[RequestHandle[Any]]) -> None:
        for handle in batch:
            self._advance(handle, lambda d: d.advance(decode_logits(self.engine, [d])[0]))

    def _advance(self, handle: RequestHandle[Any], step: Callable[[Decoding], None]) -> None:
        try:
            step(handle.decoding)  # type: ignore[arg-type]
        except BaseException as exc:
            self._retire(handle, error=exc)
            return
        self._deliver(handle)

    def _deliver(self, handle: RequestHandle[Any]) -> None:
        decoding = handle.decoding
        assert decoding is not None
        try:
            delta = decoding.accept()
        except BaseException as exc:
            self._retire(handle, error=exc)
            return
        if delta:
            handle._send(_DELTA, delta)
        if decoding.done:
            self._retire(handle)

    def _retire(self, handle: RequestHandle[Any], error: BaseException | None = None) -> None:
        with self._cond:
            if handle in self._running:
                self._running.remove(handle)
        decoding, handle.decoding = handle.decoding, None
        if error is None and decoding is not None:
            self.finished += 1
            handle._send(_DONE, decoding.result())
            return
        if decoding is not None:
            decoding.release()
        if isinstance(error, RequestCancelled):
            self.cancelled += 1
        else:
            self.failed += 1
        handle._send(_ERROR, error)

    def _fail_jobs(self) -> None:
        while self._jobs:
            self._jobs.popleft().future.set_exception(RuntimeError("the scheduler was closed"))
