"""RequestScheduler: one worker thread per engine that blends and decodes every request together.

The engine computes one thing at a time and owns no thread; this is where concurrency lives.
Callers on any thread (or an event loop's worker thread) submit a request and read its text
deltas from a :class:`RequestHandle`. The worker, and only the worker, touches the engine and
torch. Each iteration it

1. runs one step of a queued job (a batch of chunk precompute for ``warm``, say), so jobs share
   the cores with requests instead of racing them;
2. sizes the requests queued since the last iteration (the KV memory each will hold, its prompt
   tokenized) and refuses at once any that could never fit the KV budget
   (:mod:`~cacheblend_rag.serving.admission`), then admits waiting requests, first come first
   served, while the batch has room and the head of the queue fits beside the KV the running ones
   reserved: their prompt is prepared and blended (prefill), ``max_prefills_per_step`` of them at
   most, so the requests already decoding wait for at most that many blends between two of their tokens;
3. runs one batched decode step for every running request (continuous batching: a request joins
   after its blend and leaves when it finishes), and hands each its text.

Every request keeps its own sampler, seed, stop strings and JSON constraint. A request whose
handle is closed (or whose task is cancelled) is dropped at the next step; a request that fails
fails alone; a reader that reads slowly never holds the worker, which only appends to its queue.
Nothing grows without bound: at most ``max_queued_requests`` wait (one more is refused with
:class:`SchedulerFullError`) and the running ones hold at most ``kv_budget_bytes`` of KV.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any, Callable, Generator, Generic, TypeVar

import torch

from cacheblend_rag.config import SchedulerConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.engine.decode import Decoding, decode_logits
from cacheblend_rag.engine.results import GenerationResult
from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.serving.admission import KVLedger, ledger_for
from cacheblend_rag.serving.request_handle import DELTA, DONE, ERROR, TEXT_END, RequestCancelled, RequestHandle
from cacheblend_rag.serving.memory_trim import release_free_memory

logger = logging.getLogger(__name__)

R = TypeVar("R")
J = TypeVar("J")


class SchedulerFullError(CacheBlendError, RuntimeError):
    """The scheduler's queue holds ``max_queued_requests`` requests already: the server is overloaded."""


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
        self._retired_since_trim = False  # a request ended since the heap was last trimmed
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
        self.refused_queue_full = 0
        self.refused_kv_budget = 0
        self._ledger: KVLedger | None = None  # sized on first use (kv_budget_bytes None: from the free memory)
        self._unsized: list[RequestHandle[Any]] = []

    @property
    def rejected(self) -> int:
        """Requests refused, for any reason."""
        return self.refused_queue_full + self.refused_kv_budget

    @property
    def ledger(self) -> KVLedger:
        """The KV budget and what the running requests reserved of it."""
        with self._cond:
            if self._ledger is None:
                self._ledger = ledger_for(self.engine, self.config.kv_budget_bytes)
            return self._ledger

    # ------------------------------------------------------------ submitting
    def submit(self, start: Callable[[], Decoding], finish: Callable[[GenerationResult], R], *,
               kv_tokens: Callable[[], int] | None = None) -> RequestHandle[R]:
        """Queue a request. ``start`` runs on the worker: it prepares and blends the prompt and
        returns its :class:`Decoding`; ``finish`` turns the engine's result into the handle's.
        ``kv_tokens`` (also run on the worker, as soon as it can) returns the tokens of KV the
        request will hold, prompt and answer; without it the request counts what it holds once started.
        Raises :class:`SchedulerFullError` when ``max_queued_requests`` requests already wait; a
        request that could never fit the KV budget ends with
        :class:`~cacheblend_rag.serving.admission.KVBudgetError` once sized, before it waits its turn."""
        handle: RequestHandle[R] = RequestHandle(start, finish, kv_tokens)
        with self._cond:
            self._check_open()
            limit = self.config.max_queued_requests
            if len(self._waiting) >= limit:
                self.refused_queue_full += 1
                raise SchedulerFullError(
                    f"{len(self._waiting)} requests are already queued (max_queued_requests={limit}) and "
                    f"{len(self._running)} running: retry later, or raise the limit with max_queued_requests=... on "
                    "the LLM or chat model (scheduler_for(engine).configure(max_queued_requests=...) in code)")
            self._waiting.append(handle)
            self._unsized.append(handle)
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
            raise RuntimeError("this scheduler is closed (its engine was released with serving.release_engine, or it "
                               "was closed); build a new model object, or get a new scheduler from "
                               "serving.scheduler_for(engine)")

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
        """Change limits (``SchedulerConfig`` fields) from the next iteration on. A changed
        ``kv_budget_bytes`` (back to ``None``: sized again from the free memory) keeps what running
        requests reserved; a queued request that no longer fits the budget at all is refused when its
        turn comes. ``None`` again keeps the budget sized before (the memory free now is net of the
        running requests' KV)."""
        config = SchedulerConfig(**{**asdict(self.config), **limits})
        with self._cond:
            if self._ledger is not None and config.kv_budget_bytes != self.config.kv_budget_bytes:
                sized = ledger_for(self.engine, config.kv_budget_bytes)
                self._ledger.budget, self._ledger.budget_source = sized.budget, sized.budget_source
            self.config = config
            self._cond.notify()  # a larger budget may let the head of the queue start
        return config

    def stats(self) -> dict[str, Any]:
        """Counters and limits, JSON-friendly: ``queued``, ``running``, ``kv_reserved_bytes`` of
        ``kv_budget_bytes`` (and where the budget comes from), refusals by reason
        (``refused_queue_full``, ``refused_kv_budget``; ``rejected`` is both) and the config's fields."""
        ledger = self.ledger
        with self._cond:
            running, queued, jobs = len(self._running), len(self._waiting), len(self._jobs)
            reserved = ledger.reserved
        return {**asdict(self.config), "running": running, "queued": queued, "waiting": queued, "jobs": jobs,
                "decode_steps": self.steps, "mean_batch_size": self.step_tokens / self.steps if self.steps else 0.0,
                "finished": self.finished, "failed": self.failed, "cancelled": self.cancelled,
                "rejected": self.rejected, "refused_queue_full": self.refused_queue_full,
                "refused_kv_budget": self.refused_kv_budget, "kv_reserved_bytes": reserved,
                "kv_budget_bytes": ledger.budget, "kv_budget_source": ledger.budget_source,
                "kv_bytes_per_token": ledger.bytes_per_token}

    def close(self, timeout: float | None = 10.0) -> None:
        """Refuse new work, cancel what waits or runs, and stop the worker."""
        with self._cond:
            self._closed = True
            for handle in [*self._waiting, *self._running]:
                handle.cancel()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        atexit.unregister(self.close)  # its registration held the scheduler, and so its engine, for good

    # ------------------------------------------------------------ the worker
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                if self._retired_since_trim and self._idle():
                    self._retired_since_trim = False
                    release_free_memory()  # what the finished requests freed, back to the system (memory_trim)
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
                    for handle in list(self._running):  # _retire removes each from the list
                        self._retire(handle, error=exc)

    def _idle(self) -> bool:
        with self._cond:
            return not (self._waiting or self._jobs or self._running or self._closed)

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

    def _size_queued(self) -> None:
        """The KV need of each request queued since the last iteration; one that could never fit the
        budget leaves the queue at once, refused, instead of waiting its turn to be refused."""
        with self._cond:
            new, self._unsized = self._unsized, []
        for handle in new:
            if handle.cancelled.is_set():
                continue  # dropped when its turn comes, as any cancelled request
            try:
                handle.kv_need = self.ledger.need(handle._kv_tokens() if handle._kv_tokens is not None else 0)
            except BaseException as exc:  # a prompt that cannot be tokenized fails alone
                self._unqueue(handle)
                self._retire(handle, error=exc)
                continue
            if handle.kv_need > self.ledger.budget:
                self._refuse(handle)

    def _unqueue(self, handle: RequestHandle[Any]) -> None:
        with self._cond:
            if handle in self._waiting:
                self._waiting.remove(handle)

    def _refuse(self, handle: RequestHandle[Any]) -> None:
        self._unqueue(handle)
        self.refused_kv_budget += 1
        handle._send(ERROR, self.ledger.refusal(handle.kv_need or 0, self.engine.model_name))

    def _next_to_start(self) -> RequestHandle[Any] | None:
        """The head of the queue, taken off it, if it may start now (or was cancelled, or can no longer
        ever fit); ``None`` while it waits for room, and so does the rest (first come, first served)."""
        while True:
            self._size_queued()  # also those queued during the last blend: none starts unsized
            with self._cond:
                if not self._waiting or len(self._running) >= self.config.max_batch_size:
                    return None
                handle = self._waiting[0]
                if handle.kv_need is None and not handle.cancelled.is_set():
                    continue  # queued while the others were sized: size it first
                need, ledger = handle.kv_need or 0, self.ledger
                if not (handle.cancelled.is_set() or need > ledger.budget or ledger.fits_now(need)):
                    return None
                return self._waiting.popleft()

    def _admit(self) -> None:
        ledger = self.ledger
        for _ in range(self.config.max_prefills_per_step):
            handle = self._next_to_start()
            if handle is None:
                return
            need = handle.kv_need or 0
            if handle.cancelled.is_set():
                self._retire(handle, error=RequestCancelled("the request was cancelled before it started"))
                continue
            if need > ledger.budget:  # the budget was lowered while it waited
                self._refuse(handle)
                continue
            self._hold(handle, need)
            try:
                handle.decoding = handle._start()
            except BaseException as exc:
                self._retire(handle, error=exc)
                continue
            with self._cond:
                self._running.append(handle)
            # What it holds now that its prompt is known, in place of the estimate.
            self._hold(handle, (handle.decoding.prompt_tokens + handle.decoding.room) * ledger.bytes_per_token)
            self._deliver(handle)  # the first token, sampled from the blend's logits

    def _hold(self, handle: RequestHandle[Any], nbytes: int) -> None:
        """Make ``handle``'s reservation against the KV budget ``nbytes`` (0 frees it)."""
        with self._cond:
            self.ledger.reserved += nbytes - handle.kv_reserved
            handle.kv_reserved = nbytes

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
            handle._send(DELTA, delta)
        if decoding.done:
            self._retire(handle)

    def _retire(self, handle: RequestHandle[Any], error: BaseException | None = None) -> None:
        with self._cond:
            if handle in self._running:
                self._running.remove(handle)
        self._retired_since_trim = True
        self._hold(handle, 0)
        decoding, handle.decoding = handle.decoding, None
        if error is None and decoding is not None:
            self.finished += 1
            # The text has ended (the last delta went out in _deliver): a caller holding text back (a tool-call
            # parser deciding whether "<" opens a call) lets it go now, not after the bookkeeping below. That
            # runs before the end, so a caller that saw the end finds the caches kept.
            handle._send(TEXT_END, None)
            try:
                decoding.settle()
            except Exception:  # keeping K/V is an optimisation: it never fails the request
                logger.exception("a finished request's on_finish failed")
            handle._send(DONE, decoding.result())
            return
        if decoding is not None:
            decoding.release()
        if isinstance(error, RequestCancelled):
            self.cancelled += 1
        else:
            self.failed += 1
        handle._send(ERROR, error)

    def _fail_jobs(self) -> None:
        while self._jobs:
            self._jobs.popleft().future.set_exception(RuntimeError("the scheduler was closed"))
