"""Process entry points of the concurrency test (a module of their own, so that 'spawn' can import them)."""

from __future__ import annotations

import random
import traceback


def corpus(n: int = 12) -> list[str]:
    topics = ["Paris", "Marie Curie", "The Amazon river", "The quick brown fox", "Warsaw", "Brazil"]
    return [f"{topics[i % len(topics)]} is item {i}. " + "Context information is below. " * (1 + i % 3)
            for i in range(n)]


def _engine():
    from cacheblend_rag import BlendConfig
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine(config=BlendConfig(recompute_ratio=0.25, check_layer=1))


def writer(path: str, texts: list[str], barrier, results) -> None:
    try:
        from cacheblend_rag.store import ChunkCache, DiskKVStore

        engine = _engine()
        cache = ChunkCache(engine, DiskKVStore(path), storage_dtype="float32", batch_size=2)
        barrier.wait(timeout=120)
        summary = cache.warm(texts)
        cache.close()
        results.put(("writer", summary.new, summary.present, summary.failed, None))
    except BaseException:
        results.put(("writer", 0, 0, 0, traceback.format_exc()))


def reader(path: str, texts: list[str], rounds: int, seed: int, barrier, results) -> None:
    try:
        from cacheblend_rag import FreshSegment, StoredSegment
        from cacheblend_rag.store import ChunkCache, DiskKVStore

        engine = _engine()
        cache = ChunkCache(engine, DiskKVStore(path), storage_dtype="float32")
        question = FreshSegment(engine.tokenize("Question: What is the capital of France? Answer:"))
        rng = random.Random(seed)
        barrier.wait(timeout=120)
        worst = 0.0
        for _ in range(rounds):
            ids = [engine.tokenize(t) for t in rng.sample(texts, 3)]
            blended = engine.blend([*(StoredSegment(i) for i in ids), question], store=cache).logits
            reference = engine.blend([*engine.prefill_chunks(ids), question]).logits
            worst = max(worst, float((blended - reference).abs().max()))
        cache.close()
        results.put(("reader", worst, 0, 0, None))
    except BaseException:
        results.put(("reader", 0, 0, 0, traceback.format_exc()))
