"""Four processes warm overlapping chunk sets into one directory while two others blend from it.

The processes come from a forkserver that has imported torch and transformers once, so each
starts in a moment instead of paying those imports again (as 'spawn' would).
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from cacheblend_rag.store import ChunkCache, DiskKVStore
from kvstore_workers import corpus, reader, writer


def test_concurrent_writers_and_readers_share_one_directory(tmp_path, engine):
    path = str(tmp_path / "kv")
    texts = corpus(12)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.models.llama.modeling_llama",
                                "cacheblend_rag.testing", "cacheblend_rag.store", "kvstore_workers"])
    barrier = ctx.Barrier(6)
    results = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(path, texts[2 * i : 2 * i + 6], barrier, results)) for i in range(4)]
    procs += [ctx.Process(target=reader, args=(path, texts[:10], 4, seed, barrier, results)) for seed in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [o[4] for o in outcomes if o[4]]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs)

    writers = [o for o in outcomes if o[0] == "writer"]
    assert sum(new for _, new, _, _, _ in writers) <= 12 and all(o[3] == 0 for o in writers)
    assert max(o[1] for o in outcomes if o[0] == "reader") < 1e-4  # no torn or mixed reads

    # identical, whole entries at the end: one manifest per chunk, one write's layers, the right values
    store = DiskKVStore(path)
    cache = ChunkCache(engine, store, storage_dtype="float32")
    assert store.stats().entries == 12
    layer_names = [n for n in store._cache.iterkeys() if n.startswith("l:")]
    assert len(layer_names) == 12 * engine.num_layers  # losers removed their layers
    for text in texts:
        ids = engine.tokenize(text)
        loaded = cache.load(ids)
        fresh = engine.prefill_chunk(ids)
        assert loaded is not None
        for a, b in zip(loaded.keys + loaded.values, fresh.keys + fresh.values):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert store.stats().corrupt == 0
