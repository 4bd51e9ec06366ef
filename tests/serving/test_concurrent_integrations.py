"""16 concurrent requests through each integration, sync and async, streaming or not: answers equal to
the same requests made one after another, and decoded together by the engine's scheduler."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import HumanMessage
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.serving import scheduler_for
from cacheblend_rag.testing import tiny_engine

CHUNKS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
]
N = 16


def questions() -> list[str]:
    return [f"Context:\n{CHUNKS[i % 3]}\n{CHUNKS[(i + 1) % 3]}\nQuestion {i}: who won? Answer:" for i in range(N)]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=31)


def batched(engine, before: dict) -> float:
    """Mean batch size of the decode steps since ``before`` (a scheduler's stats)."""
    after = scheduler_for(engine).stats()
    steps = after["decode_steps"] - before["decode_steps"]
    return (after["mean_batch_size"] * after["decode_steps"] - before["mean_batch_size"] * before["decode_steps"]) / steps


@pytest.fixture(scope="module")
def llama(engine):
    # segment_cache_bytes=0: with the segment cache (on by default) a span's K/V comes from whichever
    # request computed it first, so concurrent answers could differ from serial ones by design; and
    # prefix_cache_bytes=0 for the same reason: a prompt blended before comes back as that request's
    # approximate prefix blocks (and its chunks are then no store hits).
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=10, is_chat_model=False, segment_cache_bytes=0,
                                    prefix_cache_bytes=0)
    llm.precompute(CHUNKS)
    llm.announce_chunks(CHUNKS)
    return llm


@pytest.fixture(scope="module")
def llama_serial(llama):
    return [llama.complete(q) for q in questions()]


def test_llamaindex_threads_equal_serial(engine, llama, llama_serial):
    before = scheduler_for(engine).stats()
    with ThreadPoolExecutor(N) as pool:
        responses = list(pool.map(llama.complete, questions()))
    assert [r.text for r in responses] == [r.text for r in llama_serial]
    assert [r.raw["token_ids"] for r in responses] == [r.raw["token_ids"] for r in llama_serial]
    assert all(r.additional_kwargs["cache_hits"] == 2 for r in responses)
    assert batched(engine, before) > 2


def test_llamaindex_async_gather_and_streams_equal_serial(engine, llama, llama_serial):
    async def stream(q):
        text = ""
        async for response in await llama.astream_complete(q):
            text = response.text
        return text

    async def run():
        half = N // 2
        done = await asyncio.gather(*(llama.acomplete(q) for q in questions()[:half]),
                                    *(stream(q) for q in questions()[half:]))
        return [d.text for d in done[:half]] + list(done[half:])

    before = scheduler_for(engine).stats()
    assert asyncio.run(run()) == [r.text for r in llama_serial]
    assert batched(engine, before) > 2


def test_llamaindex_sync_streams_from_threads_equal_serial(llama, llama_serial):
    def stream(q):
        return "".join(r.delta or "" for r in llama.stream_complete(q))

    with ThreadPoolExecutor(N) as pool:
        assert list(pool.map(stream, questions())) == [r.text for r in llama_serial]


@pytest.fixture(scope="module")
def chat(engine):
    # segment_cache_bytes=0, prefix_cache_bytes=0: answers must not depend on request order (see the llama fixture).
    model = ChatCacheBlend(engine=engine, max_tokens=10, segment_cache_bytes=0, prefix_cache_bytes=0)
    model.warm(CHUNKS, show_progress=False)
    return model


@pytest.fixture(scope="module")
def chat_serial(chat):
    return [chat.invoke([HumanMessage(q)]).content for q in questions()]


def test_langchain_batch_equals_serial_and_batches(engine, chat, chat_serial):
    before = scheduler_for(engine).stats()
    answers = chat.batch([[HumanMessage(q)] for q in questions()])
    assert [a.content for a in answers] == chat_serial
    assert batched(engine, before) > 2
    assert all(a.response_metadata["cacheblend"]["cache_hits"] == 2 for a in answers)


def test_langchain_ainvoke_gather_and_astream_equal_serial(engine, chat, chat_serial):
    async def stream(q):
        return "".join([chunk.content async for chunk in chat.astream([HumanMessage(q)])])

    async def run():
        half = N // 2
        invoked = await asyncio.gather(*(chat.ainvoke([HumanMessage(q)]) for q in questions()[:half]))
        streamed = await asyncio.gather(*(stream(q) for q in questions()[half:]))
        return [m.content for m in invoked] + list(streamed)

    before = scheduler_for(engine).stats()
    assert asyncio.run(run()) == chat_serial
    assert batched(engine, before) > 2


def test_a_cancelled_task_leaves_the_scheduler(engine, llama):
    async def run():
        task = asyncio.ensure_future(llama.acomplete(questions()[0], max_new_tokens=2000))
        while scheduler_for(engine).stats()["running"] == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):
            if scheduler_for(engine).stats()["running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(run())
