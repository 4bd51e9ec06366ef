"""benchmarks/bench_dispatch.py: the operations a blend dispatches (a GPU's launches), counted on the CPU."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment


@pytest.fixture(scope="module")
def bench(script_module):
    with script_module("bench_dispatch") as module:
        yield module


def _count(bench, chunks: int, layers: int, config: BlendConfig) -> int:
    gpu_check = bench.gpu_check
    engine = gpu_check.random_model("llama", {**gpu_check.TINY_SHAPE, "num_hidden_layers": layers}, "tiny",
                                    torch.device("cpu"), torch.float32, smoke=False)
    prompt = gpu_check.random_prompt(512, chunks, 240 // chunks, seed=1)
    segments = [FreshSegment(prompt.head), *map(CachedSegment, engine.prefill_chunks(prompt.chunks)),
                FreshSegment(prompt.tail)]
    return bench.dispatched(lambda: engine.blend(segments, config=config))[0]


@pytest.mark.parametrize("ratio", [0.0, 0.15])
def test_a_blend_dispatches_no_operation_per_chunk_and_layer(bench, ratio):
    """The same 240 cached tokens as 3 or 12 chunks: what the nine more chunks add (the layout's few operations
    per segment) is the same on 2 layers as on 6, so no layer dispatches anything per chunk (a layer's chunks
    are written with one concatenation each for K and V)."""
    config = BlendConfig(recompute_ratio=ratio, selection="kv_deviation")
    added = {layers: _count(bench, 12, layers, config) - _count(bench, 3, layers, config) for layers in (2, 6)}
    assert added[2] == added[6], added


def test_the_benchmark_prints_counts_for_both_shapes(bench, monkeypatch, capsys):
    narrow = {"num_hidden_layers": 2}
    monkeypatch.setattr(bench, "SHAPES", {name: (arch, {**fields, **narrow})
                                          for name, (arch, fields) in bench.SHAPES.items()})
    from cacheblend_rag.engine import attention

    rule = attention.rows_per_group
    assert bench.main(["--chunks", "2", "--chunk-tokens", "20"]) == 0
    assert attention.rows_per_group is rule  # counted as on a GPU, then put back
    import json

    report = json.loads(capsys.readouterr().out)
    for row in report["rows"].values():
        assert row["full prefill"] > 0 and all(row[m] > 0 for m in bench.METHODS)
        assert set(row["host syncs"]) == {"full prefill", *bench.METHODS}
        assert all(count <= bench.MAX_SYNCS for count in row["host syncs"].values())
        assert isinstance(row["targets met"], bool)
