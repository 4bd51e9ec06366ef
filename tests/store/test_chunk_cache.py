"""Blending from a store: exact answers, write-back of misses, and recovery from every kind of damage or failure."""

from __future__ import annotations

import logging
import os
import sqlite3

import pytest
import torch

from cacheblend_rag import BlendConfig, FreshSegment, StoredSegment
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore, TieredKVStore
from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.format.chunk_bytes import decode_manifest, encode_layer, encode_manifest
from cacheblend_rag.store.loader import PipelinedKVSource

from kvstore_samples import TEXTS

EXACT = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def disk_cache(engine, tmp_path):  # the store alone: no host-memory tier in front of it
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", resident_bytes=0)
    yield cache
    cache.close()


def _reference(engine, in_memory, config=None):
    return engine.blend(in_memory, config=config).logits


# ------------------------------------------------------------ correctness
@pytest.mark.parametrize("prefetch", [True, False])
def test_blend_from_disk_equals_blend_from_in_memory_chunks(engine, tmp_path, stored_prompt, prefetch):
    stored, in_memory = stored_prompt
    cache = ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32", prefetch=prefetch)
    summary = cache.warm(TEXTS)
    assert (summary.new, summary.present) == (3, 0) and summary.bytes_written > 0
    result = engine.blend(stored, store=cache)
    assert (result.stats.cache_hits, result.stats.cache_misses) == (3, 0)
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert "load_wait" in result.stats.timings
    cache.close()


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled", "gradual"])
def test_every_strategy_from_disk_equals_in_memory(engine, disk_cache, stored_prompt, selection):
    # query_profiled reads every layer once, in its profiling pass, and patches that merged cache.
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    config = BlendConfig(recompute_ratio=0.3, selection=selection)
    result = engine.blend(stored, store=disk_cache, config=config)
    reference = engine.blend(in_memory, config=config)
    assert result.stats.selected_positions == reference.stats.selected_positions
    torch.testing.assert_close(result.logits, reference.logits, **EXACT)


@pytest.mark.parametrize("selection", ["kv_deviation", "query_profiled"])
def test_stored_exact_lead_from_disk_equals_in_memory(engine, disk_cache, stored_prompt, selection):
    stored, in_memory = stored_prompt
    lead = engine.tokenize("Answer from these notes.\n")
    disk_cache.warm(TEXTS)
    disk_cache.warm([lead])
    config = BlendConfig(recompute_ratio=0.3, selection=selection)
    result = engine.blend([StoredSegment(lead), *stored], store=disk_cache, config=config)
    reference = engine.blend([engine.prefill_chunk(lead), *in_memory], config=config)
    assert (result.stats.cache_hits, result.stats.cache_misses) == (4, 0)
    assert result.stats.selected_positions == reference.stats.selected_positions
    torch.testing.assert_close(result.logits, reference.logits, **EXACT)


def test_ratio_one_from_the_store_equals_full_prefill(engine, disk_cache, stored_prompt):
    stored, _ = stored_prompt
    disk_cache.warm(TEXTS)
    full = engine.full_prefill([t for s in stored for t in s.token_ids]).logits
    blended = engine.blend(stored, store=disk_cache, config=BlendConfig(recompute_ratio=1.0)).logits
    torch.testing.assert_close(blended, full, atol=1e-4, rtol=1e-4)


def test_full_reuse_reads_every_layer(engine, disk_cache, stored_prompt):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    config = BlendConfig(recompute_ratio=0.0)
    torch.testing.assert_close(engine.blend(stored, store=disk_cache, config=config).logits,
                               _reference(engine, in_memory, config), **EXACT)


def test_sixteen_bit_storage_is_close_and_half_the_bytes(engine, tmp_path, stored_prompt):
    stored, in_memory = stored_prompt
    c32 = ChunkCache(engine, MemoryKVStore(), storage_dtype="float32")
    c16 = ChunkCache(engine, MemoryKVStore())
    b32, b16 = c32.warm(TEXTS).bytes_written, c16.warm(TEXTS).bytes_written
    assert b16 < 0.55 * b32
    torch.testing.assert_close(engine.blend(stored, store=c16).logits, _reference(engine, in_memory),
                               atol=2e-2, rtol=2e-2)


def test_auto_storage_dtype_falls_back_to_bfloat16_beyond_float16_range(engine):
    from cacheblend_rag.engine import ChunkKV

    cache = ChunkCache(engine)
    small, huge = torch.ones(2, 3, 4), torch.full((2, 3, 4), 1e6)

    def chunk(*tensors):
        return ChunkKV((1, 2, 3), [tensors[0]], [tensors[1]])

    assert cache.codec_for(chunk(small, small)).name == "float16"
    assert cache.codec_for(chunk(small, huge)).name == "bfloat16"
    assert cache.codec_for(chunk(small.bfloat16(), small.bfloat16())).name == "bfloat16"
    with pytest.raises(ConfigError, match="storage_dtype='int3' is not supported"):
        ChunkCache(engine, storage_dtype="int3")


def test_misses_are_computed_used_and_written_back(engine, disk_cache, stored_prompt, chunk_ids):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS[:1])
    result = engine.blend(stored, store=disk_cache)
    assert (result.stats.cache_hits, result.stats.cache_misses) == (1, 2)
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    disk_cache.flush()
    assert all(disk_cache.contains(ids) for ids in chunk_ids)
    again = engine.blend(stored, store=disk_cache)
    assert (again.stats.cache_hits, again.stats.cache_misses) == (3, 0)
    stats = disk_cache.stats()
    assert (stats.entries, stats.hits, stats.misses) == (3, 4, 2)


def test_write_back_can_be_turned_off(engine, tmp_path, stored_prompt, chunk_ids):
    cache = ChunkCache(engine, MemoryKVStore(), write_back=False)
    engine.blend(stored_prompt[0], store=cache)
    cache.flush()
    assert not any(cache.contains(ids) for ids in chunk_ids)


def test_warm_counts_new_present_and_duplicates(engine, disk_cache, chunk_ids):
    assert disk_cache.warm([TEXTS[0]]).new == 1
    summary = disk_cache.warm([*TEXTS, chunk_ids[1], ""], show_progress=True)
    assert (summary.new, summary.present, summary.failed) == (2, 2, 0)
    loaded = disk_cache.load(chunk_ids[2])
    fresh = engine.prefill_chunk(chunk_ids[2])
    assert loaded is not None and loaded.model_fingerprint == engine.fingerprint
    for a, b in zip(loaded.keys + loaded.values, fresh.keys + fresh.values):
        torch.testing.assert_close(a, b, **EXACT)


def test_prefix_conditioned_chunks_are_kept_apart(engine, tmp_path, chunk_ids, question_ids):
    prefix = engine.tokenize("Context information is below.\n")
    cache = ChunkCache(engine, MemoryKVStore(), prefix_ids=prefix, storage_dtype="float32")
    cache.warm(TEXTS)
    assert cache.contains(chunk_ids[0]) and not cache.contains(chunk_ids[0], prefix_ids=())
    segments = [FreshSegment(prefix), *(StoredSegment(ids, prefix) for ids in chunk_ids), FreshSegment(question_ids)]
    result = engine.blend(segments, store=cache)
    assert result.stats.cache_misses == 0
    reference = engine.blend([FreshSegment(prefix), *engine.prefill_chunks(chunk_ids, prefix_ids=prefix),
                              FreshSegment(question_ids)]).logits
    torch.testing.assert_close(result.logits, reference, **EXACT)


def test_tiered_store_serves_a_blend_and_promotes(engine, tmp_path, stored_prompt):
    stored, in_memory = stored_prompt
    ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32").warm(TEXTS)
    memory = MemoryKVStore()
    cache = ChunkCache(engine, TieredKVStore(memory, DiskKVStore(tmp_path / "kv")))
    result = engine.blend(stored, store=cache)
    assert result.stats.cache_hits == 3
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert memory.stats().entries == 3 and memory.stats().bytes > 0


def test_loader_reads_the_next_layer_ahead(engine, disk_cache, chunk_ids):
    disk_cache.warm(TEXTS)
    fetched: list[int] = []
    store = disk_cache.store
    original = store.get_layers

    def recording(requests):
        fetched.append(requests[0][2])
        return original(requests)

    store.get_layers = recording
    _, hits, _ = disk_cache.open_source(engine, [StoredSegment(ids) for ids in chunk_ids])
    source = PipelinedKVSource(store, engine, disk_cache.open_source(engine, [StoredSegment(chunk_ids[0])])[0].chunks,
                               disk_cache.rules, first_layer=1)
    k, v = source.layer(1)
    source._futures[2].result()
    assert fetched[-2:] == [1, 2] and k.shape == v.shape and k.dtype == engine.dtype
    with pytest.raises(IndexError):
        source.layer(engine.num_layers)
    source.close()


# ---------------------------------------------------------------- damage
def _damage(cache, key, kind, engine):
    store: DiskKVStore = cache.store
    manifest = decode_manifest(store.get_manifest(key))
    layer = engine.num_layers - 1  # a late layer, so that the damage is found in the middle of the blend
    blob = store.get_layer(key, manifest.write_id, layer)
    if kind == "wrong-checksum":
        store.put_layer(key, manifest.write_id, layer, blob[:-1] + bytes([blob[-1] ^ 1]))
    elif kind == "payload-bit-flip":
        store.put_layer(key, manifest.write_id, layer, blob[:50] + bytes([blob[50] ^ 4]) + blob[51:])
    elif kind == "truncated":
        store.put_layer(key, manifest.write_id, layer, blob[: len(blob) // 2])
    elif kind == "garbage":
        store.put_layer(key, manifest.write_id, layer, os.urandom(len(blob)))
    elif kind == "missing-layer":
        store._cache.delete(f"l:{key}:{manifest.write_id}:{layer}")
    elif kind == "wrong-shape":
        h, n, d = manifest.layer_shape
        bad = encode_layer(torch.zeros(h, n + 1, d), torch.zeros(h, n + 1, d), codec_named("float32"))
        store.put_layer(key, manifest.write_id, layer, bad)
        digests = list(manifest.layer_digests)
        digests[layer] = bad[-16:].hex()
        store._cache.delete(f"m:{key}")
        store.add_manifest(key, encode_manifest(type(manifest)(**{**manifest.__dict__, "layer_digests": tuple(digests)})))
    elif kind == "garbage-manifest":
        store._cache.set(f"m:{key}", os.urandom(200))
    elif kind == "manifest-of-another-shape":
        store._cache.delete(f"m:{key}")
        store.add_manifest(key, encode_manifest(type(manifest)(**{**manifest.__dict__, "num_tokens": 3})))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["wrong-checksum", "payload-bit-flip", "truncated", "garbage",
                                  "wrong-shape", "garbage-manifest", "manifest-of-another-shape"])
def test_corrupt_entry_is_detected_counted_deleted_and_recomputed(engine, disk_cache, stored_prompt, chunk_ids,
                                                                  kind, caplog):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    key = disk_cache.key_for(chunk_ids[1])
    _damage(disk_cache, key, kind, engine)
    with caplog.at_level(logging.WARNING):
        result = engine.blend(stored, store=disk_cache)
        disk_cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert any("corrupt" in r.message for r in caplog.records)
    assert disk_cache.stats().corrupt == 1
    # the entry was rewritten whole: the next blend reads it without complaint
    caplog.clear()
    assert disk_cache.load(chunk_ids[1]) is not None
    again = engine.blend(stored, store=disk_cache)
    assert again.stats.cache_hits == 3 and disk_cache.stats().corrupt == 1
    torch.testing.assert_close(again.logits, result.logits, **EXACT)


def test_a_layer_lost_to_eviction_is_an_eviction_quietly_recomputed_not_corruption(
    engine, disk_cache, stored_prompt, chunk_ids, caplog
):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    key = disk_cache.key_for(chunk_ids[1])
    _damage(disk_cache, key, "missing-layer", engine)
    with caplog.at_level(logging.INFO):
        result = engine.blend(stored, store=disk_cache)
        disk_cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    stats = disk_cache.stats()
    assert stats.corrupt == 0 and stats.evictions == 1
    assert engine.blend(stored, store=disk_cache).stats.cache_hits == 3  # written back whole


# --------------------------------------------------------------- failure
def _layer_names(store: DiskKVStore) -> list[str]:
    return [n for n in store._cache.iterkeys() if n.startswith("l:")]


def test_disk_full_on_put_answers_fresh_with_a_warning_and_writes_nothing(engine, disk_cache, stored_prompt,
                                                                         monkeypatch, caplog):
    stored, in_memory = stored_prompt
    store: DiskKVStore = disk_cache.store
    real_set, calls = store._cache.set, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        return real_set(*args, **kwargs)

    monkeypatch.setattr(store._cache, "set", full_disk)
    with caplog.at_level(logging.WARNING):
        result = engine.blend(stored, store=disk_cache)
        disk_cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert any("No space left" in r.message for r in caplog.records)
    assert list(store.keys()) == [] and _layer_names(store) == []  # nothing half-written
    assert disk_cache.warm(TEXTS).failed == 3


def test_read_only_store_answers_from_what_it_has(engine, disk_cache, stored_prompt, monkeypatch, caplog):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS[:2])
    store: DiskKVStore = disk_cache.store

    def readonly(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    for name in ("set", "add", "incr", "delete", "evict"):
        monkeypatch.setattr(store._cache, name, readonly)
    monkeypatch.setattr(store._counter_cache, "incr", readonly)
    with caplog.at_level(logging.WARNING):
        result = engine.blend(stored, store=disk_cache)
        disk_cache.flush()
    assert (result.stats.cache_hits, result.stats.cache_misses) == (2, 1)
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert any("readonly" in r.message for r in caplog.records)


def test_unreachable_store_answers_fresh(engine, disk_cache, stored_prompt, monkeypatch, caplog):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    store: DiskKVStore = disk_cache.store

    def gone(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    for name in ("get", "set", "add", "incr", "delete", "evict", "__contains__"):
        monkeypatch.setattr(store._cache, name, gone)
    monkeypatch.setattr(store._counter_cache, "incr", gone)
    with caplog.at_level(logging.WARNING):
        result = engine.blend(stored, store=disk_cache)
        disk_cache.flush()
    assert result.stats.cache_misses == 3
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert sum("failed to read" in r.message for r in caplog.records) == 1


def test_store_failing_in_the_middle_of_a_blend_is_survived(engine, disk_cache, stored_prompt, monkeypatch):
    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    store: DiskKVStore = disk_cache.store
    real_get = store._cache.get

    def flaky(name, *args, **kwargs):
        if name.startswith("l:") and name.endswith(f":{engine.num_layers - 1}"):
            raise sqlite3.OperationalError("disk I/O error")
        return real_get(name, *args, **kwargs)

    monkeypatch.setattr(store._cache, "get", flaky)
    result = engine.blend(stored, store=disk_cache)
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    disk_cache.flush()
    assert disk_cache.stats().corrupt == 0  # a failing store is not a damaged entry


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_real_read_only_directory(engine, tmp_path, stored_prompt, caplog):
    stored, in_memory = stored_prompt
    path = tmp_path / "kv"
    ChunkCache(engine, DiskKVStore(path), storage_dtype="float32").warm(TEXTS[:1])
    os.chmod(path, 0o555)
    try:
        try:
            cache = ChunkCache(engine, DiskKVStore(path))
        except Exception as exc:  # opening may already fail; that is a clear error, not a crash mid-request
            assert "cannot open" in str(exc)
            return
        with caplog.at_level(logging.WARNING):
            result = engine.blend(stored, store=cache)
            cache.flush()
        torch.testing.assert_close(result.logits, _reference(engine, in_memory), atol=2e-2, rtol=2e-2)
    finally:
        os.chmod(path, 0o755)


# ----------------------------------------------------- eviction, mismatch
def test_evicted_chunks_are_recomputed_transparently(engine, tmp_path, stored_prompt):
    stored, in_memory = stored_prompt
    probe_store = DiskKVStore(tmp_path / "probe")
    per_chunk = ChunkCache(engine, probe_store, storage_dtype="float32").warm(TEXTS[:2]).bytes_written // 2
    limit = probe_store.volume() + per_chunk // 2  # room for two chunks, not three
    store = DiskKVStore(tmp_path / "kv", size_limit=limit)
    cache = ChunkCache(engine, store, storage_dtype="float32")
    cache.warm(TEXTS)
    assert store.volume() <= limit and store.stats().evictions >= 1
    result = engine.blend(stored, store=cache)
    assert result.stats.cache_misses >= 1
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    cache.flush()
    assert store.volume() <= limit


def test_entry_of_another_model_is_never_returned(engine, tmp_path, stored_prompt, chunk_ids):
    from cacheblend_rag.testing import tiny_engine

    ChunkCache(engine, DiskKVStore(tmp_path / "kv"), storage_dtype="float32").warm(TEXTS)
    other = tiny_engine(seed=1, config=engine.config)
    cache = ChunkCache(other, DiskKVStore(tmp_path / "kv"), storage_dtype="float32")
    assert not any(cache.contains(ids) for ids in chunk_ids)
    stored, _ = stored_prompt
    result = other.blend(stored, store=cache)
    assert (result.stats.cache_hits, result.stats.cache_misses) == (0, 3)
    reference = other.blend([stored[0], *other.prefill_chunks(chunk_ids), stored[-1]]).logits
    torch.testing.assert_close(result.logits, reference, **EXACT)


def test_a_pickled_value_planted_in_the_directory_is_treated_as_corrupt(engine, disk_cache, stored_prompt,
                                                                        chunk_ids):
    import diskcache

    stored, in_memory = stored_prompt
    disk_cache.warm(TEXTS)
    store: DiskKVStore = disk_cache.store
    manifest = decode_manifest(store.get_manifest(disk_cache.key_for(chunk_ids[0])))
    with diskcache.Cache(str(store.path)) as raw:  # an ordinary diskcache pickles non-bytes values
        raw.set(f"m:{disk_cache.key_for(chunk_ids[1])}", {"evil": True})
        raw.set(f"l:{manifest.key}:{manifest.write_id}:{engine.num_layers - 1}", ["evil"] * 10_000)
    result = engine.blend(stored, store=disk_cache)
    disk_cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert disk_cache.stats().corrupt == 2


def test_cache_opens_a_store_from_a_spec_and_closes_what_it_opened(engine, tmp_path, chunk_ids):
    with ChunkCache(engine, f"disk:{tmp_path / 'kv'}", batch_size=2) as cache:
        assert isinstance(cache.store, DiskKVStore)
        assert cache.warm(TEXTS).new == 3
    assert ChunkCache(engine, str(tmp_path / "kv")).contains(chunk_ids[0])
    with pytest.raises(ConfigError, match="batch_size"):
        ChunkCache(engine, batch_size=0)


def test_closing_a_source_early_cancels_its_read_ahead(engine, disk_cache, chunk_ids):
    disk_cache.warm(TEXTS)
    source, hits, misses = disk_cache.open_source(engine, [StoredSegment(ids) for ids in chunk_ids])
    assert isinstance(source, PipelinedKVSource) and (hits, misses) == (3, 0)
    source.layer(0)
    source.close()
    assert source._executor is None and not source._futures


def test_blends_on_one_thread_share_one_read_ahead_thread(engine, disk_cache, chunk_ids, stored_prompt):
    # A read-ahead thread per blend cost a thread start a request and, per new thread, a SQLite connection to
    # the disk store: open files drifted in a soak. Threads and open files stay flat over many blends.
    import os
    import threading

    disk_cache.warm(TEXTS)
    stored, _ = stored_prompt

    def loaders() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("cacheblend-kv-loader")]

    engine.blend(stored, store=disk_cache)
    threads, files = loaders(), len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        engine.blend(stored, store=disk_cache)
    assert loaders() == threads  # no new one (other tests' blending threads may keep theirs)
    executors = []
    for _ in range(2):
        source, _, _ = disk_cache.open_source(engine, [StoredSegment(ids) for ids in chunk_ids])
        executors.append(source._executor)
        source.close()
    assert executors[0] is not None and executors[0] is executors[1]
    assert len(os.listdir("/proc/self/fd")) <= files + 2
