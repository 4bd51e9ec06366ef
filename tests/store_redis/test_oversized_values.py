"""A value planted in Redis larger than any entry of the model is never read: each read asks the server for
the values' sizes first (HSTRLEN, one pipeline before the values'), so a planted value of hundreds of
megabytes cannot outlast the read timeout, open the circuit breaker (reuse off for every request until a
probe closes it) and do so again at the next read. It is a corrupt entry instead: deleted, counted,
recomputed and written back, and the next request hits."""

from __future__ import annotations

import logging

import pytest
import torch

from cacheblend_rag import FreshSegment, StoredSegment
from cacheblend_rag.store import ChunkCache, TieredKVStore
from cacheblend_rag.store.format.chunk_bytes import MAX_MANIFEST_BYTES, peek_manifest
from cacheblend_rag.store.inventory import inventory
from cacheblend_rag.store.backends.redis_layout import MANIFEST_FIELD, layer_field
from cacheblend_rag.store.backends.redis_store import RedisKVStore

from redis_workers import QUESTION, corpus, replica_store  # noqa: E402

PLANTED_LAYER = 8 * 2**20  # far beyond the tiny model's largest layer value


def _segments(engine, texts):
    return [*(StoredSegment(engine.tokenize(t)) for t in texts), FreshSegment(engine.tokenize(QUESTION))]


def _redis_of(store):
    return store.tiers[-1] if isinstance(store, TieredKVStore) else store


@pytest.mark.parametrize("kind", ["redis", "tiered"])
def test_an_oversized_value_is_corrupt_not_read_and_opens_no_breaker(engine, redis_server, redis_url, tmp_path,
                                                                     caplog, kind):
    texts = corpus(3)
    with ChunkCache(engine, RedisKVStore(redis_url), storage_dtype="float32") as writer:
        writer.warm(texts)
    store = RedisKVStore(redis_url) if kind == "redis" else replica_store(redis_url, str(tmp_path / "disk"))
    cache = ChunkCache(engine, store, storage_dtype="float32", resident_bytes=0)
    redis_store = _redis_of(store)
    bound = redis_store.max_value_bytes
    assert bound is not None and PLANTED_LAYER > bound > 0  # bound by the model (ChunkCache.bind_model)
    keys = [cache.key_for(engine.tokenize(t)) for t in texts]
    manifest_of_1 = peek_manifest(redis_store.get_manifest(keys[1]))
    with redis_server.client() as client:  # another program's values, under our names
        client.hset(redis_store._hash(keys[0]), MANIFEST_FIELD, b"m" * (MAX_MANIFEST_BYTES + 1))
        client.hset(redis_store._hash(keys[1]), layer_field(manifest_of_1.write_id, 2), b"x" * PLANTED_LAYER)
        sent_before = int(client.info("stats")["total_net_output_bytes"])
    with caplog.at_level(logging.WARNING):
        result = engine.blend(_segments(engine, texts), store=cache)
        cache.flush()
    with redis_server.client() as client:
        sent = int(client.info("stats")["total_net_output_bytes"]) - sent_before
        planted_gone = client.hget(redis_store._hash(keys[1]), layer_field(manifest_of_1.write_id, 2)) is None
    reference = engine.blend([*engine.prefill_chunks([engine.tokenize(t) for t in texts]),
                              FreshSegment(engine.tokenize(QUESTION))]).logits
    torch.testing.assert_close(result.logits, reference, rtol=0, atol=1e-5)
    assert redis_store._down is None  # no breaker opened: reuse stays on for every other request
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert sent < MAX_MANIFEST_BYTES  # neither planted value left the server
    # The manifest: a miss; the layer: found mid-blend, a load failure. Both corrupt, deleted, written back.
    assert (result.stats.cache_hits, result.stats.cache_misses, result.stats.load_failures) == (1, 1, 1)
    stats = cache.stats()
    assert stats.corrupt == 2 and stats.available
    assert planted_gone and peek_manifest(redis_store.get_manifest(keys[1])).write_id != manifest_of_1.write_id
    assert len(redis_store.get_manifest(keys[0])) < MAX_MANIFEST_BYTES  # rewritten: a real manifest
    again = engine.blend(_segments(engine, texts), store=cache)
    assert again.stats.cache_hits == 3  # the next request hits
    cache.close()
    if kind == "tiered":
        store.close()


def test_cache_stats_reads_no_oversized_manifest(engine, redis_server, redis_url):
    texts = corpus(2)
    with ChunkCache(engine, RedisKVStore(redis_url), storage_dtype="float32") as writer:
        writer.warm(texts)
        key = writer.key_for(engine.tokenize(texts[0]))
        name = writer.store._hash(key)
    with redis_server.client() as client:
        client.hset(name, MANIFEST_FIELD, b"m" * (MAX_MANIFEST_BYTES + 1))
    admin = RedisKVStore(redis_url)  # as `cache stats` opens it: no model bound
    shares = inventory(admin)
    assert shares["unreadable"].entries == 1 and sum(s.entries for s in shares.values()) == 2
    assert admin._down is None
