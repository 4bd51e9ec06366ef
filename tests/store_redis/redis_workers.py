"""Corpus, requests and process entry points of the Redis tests (a module of its own, so 'spawn' can import it)."""

from __future__ import annotations

import traceback
from typing import Any

QUESTION = "Question: What is the capital of France? Answer:"


def corpus(n: int = 8) -> list[str]:
    topics = ["Paris", "Marie Curie", "The Amazon river", "The quick brown fox", "Warsaw", "Brazil", "Peru", "Colombia"]
    return [f"{topics[i % len(topics)]} is item {i}. " + "Context information is below. " * (1 + i % 3)
            for i in range(n)]


def requests(texts: list[str]) -> list[list[str]]:
    """Prompts of three chunks each, in a fixed order."""
    return [[texts[i], texts[(i + 3) % len(texts)], texts[(i + 5) % len(texts)]] for i in range(len(texts))]


def make_engine():
    from cacheblend_rag import BlendConfig
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine(config=BlendConfig(recompute_ratio=0.25, check_layer=1))


def replica_store(url: str, disk_path: str, **redis_options: Any):
    """What each replica runs: memory, then its own disk, then the shared Redis."""
    from cacheblend_rag.store import DiskKVStore, MemoryKVStore, TieredKVStore
    from cacheblend_rag.store.backends.redis_store import RedisKVStore

    return TieredKVStore(MemoryKVStore(), DiskKVStore(disk_path), RedisKVStore(url, **redis_options))


def answer(engine, cache, texts: list[str]):
    """Logits and greedy text of one request whose chunks come from ``cache``."""
    from cacheblend_rag import FreshSegment, StoredSegment

    segments = [*(StoredSegment(engine.tokenize(t)) for t in texts), FreshSegment(engine.tokenize(QUESTION))]
    blended = engine.blend(segments, store=cache)  # first: what the store served, before any promotion
    text = engine.generate(segments, store=cache, max_new_tokens=6).text
    return blended.logits, text, blended.stats.cache_hits, blended.stats.cache_misses


def replica_b(url: str, disk_path: str, prompts: list[list[str]], results) -> None:
    """Replica B: answers with an empty local disk, so every hit is a Redis hit."""
    try:
        from cacheblend_rag.store import ChunkCache, DiskKVStore

        engine = make_engine()
        cache = ChunkCache(engine, replica_store(url, disk_path), storage_dtype="float32")
        # Plain lists: a tensor sent through a queue would be shared by a file descriptor that dies with this process.
        answers = [(logits.tolist(), *rest) for logits, *rest in (answer(engine, cache, p) for p in prompts)]
        cache.flush()
        local = sorted(DiskKVStore(disk_path).keys())  # promoted from Redis on hit
        cache.close()
        results.put((engine.fingerprint, answers, local, None))
    except BaseException:
        results.put((None, None, None, traceback.format_exc()))


def shard_worker(url: str, files: list[str], shard: str, results) -> None:
    """One `cacheblend-rag warm --shard` worker, with the tiny model standing in for SmolLM2."""
    try:
        import contextlib
        import io
        import json

        from cacheblend_rag.cli import main
        from cacheblend_rag.engine import CacheBlendEngine

        engine = make_engine()
        CacheBlendEngine.from_pretrained = classmethod(lambda cls, *a, **k: engine)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["warm", "--store", url, "--shard", shard, "--no-progress", *files])
        results.put((shard, code, json.loads(out.getvalue().strip().splitlines()[-1]), None))
    except BaseException:
        results.put((shard, None, None, traceback.format_exc()))
