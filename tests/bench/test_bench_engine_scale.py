"""benchmarks/bench_engine_scale.py on a tiny engine, and the work bound it reports on known model shapes."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, Qwen2Config

from cacheblend_rag.calibration.bound import LayerShapes, work_bound
from cacheblend_rag.testing import tiny_engine

# The shapes of Qwen2.5-(Coder-)1.5B and SmolLM2-135M, as their configs give them.
QWEN15 = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936)
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)


def test_shapes_match_the_hand_count_in_the_quality_notebook():
    qwen = LayerShapes.of(QWEN15)
    w = qwen.weights()
    assert (qwen.num_layers, qwen.head_dim) == (28, 128)
    assert round(w["q"] / 1e6, 2) == 2.36 and round(w["k"] / 1e6, 2) == 0.39 and round(w["mlp"] / 1e6, 1) == 41.3
    assert round(sum(w.values()) / 1e6, 1) == 46.8
    assert round(qwen.qkv_share, 3) == 0.067
    assert round(LayerShapes.of(SMOLLM2).qkv_share, 3) == 0.156


@pytest.mark.parametrize("config, expected, hand_units", [(QWEN15, 5.25, 5.41), (SMOLLM2, 5.22, 5.81)])
def test_bound_at_3000_tokens_is_5_2x(config, expected, hand_units):
    bound = work_bound(LayerShapes.of(config), prompt_tokens=3000, fresh_tokens=50, ratio=0.15)
    # research/quality_notebook.md's hand count: 5.2x for both. It rounds the recomputed share up (r + fresh / N,
    # where the engine recomputes round(r * cached) + fresh) and the last layer to 0.02 units.
    assert bound["bound"] == pytest.approx(expected, abs=0.01)
    assert abs(bound["units"] - hand_units) < 0.1
    assert abs(config.num_hidden_layers / hand_units - bound["bound"]) < 0.1
    assert bound["units"] == pytest.approx(sum(bound["parts"].values()))
    assert bound["full_prefill_units"] == config.num_hidden_layers


def test_bound_limits_and_the_default_choice_before_layer_zero():
    shapes = LayerShapes.of(QWEN15)
    everything = work_bound(shapes, 3000, 50, 1.0)
    assert 1.0 <= everything["bound"] < 1.05  # recomputing every token saves only the last layer's MLP
    plain = work_bound(shapes, 3000, 50, 0.15)
    default = work_bound(shapes, 3000, 50, 0.15, check_layer=0, profile_tokens=16)
    # No layer runs in full before a choice made up front, so the default's bound is higher.
    assert default["bound"] > plain["bound"] and default["parts"]["early_layers"] == 0
    with pytest.raises(ValueError, match="fresh_tokens"):
        work_bound(shapes, 100, 200, 0.15)
    with pytest.raises(ValueError, match="check_layer"):
        work_bound(shapes, 3000, 50, 0.15, check_layer=27)


@pytest.fixture(scope="module")
def scale_bench(script_module):
    with script_module("bench_engine_scale") as module:
        yield module


@pytest.mark.parametrize("store", ["disk", "memory"])
def test_bench_reports_every_method_with_phases_and_the_bound(scale_bench, tmp_path, store):
    engine = tiny_engine()
    out = tmp_path / "report.json"
    argv = ["--chunks", "2", "--chunk-tokens", "40", "--repeats", "1", "--store", store, "--out", str(out),
            "--no-progress", "--plot", str(tmp_path / "bars.png")]
    assert scale_bench.main(argv, engine=engine) == 0
    assert (tmp_path / "bars.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    assert report["store"] == store and report["chunks"] == 2 and report["interleaved"]
    assert report["prompt_tokens"] == report["fresh_tokens"] + 80
    bound = report["work_bound"]["bound"]
    assert bound > 1 and report["work_bound"]["shapes"]["num_layers"] == engine.num_layers
    results = report["results"]
    assert list(results) == ["full_prefill", "full_reuse", "cacheblend@0.15", "default@0.15"]
    for row in results.values():
        assert row["ttft_s"] > 0 and len(row["runs_s"]) == 1
        assert row["speedup_over_bound"] == pytest.approx(row["speedup"] / bound)
        assert "total" in row["timings_s"]
    assert results["full_prefill"]["speedup"] == 1.0 and results["full_prefill"]["engine_mode"] == ["full_prefill"]
    assert results["full_reuse"]["engine_mode"] == ["full_reuse"]
    for name in ("cacheblend@0.15", "default@0.15"):
        row = results[name]
        assert row["engine_mode"] == ["blend"] and row["own_bound"] > 1
        assert {"profile", "early_layers", "check_layer", "late_layers", "load_wait"} <= set(row["timings_s"])
        assert row["cache_hits"] == 2 and row["cache_misses"] == 0  # every chunk read back, none recomputed
    assert results["default@0.15"]["timings_s"]["profile"] > 0  # the default's profile pass is timed apart
    assert results["cacheblend@0.15"]["own_bound"] == pytest.approx(bound)
    bandwidth = report["load_bandwidth"]
    if store == "memory":
        assert bandwidth is None
    else:  # the loader's cold read of every stored layer, beside the disk's own, from the same run
        assert bandwidth["bytes"] > 0 and bandwidth["loader_MBps"] > 0 and bandwidth["disk_sequential_MBps"] > 0
        assert bandwidth["loader_share_of_disk"] == pytest.approx(
            bandwidth["loader_MBps"] / bandwidth["disk_sequential_MBps"], rel=0.02, abs=1e-3)


def test_any_harness_blend_is_a_method_named_as_the_harness_names_it(scale_bench):
    configs = scale_bench.method_configs(0.15, "query_profiled+prefix+probeshift10@0.2,kv_deviation@0.3,cacheblend")
    assert list(configs) == ["full_prefill", "query_profiled+probeshift10@0.2", "kv_deviation@0.3", "cacheblend@0.15"]
    probes = configs["query_profiled+probeshift10@0.2"]
    assert (probes.recompute_ratio, probes.selection, probes.shift_probe_stride, probes.shift_window) == \
        (0.2, "query_profiled", 10, 100)
    assert probes.min_blend_tokens == 0  # the bench times the blend, never the short-prompt fallback
    for bad, message in [("nonsense@0.2", "unknown method"), ("full_reuse@0.2", "takes no @RATIO"),
                         ("full_prefill+prefix", "reuses no chunk KV"), ("prefix_caching", "no blend")]:
        with pytest.raises(SystemExit, match=message):
            scale_bench.method_configs(0.15, bad)
