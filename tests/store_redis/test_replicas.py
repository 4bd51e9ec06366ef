"""Two serving replicas, two processes, each with its own memory and disk tiers, share one Redis."""

from __future__ import annotations

import multiprocessing

import torch

from cacheblend_rag.store import ChunkCache
from cacheblend_rag.store.backends.redis_store import RedisKVStore

from redis_workers import answer, corpus, replica_b, replica_store, requests  # noqa: E402


def test_a_chunk_warmed_by_replica_a_is_a_redis_hit_for_replica_b(engine, redis_url, tmp_path):
    texts = corpus(6)
    prompts = requests(texts)[:3]
    cache_a = ChunkCache(engine, replica_store(redis_url, str(tmp_path / "a")), storage_dtype="float32")
    assert cache_a.warm(texts).new == 6
    answers_a = [answer(engine, cache_a, p) for p in prompts]
    cache_a.close()

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    replica = context.Process(target=replica_b, args=(redis_url, str(tmp_path / "b"), prompts, results))
    replica.start()
    fingerprint_b, answers_b, promoted_b, error = results.get(timeout=600)
    replica.join(timeout=60)
    assert error is None, error

    assert fingerprint_b == engine.fingerprint  # same seed, same model, same keys
    for (logits_a, text_a, _, _), (logits_b, text_b, hits_b, misses_b) in zip(answers_a, answers_b):
        assert (hits_b, misses_b) == (3, 0)  # B's disk started empty: every hit came from Redis
        torch.testing.assert_close(torch.tensor(logits_b), logits_a, rtol=0, atol=1e-6)
        assert text_b == text_a
    used = {cache_a.key_for(engine.tokenize(t)) for p in prompts for t in p}
    assert set(promoted_b) == used  # hits were promoted into B's own disk tier
    shared = RedisKVStore(redis_url)
    shared.bind_model(engine.fingerprint)
    assert sorted(shared.keys()) == sorted(cache_a.key_for(engine.tokenize(t)) for t in texts)  # B wrote nothing twice
    assert shared.counters()["hits"] >= 2 * 3 * len(prompts)  # both replicas count into the same totals
