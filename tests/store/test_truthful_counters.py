"""A chunk counts as a hit only if its stored KV was used. One whose entry was found but could not be
read whole (the store failed mid-blend, or its layers vanished between the manifest and the layer
reads) was recomputed: it is a load failure, in the blend's stats, the store's counters and
``cache stats``."""

from __future__ import annotations

import json

import torch

from cacheblend_rag import BlendConfig, FreshSegment, StoredSegment
from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore
from cacheblend_rag.store.errors import StoreError

from kvstore_samples import QUESTION, TEXTS  # noqa: E402

CONFIG = BlendConfig(recompute_ratio=0.25, check_layer=1)


def _prompts(engine):
    ids = [engine.tokenize(t) for t in TEXTS]
    question = FreshSegment(engine.tokenize(QUESTION))
    return [*map(StoredSegment, ids), question], [*engine.prefill_chunks(ids), question]


def _layers_flushed_after_the_manifests(monkeypatch, how_many: int | None = None) -> None:
    """As FLUSHALL (or eviction) would: the layers of the first ``how_many`` chunks go right after
    their manifests were read."""
    real = MemoryKVStore.get_manifests

    def flushed_after_reading(self, keys):
        manifests = real(self, keys)
        for key in keys[:how_many]:
            self._entries[key].layers.clear()
        return manifests

    monkeypatch.setattr(MemoryKVStore, "get_manifests", flushed_after_reading)


def test_a_store_failing_mid_blend_counts_load_failures_not_hits(engine, tmp_path, monkeypatch, capsys):
    store = DiskKVStore(tmp_path / "kv")
    cache = ChunkCache(engine, store, storage_dtype="float32")
    cache.warm(TEXTS)
    stored, in_memory = _prompts(engine)
    real, calls = DiskKVStore.get_layers, []

    def dies_at_the_second_layer_read(self, requests):
        calls.append(1)
        if len(calls) >= 2:
            raise StoreError("the store went away")
        return real(self, requests)

    monkeypatch.setattr(DiskKVStore, "get_layers", dies_at_the_second_layer_read)
    result = engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    torch.testing.assert_close(result.logits, engine.blend(in_memory, config=CONFIG).logits, rtol=0, atol=1e-5)
    stats = result.stats
    assert (stats.cache_hits, stats.cache_misses, stats.load_failures) == (0, 0, 3)
    assert stats.loaded_tokens == 0 and stats.to_dict()["load_failures"] == 3
    assert stats.store_error == "the store went away; its chunks were computed fresh"  # a layer read, this request's
    counters = cache.stats()
    assert (counters.hits, counters.misses, counters.load_failures, counters.corrupt) == (0, 0, 3, 0)
    monkeypatch.undo()
    cache.close()
    store.close()
    assert cli_main(["cache", "stats", "--path", str(tmp_path / "kv"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["load_failures"] == 3


def test_layers_gone_between_the_manifest_and_the_layer_reads_are_load_failures(engine, monkeypatch):
    store = MemoryKVStore()
    cache = ChunkCache(engine, store, storage_dtype="float32")
    cache.warm(TEXTS)
    stored, in_memory = _prompts(engine)
    _layers_flushed_after_the_manifests(monkeypatch, 2)
    result = engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    torch.testing.assert_close(result.logits, engine.blend(in_memory, config=CONFIG).logits, rtol=0, atol=1e-5)
    assert (result.stats.cache_hits, result.stats.load_failures) == (1, 2)
    loaded = len(engine.tokenize(TEXTS[2]))
    assert result.stats.loaded_tokens == loaded < result.stats.reused_tokens
    assert cache.stats().load_failures == 2 and cache.stats().hits == 1


def test_a_miss_loads_nothing(engine):
    cache = ChunkCache(engine, MemoryKVStore(), storage_dtype="float32")
    stored, _ = _prompts(engine)
    stats = engine.blend(stored, store=cache, config=CONFIG).stats
    assert (stats.cache_hits, stats.cache_misses, stats.load_failures, stats.loaded_tokens) == (0, 3, 0, 0)
    assert stats.store_error is None  # a miss is not a failed read
    cache.flush()  # the missed chunks are written back on a writer thread; the second blend must find them all
    assert engine.blend(stored, store=cache, config=CONFIG).stats.loaded_tokens == stats.cached_tokens


def test_chunk_cache_stats_never_raise(engine, monkeypatch):
    store = MemoryKVStore()
    cache = ChunkCache(engine, store)

    def unreachable(self):
        raise StoreError("the server does not answer")

    monkeypatch.setattr(MemoryKVStore, "stats", unreachable)
    stats = cache.stats()
    assert not stats.available and "does not answer" in stats.error


def test_chunks_whose_layers_vanish_mid_read_are_recomputed_in_one_batch(engine, monkeypatch):
    """Issue 24, item 4: with FLUSHALL at random moments, a request whose keys went between its manifest
    read and its layer reads recomputed each chunk alone, on the loader thread (a full prefill, one chunk
    at a time: 40-65 s against 5 s on a busy 2-core machine). Now in one batch, and the time is shown."""
    store = MemoryKVStore()
    cache = ChunkCache(engine, store, storage_dtype="float32")
    cache.warm(TEXTS)
    stored, in_memory = _prompts(engine)
    batches = []
    prefill_chunks = type(engine).prefill_chunks

    def counted(self, chunks, **kwargs):
        batches.append(len(chunks))
        return prefill_chunks(self, chunks, **kwargs)

    _layers_flushed_after_the_manifests(monkeypatch)
    monkeypatch.setattr(type(engine), "prefill_chunks", counted)
    result = engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    torch.testing.assert_close(result.logits, engine.blend(in_memory, config=CONFIG).logits, rtol=0, atol=1e-5)
    assert batches[0] == 3 and result.stats.load_failures == 3
    assert result.stats.timings["load_recompute"] > 0
