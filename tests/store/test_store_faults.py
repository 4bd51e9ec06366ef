"""Faults that outlive a request: an altered disk index, weights that change, huge value files,
stores that cannot be opened again, eviction, foreign rows, and bad input that names what is wrong."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

from cacheblend_rag import BlendConfig, BlendInputError, CacheBlendEngine, FreshSegment, StoredSegment
from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.store import ChunkCache, DiskKVStore
from cacheblend_rag.store.format.tampering import (
    INDEX_DAMAGE,
    damage_index,
    index_rows,
    set_index_filename,
    write_as_another_program,
)


CONFIG = BlendConfig(recompute_ratio=0.25, check_layer=1)


@pytest.fixture
def warmed(engine, chunk_ids, tmp_path):
    path = tmp_path / "kv"
    with DiskKVStore(path) as store, ChunkCache(engine, store, storage_dtype="float32") as cache:
        cache.warm(chunk_ids)  # closed, as by a replica that stops: no connection holds the index open
    return path


# ------------------------------------------------------------------ 1. files outside the store
@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_an_altered_index_never_deletes_or_reads_a_file_outside_the_store(engine, warmed, stored_prompt, tmp_path,
                                                                          target):
    outside = tmp_path / "outside" / "victim.txt"
    outside.parent.mkdir()
    outside.write_text("precious")
    rowid, _, _ = index_rows(warmed, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
    set_index_filename(warmed, rowid, str(outside) if target == "absolute" else "../outside/victim.txt")
    with ChunkCache(engine, DiskKVStore(warmed), storage_dtype="float32") as cache:
        stored, in_memory = stored_prompt
        result = engine.blend(stored, store=cache, config=CONFIG)  # reads that row: corrupt, deleted
        cache.flush()
        torch.testing.assert_close(result.logits, engine.blend(in_memory, config=CONFIG).logits, atol=1e-5, rtol=1e-5)
        assert cache.stats().corrupt == 1
    rowid, _, _ = index_rows(warmed, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
    set_index_filename(warmed, rowid, str(outside))
    assert cli_main(["cache", "clear", "--path", str(warmed)]) == 0
    assert outside.read_text() == "precious" and outside.parent.is_dir()


def test_eviction_never_deletes_a_file_outside_the_store(engine, chunk_ids, tmp_path):
    outside = tmp_path / "victim.txt"
    outside.write_text("precious")
    path = tmp_path / "kv"
    with ChunkCache(engine, DiskKVStore(path, size_limit=10**9), storage_dtype="float32") as cache:
        cache.warm(chunk_ids[:1])
        rowid, _, _ = index_rows(path, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
        set_index_filename(path, rowid, str(outside))
        cache.store.size_limit = 1  # everything must go
        cache.warm(chunk_ids[1:2])
    assert outside.read_text() == "precious"


# ------------------------------------------------------------------ 2. weights that change
def test_changed_weights_never_reuse_the_old_weights_chunk_kv(engine, chunk_ids, stored_prompt, tmp_path):
    stored, _ = stored_prompt
    path = tmp_path / "kv"
    with ChunkCache(engine, DiskKVStore(path), storage_dtype="float32") as cache:
        cache.warm(chunk_ids)
    copied = CacheBlendEngine(copy.deepcopy(engine.model), engine.tokenizer, config=CONFIG, min_blend_tokens=0)
    assert copied.fingerprint == engine.fingerprint  # equal weights, equal identity: the copy may reuse
    with torch.no_grad():
        copied.model.model.layers[0].self_attn.v_proj.weight.mul_(1.5)
    assert copied.fingerprint != engine.fingerprint
    with ChunkCache(copied, DiskKVStore(path), storage_dtype="float32") as cache:
        result = copied.blend(stored, store=cache, config=CONFIG)
        assert result.stats.cache_hits == 0
        fresh = [stored[0], *copied.prefill_chunks(chunk_ids), stored[-1]]
        torch.testing.assert_close(result.logits, copied.blend(fresh, config=CONFIG).logits, atol=1e-5, rtol=1e-5)


def test_weights_changed_in_place_change_the_fingerprint_of_the_same_engine(chunk_ids):
    from cacheblend_rag.testing import tiny_engine

    engine = tiny_engine("llama", seed=5)
    before = engine.fingerprint
    assert engine.fingerprint == before  # stable while nothing changes
    with torch.no_grad():
        engine.model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    assert engine.fingerprint != before



def test_a_replaced_weight_or_submodule_changes_the_fingerprint_of_the_same_engine():
    """The stamp walks the modules as they are now: a parameter or a whole layer swapped for another is seen."""
    from cacheblend_rag.testing import tiny_engine

    engine = tiny_engine("llama", seed=5)
    before = engine.fingerprint
    mlp = engine.model.model.layers[1].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 2)
    after_weight = engine.fingerprint
    assert after_weight != before
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    assert engine.fingerprint not in (before, after_weight)


# ------------------------------------------------------------------ 3. unbounded reads
def test_a_huge_sparse_value_file_is_corrupt_not_read(engine, warmed, stored_prompt):
    _, _, filename = index_rows(warmed, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
    os.truncate(warmed / filename, 6 * 2**30)  # 6 GiB, no disk space used
    with ChunkCache(engine, DiskKVStore(warmed), storage_dtype="float32") as cache:
        stored, in_memory = stored_prompt
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
        torch.testing.assert_close(result.logits, engine.blend(in_memory, config=CONFIG).logits, atol=1e-5, rtol=1e-5)
        assert cache.stats().corrupt == 1


# ------------------------------------------------------------------ 4. stores that must open again
@pytest.mark.parametrize("damage", INDEX_DAMAGE)
def test_a_store_with_a_broken_index_opens_empty_and_clear_works(engine, warmed, stored_prompt, damage, caplog):
    damage_index(warmed, damage)
    with caplog.at_level(logging.WARNING):
        store = DiskKVStore(warmed)
    assert store.stats().entries == 0
    if damage not in ("deleted", "empty"):  # an empty file is a valid, empty SQLite database
        assert any("moved aside" in r.message for r in caplog.records)
    assert not list(warmed.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val"))  # orphans reclaimed
    stored, _ = stored_prompt
    with ChunkCache(engine, store, storage_dtype="float32") as cache:
        assert engine.blend(stored, store=cache, config=CONFIG).stats.cache_misses == 3
        cache.flush()
        assert engine.blend(stored, store=cache, config=CONFIG).stats.cache_hits == 3
    store.close()
    assert cli_main(["cache", "clear", "--path", str(warmed)]) == 0


# ------------------------------------------------------------------ 5 and 6. eviction and foreign rows
def test_eviction_under_a_size_limit_is_counted_as_eviction_quietly(engine, chunk_ids, tmp_path, caplog):
    with ChunkCache(engine, DiskKVStore(tmp_path / "probe"), storage_dtype="float32") as probe:
        empty = probe.store.volume()  # SQLite's own pages
        per_chunk = probe.warm(chunk_ids[:1]).bytes_written
    head, question = engine.tokenize("Context:\n"), engine.tokenize("Question?")
    with caplog.at_level(logging.INFO), ChunkCache(
        engine, DiskKVStore(tmp_path / "small", size_limit=empty + int(1.5 * per_chunk)), storage_dtype="float32"
    ) as cache:
        for request in range(12):
            chunks = [chunk_ids[request % 3], chunk_ids[(request + 1) % 3]]
            result = engine.blend([FreshSegment(head), *map(StoredSegment, chunks), FreshSegment(question)],
                                  store=cache, config=CONFIG)
            assert torch.isfinite(result.logits).all()
            cache.flush()
        stats = cache.stats()
    assert stats.corrupt == 0 and stats.evictions > 0
    assert not [r for r in caplog.records if "corrupt" in r.message]


def test_a_pickled_row_at_the_oldest_position_does_not_stop_eviction(engine, chunk_ids, tmp_path):
    path = tmp_path / "kv"
    write_as_another_program(path, "m:" + "ab" * 32, {"a": "pickle"}, "ab" * 32)  # the oldest row
    with ChunkCache(engine, DiskKVStore(tmp_path / "probe"), storage_dtype="float32") as probe:
        empty = probe.store.volume()
        per_chunk = probe.warm(chunk_ids[:1]).bytes_written
    limit = empty + 2 * per_chunk
    with ChunkCache(engine, DiskKVStore(path, size_limit=limit), storage_dtype="float32") as cache:
        for ids in chunk_ids * 2:
            cache.warm([ids + ids[:1]])  # a new chunk each time
            cache.warm([ids])
        assert cache.store.volume() <= limit + 2 * per_chunk
        assert not index_rows(path, "key = 'm:" + "ab" * 32 + "'")


# ------------------------------------------------------------------ 7. bad input names what is wrong
def test_a_token_id_outside_the_vocabulary_names_the_id_and_the_vocabulary(engine):
    vocab = engine.model.config.vocab_size
    with pytest.raises(BlendInputError, match=rf"token id {vocab + 5}, outside the model's vocabulary of {vocab}"):
        engine.blend([[1, 2, vocab + 5]])
    with pytest.raises(BlendInputError, match=r"token id -1"):
        engine.prefill_chunk([3, -1, 4])
    with pytest.raises(BlendInputError, match=r"outside the model's vocabulary"):
        engine.full_prefill([vocab])


def test_float_token_ids_are_refused_not_truncated(engine):
    with pytest.raises(BlendInputError, match=r"token ids\[1\] is 2.7 \(float\); token ids are integers"):
        engine.blend([FreshSegment([1, 2.7, 3])])
    with pytest.raises(BlendInputError, match=r"is True \(bool\)"):
        StoredSegment([1, True])
    with pytest.raises(BlendInputError, match=r"float"):
        engine.blend([torch.tensor([1.0, 2.0])])
    assert FreshSegment(torch.tensor([1, 2]).tolist()).token_ids == (1, 2)
    import numpy as np

    assert FreshSegment(np.array([3, 4])).token_ids == (3, 4)


@pytest.mark.parametrize("url", ["redis://:pw@localhost:65536", "redis://localhost:0/0", "redis://host:port/0",
                                 "redis://localhost:6379/zero"])
def test_a_bad_redis_url_is_a_config_error(url):
    from cacheblend_rag.errors import ConfigError
    from cacheblend_rag.store.backends.redis_store import RedisKVStore

    with pytest.raises(ConfigError, match="Redis URL"):
        RedisKVStore(url, check_connection=False)
