"""Memory has a bound by default (store/memory_budget.py): the in-memory store an engine gets with no
``store_path``, a ``tiered:`` store's memory tier, and the write-back queue behind a slow store. Each is
filled past its bound here and stays under it; a full write-back queue drops the write and counts it,
never blocking the request that missed."""

from __future__ import annotations

import threading
import time

import pytest

from cacheblend_rag import StoredSegment
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, MemoryKVStore, open_store
from cacheblend_rag.store.backends.memory_budget import (MEMORY_STORE_CAP, WRITE_BACK_CAP, default_memory_store_bytes,
                                                default_write_back_bytes, usable_memory)

from kvstore_samples import TEXTS  # noqa: E402


def test_the_defaults_are_a_share_of_usable_memory_with_a_cap():
    assert 0 < usable_memory()
    assert 64 << 20 <= default_memory_store_bytes() <= MEMORY_STORE_CAP
    assert default_memory_store_bytes() <= max(64 << 20, usable_memory() // 8)
    assert 64 << 20 <= default_write_back_bytes() <= WRITE_BACK_CAP


def test_the_default_stores_are_bounded(tmp_path):
    assert MemoryKVStore().max_bytes == default_memory_store_bytes()
    assert open_store(None).max_bytes == open_store("memory").max_bytes == default_memory_store_bytes()
    assert open_store("memory:1MB").max_bytes == 1_000_000
    tiered = open_store(f"tiered:{tmp_path / 'kv'}")
    try:
        assert tiered.tiers[0].max_bytes == default_memory_store_bytes()
    finally:
        tiered.close()
    assert MemoryKVStore(max_bytes=None).max_bytes is None  # unbounded only when asked for by name
    with pytest.raises(ConfigError, match="'auto' for the default bound"):
        MemoryKVStore(max_bytes=-1)


@pytest.mark.parametrize("spec", ["memory:200KB", "tiered"])
def test_a_memory_store_filled_past_its_bound_stays_under_it(engine, tmp_path, spec):
    bound = 200_000
    if spec == "tiered":
        store = open_store(f"tiered:{tmp_path / 'kv'}")
        memory = store.tiers[0]
        memory.max_bytes = bound  # the default bound is GiBs; the same code path at a size a test can fill
    else:
        store = memory = open_store(spec)
    texts = [f"{TEXTS[i % len(TEXTS)]} (copy {i})" for i in range(40)]
    with ChunkCache(engine, store, storage_dtype="float32") as cache:
        cache.warm(texts)
        cache.flush()
        held = memory.stats()
        assert held.bytes <= bound and held.evictions > 0
        assert 0 < held.entries < len(texts)


class _SlowStore(MemoryKVStore):
    """A store whose writes wait until ``release`` is set: Redis stalled, a disk that takes its time."""

    def __init__(self) -> None:
        super().__init__(max_bytes=None)
        self.release = threading.Event()

    def put_layer(self, key, write_id, layer, data):
        self.release.wait(30)
        super().put_layer(key, write_id, layer, data)


def test_a_full_write_back_queue_drops_and_counts_writes_and_never_blocks_a_request(engine, caplog):
    store = _SlowStore()
    chunk_bytes = None
    with ChunkCache(engine, store, storage_dtype="float32", resident_bytes=0) as cache:
        one = cache._compute(engine, [StoredSegment(engine.tokenize(TEXTS[0]))])[0]
        chunk_bytes = sum(t.nelement() * t.element_size() for t in (*one.keys, *one.values))
        cache.write_back_bytes = 3 * chunk_bytes + chunk_bytes // 2  # room for three chunks of this size
        texts = [f"{TEXTS[0]} (copy {i})" for i in range(10)]
        began = time.monotonic()
        for text in texts:  # each blend misses, computes its chunk and queues its write-back
            segments = [StoredSegment(engine.tokenize(text))]
            source, hits, misses = cache.open_source(engine, segments)
            assert misses == 1
            with cache._pending_lock:
                assert cache._write_backs["queued_bytes"] <= cache.write_back_bytes
        assert time.monotonic() - began < 20  # the stalled store held no request
        store.release.set()
        cache.flush()
        stats = cache.stats()
        assert stats.write_backs_dropped >= 5 and cache._write_backs["queued_bytes"] == 0
        assert 1 <= stats.entries <= 4  # the queued ones were written; the dropped ones are computed again
        assert any("write-back queue" in r.getMessage() for r in caplog.records)
        again = [StoredSegment(engine.tokenize(texts[-1]))]
        assert cache.open_source(engine, again)[2] == 1  # dropped: a miss, computed again, queued this time
    with pytest.raises(ConfigError, match="write_back_bytes"):
        ChunkCache(engine, write_back_bytes=-1)
