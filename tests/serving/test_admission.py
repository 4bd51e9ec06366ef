"""Admission and memory bounds: the running requests' KV stays within the scheduler's budget, the 17th long
request waits for room and then runs, one that could never fit is refused at once with what to change,
every reservation is freed however a request ends, and the default budget is sized from the model and
the device."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cacheblend_rag.config import GenerationConfig, SchedulerConfig
from cacheblend_rag.engine.generate import start_decoding
from cacheblend_rag.serving import KVBudgetError, RequestCancelled, RequestScheduler
from cacheblend_rag.serving import admission
from cacheblend_rag.serving.admission import default_kv_budget, kv_bytes_per_token
from cacheblend_rag.testing import tiny_engine

LONG = "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean. " * 6
MAX_NEW = 8


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=41)


def held_tokens(engine, ids: list[int], max_new_tokens: int = MAX_NEW) -> int:
    """The tokens of KV a request holds: its prompt and room for its answer (as BlendService sizes it)."""
    return len(ids) + max(1, min(max_new_tokens - 1, engine.context_window - len(ids)))


def submit(scheduler: RequestScheduler, engine, ids: list[int], *, max_new_tokens: int = MAX_NEW,
           start=None, kv_tokens=None):
    generation = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    start = start or (lambda: start_decoding(engine, [ids], generation, None, None))
    return scheduler.submit(start, lambda r: r,
                            kv_tokens=kv_tokens or (lambda: held_tokens(engine, ids, max_new_tokens)))


class Gate:
    """A job that holds the worker until released, so that requests submitted meanwhile queue together."""

    def __init__(self, scheduler: RequestScheduler) -> None:
        self.release, started = threading.Event(), threading.Event()

        def steps():
            started.set()
            self.release.wait(30)
            return None
            yield

        scheduler.run_job(steps())
        assert started.wait(30)


def watch(scheduler: RequestScheduler) -> list[dict]:
    """The scheduler's stats before each decode step."""
    seen: list[dict] = []
    real = scheduler._decode_step

    def spy():
        seen.append(scheduler.stats())
        real()

    scheduler._decode_step = spy
    return seen


def test_the_17th_long_request_waits_for_room_then_runs(engine):
    ids = engine.tokenize(LONG)
    need = held_tokens(engine, ids) * kv_bytes_per_token(engine)
    budget = 16 * need  # sixteen long prompts fill it
    scheduler = RequestScheduler(engine, SchedulerConfig(max_batch_size=64, max_prefills_per_step=64,
                                                         kv_budget_bytes=budget))
    seen = watch(scheduler)
    try:
        gate = Gate(scheduler)
        handles = [submit(scheduler, engine, ids) for _ in range(17)]
        gate.release.set()
        results = [h.result() for h in handles]
        final = scheduler.stats()
    finally:
        scheduler.close()
    assert all(len(r.token_ids) == MAX_NEW for r in results)
    assert max(s["running"] for s in seen) == 16
    assert all(s["kv_reserved_bytes"] <= budget for s in seen)
    # While sixteen ran, the seventeenth waited (not refused), then ran once room was freed.
    assert any(s["running"] == 16 and s["queued"] == 1 and s["kv_reserved_bytes"] == budget for s in seen)
    assert seen[-1]["running"] == 1
    assert final["kv_reserved_bytes"] == 0 and final["running"] == final["queued"] == 0
    assert final["finished"] == 17 and final["rejected"] == 0 and final["kv_budget_bytes"] == budget


def test_the_head_of_the_queue_is_not_passed_over(engine):
    """First come, first served: a large request waiting for room is not overtaken by small ones."""
    short, long = engine.tokenize("Short question?"), engine.tokenize(LONG * 2)
    per_token = kv_bytes_per_token(engine)
    budget = held_tokens(engine, long) * per_token  # the long one fits only alone
    scheduler = RequestScheduler(engine, SchedulerConfig(max_prefills_per_step=8, kv_budget_bytes=budget))
    order: list[str] = []
    try:
        gate = Gate(scheduler)
        handles = []
        for name, ids in [("small-1", short), ("large", long), ("small-2", short)]:
            generation = GenerationConfig(max_new_tokens=MAX_NEW)

            def start(name=name, ids=ids, generation=generation):
                order.append(name)
                return start_decoding(engine, [ids], generation, None, None)

            handles.append(submit(scheduler, engine, ids, start=start))
        gate.release.set()
        for h in handles:
            h.result()
    finally:
        scheduler.close()
    assert order == ["small-1", "large", "small-2"]


def test_a_request_that_could_never_fit_is_refused_at_once(engine):
    ids = engine.tokenize(LONG)
    per_token = kv_bytes_per_token(engine)
    budget = held_tokens(engine, ids, 400) * per_token  # one long-running request fills it
    scheduler = RequestScheduler(engine, SchedulerConfig(kv_budget_bytes=budget))
    try:
        running = submit(scheduler, engine, ids, max_new_tokens=400)
        next(iter(running))
        huge = engine.tokenize(LONG * 8)
        assert held_tokens(engine, huge) * per_token > budget
        refused = submit(scheduler, engine, huge)
        started = time.perf_counter()
        with pytest.raises(KVBudgetError) as caught:
            refused.result()
        waited = time.perf_counter() - started
        stats = scheduler.stats()
        assert stats["running"] == 1, "refused while the long request still ran, not after it"
        running.close()
    finally:
        scheduler.close()
    message = str(caught.value)
    need = held_tokens(engine, huge) * per_token
    assert f"{held_tokens(engine, huge)} tokens" in message and f"{per_token:,} bytes a token" in message
    assert admission.readable(need) in message and admission.readable(budget) in message
    for advice in ("kv_budget_bytes=", "SchedulerConfig(kv_budget_bytes=", "max_new_tokens", "chunks"):
        assert advice in message
    assert waited < 5
    assert stats["refused_kv_budget"] == stats["rejected"] == 1 and stats["refused_queue_full"] == 0
    assert stats["queued"] == 0 and stats["failed"] == 0


def test_a_lowered_budget_refuses_what_waits_when_its_turn_comes(engine):
    ids = engine.tokenize(LONG)
    scheduler = RequestScheduler(engine, SchedulerConfig(kv_budget_bytes=1 << 30))
    try:
        gate = Gate(scheduler)
        waiting = submit(scheduler, engine, ids)
        scheduler.configure(kv_budget_bytes=kv_bytes_per_token(engine))  # room for one token only
        gate.release.set()
        with pytest.raises(KVBudgetError, match="could never start"):
            waiting.result()
    finally:
        scheduler.close()


def test_reservations_return_to_zero_after_cancels_and_failures(engine):
    ids = engine.tokenize(LONG)
    budget = 3 * held_tokens(engine, ids, 200) * kv_bytes_per_token(engine)
    scheduler = RequestScheduler(engine, SchedulerConfig(max_prefills_per_step=8, kv_budget_bytes=budget))

    def broken_start():
        raise RuntimeError("the blend failed")

    def broken_size():
        raise ValueError("the prompt could not be tokenized")

    try:
        gate = Gate(scheduler)
        streamed = [submit(scheduler, engine, ids, max_new_tokens=200) for _ in range(2)]
        cancelled_queued = submit(scheduler, engine, ids)
        cancelled_queued.close()
        failing_start = submit(scheduler, engine, ids, start=broken_start)
        failing_size = submit(scheduler, engine, ids, kv_tokens=broken_size)
        waiting = [submit(scheduler, engine, ids, max_new_tokens=200) for _ in range(3)]  # wait for room
        gate.release.set()
        for h in streamed:
            next(iter(h))
            h.close()  # a client hanging up mid-stream
        for handle, error in [(cancelled_queued, RequestCancelled), (failing_start, RuntimeError),
                              (failing_size, ValueError), *((h, RequestCancelled) for h in streamed)]:
            with pytest.raises(error):
                handle.result()
        next(iter(waiting[0]))
        scheduler.close()  # what still runs or waits is cancelled
        for h in waiting:
            with pytest.raises(RequestCancelled):
                h.result()
        stats = scheduler.stats()
    finally:
        scheduler.close()
    assert stats["kv_reserved_bytes"] == 0 and stats["running"] == 0 and stats["queued"] == 0
    assert stats["failed"] == 2 and stats["cancelled"] == 6 and stats["finished"] == 0


def fake_engine(engine, device: str) -> SimpleNamespace:
    return SimpleNamespace(model=engine.model, dtype=engine.dtype, device=torch.device(device),
                           context_window=engine.context_window, model_name="tiny")


def test_kv_bytes_per_token_follow_the_model_config(engine):
    from transformers import LlamaConfig

    config = engine.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert kv_bytes_per_token(engine) == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    # SmolLM2-135M's shapes (30 layers, 3 KV heads of 64): the 46 KB a token in float32 the docs quote, half in bf16.
    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                          intermediate_size=1536)
    assert kv_bytes_per_token(SimpleNamespace(model=SimpleNamespace(config=smollm2), dtype=torch.float32)) == 46_080
    assert kv_bytes_per_token(SimpleNamespace(model=SimpleNamespace(config=smollm2), dtype=torch.bfloat16)) == 23_040


def test_the_default_budget_is_a_share_of_free_host_memory(engine, monkeypatch):
    monkeypatch.setattr(admission, "available_memory", lambda device: 10 << 30)
    budget, how = default_kv_budget(engine)
    assert budget == int((10 << 30) * admission.CPU_SHARE)
    assert "50% of the 10.0 GiB of host memory" in how
    scheduler = RequestScheduler(engine)
    assert scheduler.stats()["kv_budget_bytes"] == budget and "host memory" in scheduler.stats()["kv_budget_source"]


def test_the_default_budget_never_refuses_a_prompt_the_model_can_take(engine, monkeypatch):
    monkeypatch.setattr(admission, "available_memory", lambda device: 1 << 20)
    budget, how = default_kv_budget(engine)
    assert budget == engine.context_window * kv_bytes_per_token(engine)
    assert "context window" in how


def test_the_default_budget_on_a_gpu_is_a_share_of_its_free_memory(engine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    assert admission.available_memory(torch.device("cuda")) == 40 << 30
    budget, how = default_kv_budget(fake_engine(engine, "cuda"))
    assert budget == int((40 << 30) * admission.CUDA_SHARE) and "GPU memory" in how


def test_host_memory_is_read_without_psutil(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    assert admission.available_memory(torch.device("cpu")) > 0


def test_the_integrations_surface_both_refusals_unchanged():
    """LangChain and LlamaIndex, sync, async and streaming, raise the scheduler's own errors, message and all."""
    import asyncio

    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.serving import SchedulerFullError, scheduler_for

    engine = tiny_engine("llama", seed=43)  # an engine of its own: the limits set here stay on its scheduler
    budget = 4 * kv_bytes_per_token(engine)
    chat = ChatCacheBlend(engine=engine, max_tokens=2, kv_budget_bytes=budget, max_queued_requests=1)
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=2, is_chat_model=False)
    scheduler = scheduler_for(engine)
    assert scheduler.stats()["kv_budget_bytes"] == budget and scheduler.stats()["max_queued_requests"] == 1
    question = "Which river flows through Brazil, Peru and Colombia into the Atlantic Ocean?"
    calls = [lambda: chat.invoke(question), lambda: list(chat.stream(question)),
             lambda: asyncio.run(chat.ainvoke(question)), lambda: llm.complete(question),
             lambda: list(llm.stream_complete(question)), lambda: asyncio.run(llm.acomplete(question))]
    for call in calls:
        with pytest.raises(KVBudgetError, match=r"more than the scheduler's whole KV budget of 4\.0 KiB .*kv_budget_bytes"):
            call()
    scheduler.configure(kv_budget_bytes=None)
    gate = Gate(scheduler)
    try:
        queued = scheduler.submit(lambda: (_ for _ in ()).throw(RuntimeError("never started")), lambda r: r)
        for call in calls:
            with pytest.raises(SchedulerFullError, match=r"max_queued_requests=1\) .*max_queued_requests=\.\.\. on"):
                call()
    finally:
        gate.release.set()
    with pytest.raises(RuntimeError, match="never started"):
        queued.result()
    stats = scheduler.stats()
    assert stats["refused_kv_budget"] == stats["refused_queue_full"] == len(calls)
    assert stats["kv_reserved_bytes"] == 0 and stats["queued"] == 0


def test_configure_changes_the_budget_and_keeps_a_sized_one(engine, monkeypatch):
    monkeypatch.setattr(admission, "available_memory", lambda device: 10 << 30)
    scheduler = RequestScheduler(engine)
    sized = scheduler.stats()["kv_budget_bytes"]
    monkeypatch.setattr(admission, "available_memory", lambda device: 2 << 30)  # running requests' KV took some
    scheduler.configure(max_queued_requests=8)
    assert scheduler.stats()["kv_budget_bytes"] == sized  # not sized again from what the running ones left
    scheduler.configure(kv_budget_bytes=123_456)
    assert scheduler.stats()["kv_budget_bytes"] == 123_456 and scheduler.stats()["max_queued_requests"] == 8
    scheduler.configure(kv_budget_bytes=None)
    assert scheduler.stats()["kv_budget_bytes"] == 1 << 30
