"""Quantized chunk KV (int8, int4): bytes, accuracy, blends from a quantized store, and keys that never mix."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment, StoredSegment
from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.store import ChunkCache, DiskKVStore, MemoryKVStore
from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.format.chunk_bytes import decode_layer, encode_layer
from cacheblend_rag.testing import tiny_engine

from kvstore_samples import QUESTION, TEXTS


# What "equals full prefill" means in the engine tests: the same float32 arithmetic in another
# order (layer-wise kernels against the model's forward), far below any storage rounding.
EXACT = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def _prompt(engine, lead_cached: bool = False):
    lead = engine.tokenize("Context:\n")
    chunk_ids = [engine.tokenize(t) for t in TEXTS]
    question = engine.tokenize(QUESTION)
    stored = [StoredSegment(lead) if lead_cached else FreshSegment(lead), *map(StoredSegment, chunk_ids),
              FreshSegment(question)]
    return stored, lead + [t for c in chunk_ids for t in c] + question, chunk_ids


@pytest.mark.parametrize("shape", [(3, 100, 64), (3, 400, 64), (8, 100, 128), (8, 400, 128)],
                         ids=["SmolLM2-100", "SmolLM2-400", "Llama-8B-100", "Llama-8B-400"])
def test_bytes_per_value_meet_the_targets(shape):
    k, v = torch.randn(shape), torch.randn(shape)
    sixteen = len(encode_layer(k, v, codec_named("float16")))
    assert len(encode_layer(k, v, codec_named("int8"))) <= 0.52 * sixteen
    assert len(encode_layer(k, v, codec_named("int4"))) <= 0.30 * sixteen


@pytest.mark.parametrize("name, bound", [("int8", 0.01), ("int4", 0.08)])
def test_quantization_error_is_bounded_per_group(name, bound):
    torch.manual_seed(0)
    scales = torch.linspace(0.05, 20.0, 64)  # outlier channels, as keys have
    k, v = torch.randn(3, 77, 64) * scales, torch.randn(3, 77, 64)
    k2, v2 = decode_layer(encode_layer(k, v, codec_named(name))).unpacked(torch.float32)
    # Keys per channel: each channel's error is small against that channel's own range.
    key_error = ((k2 - k).abs().amax(dim=(0, 1)) / k.abs().amax(dim=(0, 1))).max()
    value_error = ((v2 - v).abs().amax(dim=2) / v.abs().amax(dim=2)).max()
    assert key_error < bound and value_error < bound


@pytest.mark.parametrize("group", [1, 5, 64, 200])
def test_groups_that_do_not_divide_the_tokens_or_channels_round_trip(group):
    k, v = torch.randn(2, 13, 6), torch.randn(2, 13, 6)
    for name in ("int8", "int4"):
        k2, v2 = decode_layer(encode_layer(k, v, codec_named(name, group))).unpacked(torch.float32)
        assert k2.shape == k.shape and torch.isfinite(k2).all() and (k2 - k).abs().max() < 0.5


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_ratio_one_from_a_quantized_store_equals_full_prefill(engine, storage):
    """Every cached token is recomputed from the first layer on, so stored values never reach the
    answer; a lead stored quantized is no exact prefix, so it is recomputed too."""
    stored, full_ids, _ = _prompt(engine, lead_cached=True)
    with ChunkCache(engine, MemoryKVStore(), storage_dtype=storage) as cache:
        cache.warm([s.token_ids for s in stored[1:-1]])
        cache.warm([stored[0].token_ids], prefix_ids=())
        for selection in ("query_profiled", "kv_deviation"):
            result = engine.blend(stored, store=cache, config=BlendConfig(recompute_ratio=1.0, selection=selection))
            assert result.stats.cache_hits == len(stored) - 1 and result.stats.exact_tokens == 0
            torch.testing.assert_close(result.logits, engine.full_prefill(full_ids).logits, **EXACT)


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_ratio_zero_from_a_quantized_store_equals_the_dequantized_chunks(engine, storage):
    stored, _, chunk_ids = _prompt(engine)
    with ChunkCache(engine, MemoryKVStore(), storage_dtype=storage) as cache:
        cache.warm(chunk_ids)
        dequantized = [cache.load(ids) for ids in chunk_ids]
        in_memory = [stored[0], *map(CachedSegment, dequantized), stored[-1]]
        for ratio in (0.0, 0.15):
            cfg = BlendConfig(recompute_ratio=ratio)
            from_store = engine.blend(stored, store=cache, config=cfg)
            assert torch.equal(from_store.logits, engine.blend(in_memory, config=cfg).logits)


def test_quantized_blends_stay_close_to_sixteen_bit(engine):
    stored, full_ids, chunk_ids = _prompt(engine)
    full = engine.full_prefill(full_ids).logits
    errors = {}
    for storage in ("auto", "int8", "int4"):
        with ChunkCache(engine, MemoryKVStore(), storage_dtype=storage) as cache:
            cache.warm(chunk_ids)
            errors[storage] = (engine.blend(stored, store=cache, config=BlendConfig(recompute_ratio=0.0)).logits
                               - full).abs().max().item()
    assert errors["int8"] < 1.1 * errors["auto"] and errors["int4"] < 1.5 * errors["auto"]


def test_a_lossless_lead_stays_an_exact_prefix_in_a_quantized_store(engine):
    stored, full_ids, chunk_ids = _prompt(engine, lead_cached=True)
    with ChunkCache(engine, MemoryKVStore(), storage_dtype="int4") as cache:
        cache.warm(chunk_ids)
        cache.warm([stored[0].token_ids], prefix_ids=(), lossless=True)
        result = engine.blend(stored, store=cache, config=BlendConfig(recompute_ratio=1.0))
        assert result.stats.exact_tokens == len(stored[0].token_ids)
        torch.testing.assert_close(result.logits, engine.full_prefill(full_ids).logits, **EXACT)


def test_a_sixteen_bit_lead_of_a_float32_model_is_blended_not_taken_as_exact(engine):
    """16 bits round what a float32 model computed, so the lead is no exact prefix there: at ratio
    1.0 it is recomputed and the blend equals full prefill exactly."""
    stored, full_ids, chunk_ids = _prompt(engine, lead_cached=True)
    with ChunkCache(engine, MemoryKVStore()) as cache:
        cache.warm(chunk_ids)
        cache.warm([stored[0].token_ids], prefix_ids=())
        result = engine.blend(stored, store=cache, config=BlendConfig(recompute_ratio=1.0))
        assert result.stats.exact_tokens == 0
        torch.testing.assert_close(result.logits, engine.full_prefill(full_ids).logits, **EXACT)


def test_codecs_never_mix_under_one_key(engine, tmp_path):
    _, _, chunk_ids = _prompt(engine)
    path = tmp_path / "kv"
    with ChunkCache(engine, DiskKVStore(path), storage_dtype="int8") as int8:
        assert int8.warm(chunk_ids).new == len(chunk_ids)
    with ChunkCache(engine, DiskKVStore(path)) as sixteen, ChunkCache(engine, DiskKVStore(path), storage_dtype="int4") \
            as int4, ChunkCache(engine, DiskKVStore(path), storage_dtype="int8", storage_group=32) as int8_g32:
        for other in (sixteen, int4, int8_g32):
            assert not any(other.contains(ids) for ids in chunk_ids)
        assert all(ChunkCache(engine, DiskKVStore(path), storage_dtype="int8").contains(ids) for ids in chunk_ids)


def test_cache_stats_show_bytes_per_token_by_codec(engine, tmp_path, capsys, monkeypatch):
    _, _, chunk_ids = _prompt(engine)
    path = tmp_path / "kv"
    for storage in ("auto", "int8", "int4"):
        with ChunkCache(engine, DiskKVStore(path), storage_dtype=storage) as cache:
            cache.warm(chunk_ids)
    assert cli_main(["cache", "stats", "--path", str(path), "--json"]) == 0
    by_codec = json.loads(capsys.readouterr().out)["by_codec"]
    assert set(by_codec) == {"float16", "int8 (group 64)", "int4 (group 64)"}
    tokens = sum(len(c) for c in chunk_ids)
    assert all(share["entries"] == len(chunk_ids) and share["tokens"] == tokens for share in by_codec.values())
    sixteen = by_codec["float16"]["bytes_per_token"]
    assert by_codec["int8 (group 64)"]["bytes_per_token"] < 0.6 * sixteen
    assert by_codec["int4 (group 64)"]["bytes_per_token"] < 0.4 * sixteen
    assert cli_main(["cache", "stats", "--path", str(path)]) == 0
    assert "bytes/token" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "int8", "int4"])
def test_layers_staged_in_one_buffer_are_the_layers_unchanged(name):
    """What the CUDA loader copies in one transfer (here unpinned, on the CPU) cuts back into every chunk's
    tensors bit for bit, whatever their dtypes and odd byte sizes (int4's scales sit after packed nibbles)."""
    from cacheblend_rag.store.format.codec import staged

    torch.manual_seed(0)
    layers = [decode_layer(encode_layer(torch.randn(2, n, 6), torch.randn(2, n, 6), codec_named(name)))
              for n in (1, 7, 13)]
    moved = staged(layers, torch.device("cpu"), pin=False)
    assert len(moved) == len(layers)
    for before, after in zip(layers, moved):
        assert after.codec == before.codec and after.shape == before.shape
        assert [t.dtype for t in after.tensors] == [t.dtype for t in before.tensors]
        assert all(torch.equal(a, b) for a, b in zip(after.tensors, before.tensors))
        for a, b in zip(after.unpacked(torch.float32), before.unpacked(torch.float32)):
            assert torch.equal(a, b)
    assert staged([], torch.device("cpu"), pin=False) == []
