"""RedisKVStore on a real three-master Redis Cluster: chunks spread over the nodes, each chunk in one slot."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import FreshSegment, StoredSegment
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, open_store
from cacheblend_rag.store.backends.redis_store import RedisKVStore

from redis_workers import QUESTION, corpus  # noqa: E402


def test_a_blend_from_a_redis_cluster_equals_the_blend_from_memory(engine, redis_cluster):
    store = open_store(redis_cluster.url())
    assert isinstance(store, RedisKVStore) and store.cluster
    store.clear()
    texts = corpus(8)
    ids = [engine.tokenize(t) for t in texts]
    cache = ChunkCache(engine, store, storage_dtype="float32")
    assert cache.warm(ids).new == 8
    question = FreshSegment(engine.tokenize(QUESTION))
    result = engine.blend([*(StoredSegment(i) for i in ids), question], store=cache)
    reference = engine.blend([*engine.prefill_chunks(ids), question])
    assert (result.stats.cache_hits, result.stats.cache_misses) == (8, 0)
    torch.testing.assert_close(result.logits, reference.logits, rtol=0, atol=1e-5)

    per_node = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            per_node.append(len(client.keys("cacheblend:*:{*}")))
    assert sum(per_node) == 8 and sum(n > 0 for n in per_node) >= 2  # spread over the nodes, a chunk on one

    key = cache.key_for(ids[0])
    assert store.delete(key) and not store.contains(key)
    cache.flush()
    assert cache.stats().entries == 7
    store.clear()
    assert list(store.keys()) == []
    cache.close()


def test_a_wrong_cluster_password_is_a_clear_error(redis_cluster):
    with pytest.raises(ConfigError, match="rejected the credentials"):
        open_store(redis_cluster.url("wrong"))
    with pytest.raises(ConfigError, match="cluster"):
        open_store(redis_cluster.nodes[0].url() + "?cluster=maybe")
