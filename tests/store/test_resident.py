"""The host-memory tier (``ChunkCache(resident_bytes=...)``): chunks read and verified once, or computed,
are served from host memory, exactly, without the store; bounded by bytes; on by default (1 GiB on a CPU, at
most a sixteenth of its memory)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, DiskKVStore
from cacheblend_rag.store.errors import StoreError
from cacheblend_rag.store.format.chunk_bytes import decode_manifest

from kvstore_samples import TEXTS

EXACT = dict(atol=1e-5, rtol=1e-5)
CONFIGS = [BlendConfig(recompute_ratio=0.3, selection="kv_deviation"),  # reads from its check layer on
           BlendConfig(recompute_ratio=0.3, selection="query_profiled"),  # reads every layer
           BlendConfig(recompute_ratio=0.0)]


def _store_off(store: DiskKVStore) -> list[str]:
    """Make every read of ``store`` fail, and record the attempts."""
    attempts: list[str] = []

    def refuse(*args, **kwargs):
        attempts.append("read")
        raise StoreError("this store must not be read")

    store.get_layer = store.get_layers = store.get_manifest = store.get_manifests = refuse
    return attempts


@pytest.mark.parametrize("storage_dtype", ["float32", "int8"])
def test_a_chunk_read_once_is_served_from_host_memory_exactly_without_the_store(
    engine, tmp_path, stored_prompt, storage_dtype
):
    stored, _ = stored_prompt
    with ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype=storage_dtype, resident_bytes=0) as writer:
        writer.warm(TEXTS)
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype=storage_dtype, resident_bytes=1 << 30)
    from_store = [engine.blend(stored, store=cache, config=config) for config in CONFIGS]
    cache.flush()
    assert cache.resident.stats()["entries"] == 3
    attempts, hits = _store_off(cache.store), cache.resident.stats()["hits"]
    for config, expected in zip(CONFIGS, from_store):
        result = engine.blend(stored, store=cache, config=config)
        assert (result.stats.cache_hits, result.stats.cache_misses) == (3, 0)
        assert result.stats.selected_positions == expected.stats.selected_positions
        torch.testing.assert_close(result.logits, expected.logits, atol=0, rtol=0)
    assert attempts == [] and cache.resident.stats()["hits"] == hits + 3 * len(CONFIGS)
    resident = cache.stats().details["resident"]
    assert resident["entries"] == 3 and 0 < resident["bytes"] <= resident["max_bytes"] == 1 << 30
    cache.close()


def test_computed_chunks_are_kept_too_and_equal_the_in_memory_blend(engine, tmp_path, stored_prompt):
    stored, in_memory = stored_prompt
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=1 << 30)
    first = engine.blend(stored, store=cache)
    assert first.stats.cache_misses == 3
    cache.flush()
    _store_off(cache.store)
    again = engine.blend(stored, store=cache)
    assert (again.stats.cache_hits, again.stats.cache_misses) == (3, 0)
    torch.testing.assert_close(again.logits, engine.blend(in_memory).logits, **EXACT)
    cache.close()


def test_a_resident_chunk_is_not_read_again_so_later_damage_in_the_store_costs_nothing(
    engine, tmp_path, stored_prompt, chunk_ids
):
    stored, in_memory = stored_prompt
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=1 << 30)
    cache.warm(TEXTS)
    engine.blend(stored, store=cache)
    cache.flush()
    store: DiskKVStore = cache.store
    key = cache.key_for(chunk_ids[0])
    manifest = decode_manifest(store.get_manifest(key))
    blob = store.get_layer(key, manifest.write_id, 1)
    store.put_layer(key, manifest.write_id, 1, blob[:-1] + bytes([blob[-1] ^ 1]))
    result = engine.blend(stored, store=cache)
    torch.testing.assert_close(result.logits, engine.blend(in_memory).logits, **EXACT)
    assert cache.stats().corrupt == 0
    cache.close()


def test_the_tier_is_bounded_by_bytes_least_recently_used_first(engine, tmp_path, stored_prompt, chunk_ids):
    stored, in_memory = stored_prompt
    probe = ChunkCache(engine, DiskKVStore(tmp_path / "probe"), resident_bytes=1 << 30)
    engine.blend([*stored[:2], stored[-1]], store=probe)  # the first chunk alone, to learn one chunk's size
    probe.flush()
    one = probe.resident.stats()["bytes"]
    probe.close()
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=2 * one)
    engine.blend(stored, store=cache)
    cache.flush()
    stats = cache.resident.stats()
    assert stats["entries"] <= 2 and stats["bytes"] <= 2 * one
    assert cache.key_for(chunk_ids[2]) in cache.resident  # the most recent stays
    torch.testing.assert_close(engine.blend(stored, store=cache).logits, engine.blend(in_memory).logits, **EXACT)
    cache.close()


def test_on_by_default_off_at_zero_and_a_bad_bound_is_refused(engine):
    with ChunkCache(engine) as cache:  # a CPU engine: 1 GiB, or a sixteenth of the machine's memory if less
        assert cache.resident is not None and 0 < cache.resident.max_bytes <= 1 << 30
    with ChunkCache(engine, resident_bytes=0) as cache:
        assert cache.resident is None
    for bad in (-1, True, "1 GiB", 1.5):
        with pytest.raises(ConfigError, match="resident_bytes"):
            ChunkCache(engine, resident_bytes=bad)


def test_a_chunk_larger_than_the_whole_tier_is_not_read_again_for_it(engine, tmp_path, stored_prompt):
    stored, in_memory = stored_prompt
    with ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=0) as writer:
        writer.warm(TEXTS)
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=64)
    reads, fetch = [], cache.store.get_layers
    cache.store.get_layers = lambda requests: (reads.append(len(requests)), fetch(requests))[1]
    result = engine.blend(stored, store=cache, config=BlendConfig(recompute_ratio=0.0))
    cache.flush()
    assert cache.resident.stats()["entries"] == 0
    assert sum(reads) == 3 * engine.num_layers  # the blend's own reads, none for the tier
    torch.testing.assert_close(result.logits, engine.blend(in_memory, config=BlendConfig(recompute_ratio=0.0)).logits,
                               **EXACT)
    cache.close()


def test_page_locked_memory_is_counted_as_the_allocator_holds_it():
    # torch's page-locked allocator rounds each allocation up to a power of two; the bound counts that.
    from cacheblend_rag.store.resident import ResidentChunks

    pinned, plain = ResidentChunks(1 << 30, pin=True), ResidentChunks(1 << 30, pin=False)
    assert [pinned.footprint(n) for n in (1, 4096, 4097, 3 << 20)] == [1, 4096, 8192, 4 << 20]
    assert plain.footprint(4097) == 4097
    layers = [torch.ones(2, 3, 4) for _ in range(5)]
    kept = plain.host_copy(layers, [2 * t for t in layers], torch.float32, exact=True)
    assert kept.nbytes == 2 * 5 * 2 * 3 * 4 * 4 and kept.keys.shape == (5, 2, 3, 4)
    assert torch.equal(kept.values[3], 2 * layers[3])


@pytest.mark.parametrize("config", CONFIGS[:2], ids=["from_the_check_layer", "every_layer"])
def test_a_chunk_is_kept_from_the_layers_its_blend_read_and_only_the_skipped_ones_are_read_again(
    engine, tmp_path, stored_prompt, config
):
    stored, _ = stored_prompt
    with ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=0) as writer:
        writer.warm(TEXTS)
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=1 << 30)
    read: list[int] = []
    fetch = cache.store.get_layers
    cache.store.get_layers = lambda requests: (read.extend(layer for _, _, layer in requests), fetch(requests))[1]
    skipped, keep = [], cache._keep_stored_resident
    cache._keep_stored_resident = lambda key, manifest, read: (
        skipped.append(sorted(set(range(engine.num_layers)) - set(read))), keep(key, manifest, read))
    first = engine.blend(stored, store=cache, config=config)
    cache.flush()
    assert cache.resident.stats()["entries"] == 3
    # A deviation blend starts at its check layer (1): only layer 0 is read again, for the tier.
    assert skipped == [[0]] * 3 if config.selection == "kv_deviation" else skipped == [[]] * 3
    assert sorted(read) == sorted(list(range(engine.num_layers)) * 3)  # each layer of each chunk read once
    again = engine.blend(stored, store=cache, config=config)
    assert len(read) == 3 * engine.num_layers  # nothing more
    torch.testing.assert_close(again.logits, first.logits, atol=0, rtol=0)
    cache.close()
