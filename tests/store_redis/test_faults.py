"""Faults of the shared Redis: a crash in the middle of a replica's requests, a restart, a corrupt value."""

from __future__ import annotations

import logging
import time

import torch

from cacheblend_rag import FreshSegment, StoredSegment
from cacheblend_rag.store import ChunkCache, DiskKVStore
from cacheblend_rag.store.format.chunk_bytes import decode_layer, decode_manifest, value_digest
from cacheblend_rag.store.backends.redis_store import RedisKVStore

from redis_workers import QUESTION, corpus, replica_store  # noqa: E402


def _segments(engine, texts):
    return [*(StoredSegment(engine.tokenize(t)) for t in texts), FreshSegment(engine.tokenize(QUESTION))]


def _reference(engine, texts):
    ids = [engine.tokenize(t) for t in texts]
    return engine.blend([*engine.prefill_chunks(ids), FreshSegment(engine.tokenize(QUESTION))]).logits


def _warm_redis(engine, url, texts):
    with ChunkCache(engine, RedisKVStore(url), storage_dtype="float32") as replica_a:
        assert replica_a.warm(texts).new == len(set(texts))


def _warnings(caplog):
    # The store's own warnings; not the one a keyless cache gives on opening a shared store (test_store_key_required).
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name != "cacheblend_rag.store.store_key"]


def test_redis_killed_mid_run_then_restarted(engine, fresh_redis_server, tmp_path, caplog):
    server, url = fresh_redis_server, fresh_redis_server.url()
    texts = corpus(12)
    before, during, after = texts[0:3], [texts[3:6], texts[6:9], texts[3:9:2]], texts[9:12]
    _warm_redis(engine, url, before + [t for p in during for t in p])
    replica_b = ChunkCache(engine, replica_store(url, str(tmp_path / "b"), max_backoff=0.2), storage_dtype="float32")

    def request(prompt):
        result = engine.blend(_segments(engine, prompt), store=replica_b)
        torch.testing.assert_close(result.logits, _reference(engine, prompt), rtol=0, atol=1e-5)
        replica_b.flush()
        return result.stats.cache_hits

    assert request(before) == 3  # from Redis

    server.kill()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        hits = [request(prompt) for prompt in during]
    assert hits == [0, 0, 3]  # computed fresh; the last prompt reuses chunks B computed during the outage, locally
    messages = _warnings(caplog)
    assert len(messages) == 1 and "RedisKVStore" in messages[0] and "failing" in messages[0], messages

    server.start()  # same port; without persistence it comes back empty, and the warm job runs again
    _warm_redis(engine, url, after)
    time.sleep(0.3)  # past the reconnect backoff
    after_keys = {replica_b.key_for(engine.tokenize(t)) for t in after}
    assert not after_keys & set(DiskKVStore(tmp_path / "b").keys())
    assert request(after) == 3  # hits again, and from Redis: B's own tiers never had these chunks
    assert after_keys <= set(DiskKVStore(tmp_path / "b").keys())  # promoted
    replica_b.close()


def test_redis_killed_in_the_middle_of_a_blend(engine, fresh_redis_server, tmp_path, caplog, monkeypatch):
    server, url = fresh_redis_server, fresh_redis_server.url()
    texts = corpus(3)
    _warm_redis(engine, url, texts)
    store = replica_store(url, str(tmp_path / "b"))
    redis_tier = store.tiers[-1]
    original = type(redis_tier).get_layers

    def dies_after_the_manifests(self, requests):
        server.kill()  # the manifests were read; the layers are not
        return original(self, requests)

    monkeypatch.setattr(type(redis_tier), "get_layers", dies_after_the_manifests)
    cache = ChunkCache(engine, store, storage_dtype="float32")
    with caplog.at_level(logging.WARNING):
        result = engine.blend(_segments(engine, texts), store=cache)
        cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, texts), rtol=0, atol=1e-5)
    messages = _warnings(caplog)
    print(messages)
    assert 1 <= len(messages) <= 2 and not any("corrupt" in m for m in messages), messages  # not per layer or chunk
    assert cache.store.tiers[1].counters()["corrupt"] == 0  # an outage is not damage: nothing was deleted
    cache.close()


def test_a_corrupt_value_in_redis_is_detected_recomputed_and_overwritten(engine, redis_server, redis_url, tmp_path,
                                                                       caplog):
    texts = corpus(3)
    _warm_redis(engine, redis_url, texts)
    shared = RedisKVStore(redis_url)
    shared.bind_model(engine.fingerprint)
    key = ChunkCache(engine, shared).key_for(engine.tokenize(texts[0]))
    old = decode_manifest(shared.get_manifest(key))
    value = bytearray(shared.get_layer(key, old.write_id, 2))
    value[len(value) // 2] ^= 0xFF
    with redis_server.client() as client:  # damage one layer on the server, as a bad write or a bit flip would
        client.hset(f"cacheblend:{shared.namespace}:{{{key}}}", f"{old.write_id}:2", bytes(value))

    replica_b = ChunkCache(engine, replica_store(redis_url, str(tmp_path / "b")), storage_dtype="float32")
    with caplog.at_level(logging.WARNING):
        result = engine.blend(_segments(engine, texts), store=replica_b)
        replica_b.flush()
    torch.testing.assert_close(result.logits, _reference(engine, texts), rtol=0, atol=1e-5)
    assert any("corrupt" in m for m in _warnings(caplog))

    new = decode_manifest(shared.get_manifest(key))  # rewritten in Redis by B
    assert new.write_id != old.write_id
    for layer in range(new.num_layers):
        blob = shared.get_layer(key, new.write_id, layer)
        assert value_digest(blob) == new.layer_digests[layer]
        decode_layer(blob, new.layer_shape)
    assert shared.get_layer(key, old.write_id, 2) is None
    assert shared.counters()["corrupt"] == 1
    replica_b.close()


def test_a_key_of_another_type_is_corrupt_removed_and_recomputed(engine, redis_url, caplog):
    """Another program SETs a string under a chunk's key: every read of that chunk used to fail with
    WRONGTYPE, forever. Now it is corrupt: counted, removed, recomputed and written back."""
    texts = corpus(3)
    _warm_redis(engine, redis_url, texts)
    store = RedisKVStore(redis_url)
    with ChunkCache(engine, store, storage_dtype="float32") as cache:
        key = cache.key_for(engine.tokenize(texts[1]))
        with store._client.pipeline() as pipe:
            pipe.delete(store._hash(key)).set(store._hash(key), "not a chunk").execute()
        result = engine.blend(_segments(engine, texts), store=cache)
        cache.flush()
        torch.testing.assert_close(result.logits, _reference(engine, texts), rtol=0, atol=1e-5)
        assert result.stats.cache_misses == 1 and cache.stats().corrupt == 1
        assert store._client.type(store._hash(key)) == b"hash"  # written back as a chunk
        assert engine.blend(_segments(engine, texts), store=cache).stats.cache_hits == 3
        store._client.set(store._hash(key), "again")
        assert cache.warm(texts).new == 1  # warm's lookup repairs it too


def test_eviction_under_maxmemory_is_counted_quietly_and_the_counters_survive(engine, fresh_redis_server, caplog):
    """allkeys-lru with room for about six chunks, twenty requests over eight: chunks are evicted
    between a replica's manifest read and its layer reads, and the counters hash itself may go.
    Evictions are evictions (no warning, nothing counted as corrupt) and the totals carry on."""
    url = fresh_redis_server.url()
    texts = corpus(8)
    store = RedisKVStore(url)
    with fresh_redis_server.client() as admin, ChunkCache(engine, store, storage_dtype="float32") as cache:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        engine.blend(_segments(engine, texts[:2]), store=cache)  # connections and scripts in place, 2 chunks
        cache.flush()
        chunk_bytes = cache.stats().bytes // 2
        admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + 4 * chunk_bytes))
    misses = 0
    with caplog.at_level(logging.WARNING), ChunkCache(engine, store, storage_dtype="float32") as cache:
        for request in range(20):
            prompt = [texts[request % 8], texts[(request + 3) % 8]]
            result = engine.blend(_segments(engine, prompt), store=cache)
            torch.testing.assert_close(result.logits, _reference(engine, prompt), rtol=0, atol=1e-5)
            misses += result.stats.cache_misses
            cache.flush()
        store._client.delete(store._counters_key())  # as the server's eviction would
        engine.blend(_segments(engine, texts[:2]), store=cache)
        cache.flush()
        counters = store.counters()
    with fresh_redis_server.client() as admin:
        assert int(admin.info("stats")["evicted_keys"]) > 0  # the server did evict
    assert not [m for m in _warnings(caplog) if "corrupt" in m], _warnings(caplog)
    assert counters["corrupt"] == 0 and counters["hits"] > 0
    # every chunk asked for is a hit, a miss, or a load failure (its layers were evicted mid-read)
    assert counters["misses"] >= misses
    assert counters["hits"] + counters["misses"] + counters["load_failures"] >= 2 * 21
