"""benchmarks/bench_decode.py: operations per decoded token, and decode tokens/s against the model's own generate."""

from __future__ import annotations

import pytest

from cacheblend_rag import FreshSegment


@pytest.fixture(scope="module")
def bench(script_module):
    with script_module("bench_decode") as module:
        yield module


def test_operations_per_token_are_counted_per_layer_and_against_the_models_own_step(bench):
    fields = {**bench.SHAPES["SmolLM2-135M"][1], "num_hidden_layers": 2}
    row = bench.decode_ops("llama", fields, prompt_tokens=12)
    assert row["per layer"] <= 29 < row["hf per layer"]
    assert row["per token"] == row["step"] + row["sample"] + row["accept"]
    assert list(row["host syncs per token"].values()) == [1]  # the token's id


def test_decode_speed_times_both_for_the_same_number_of_tokens(bench):
    from cacheblend_rag.testing import tiny_engine

    engine = tiny_engine("llama", seed=2)
    ids = engine.tokenize("Paris is the capital of France. The quick brown fox")
    report = bench.decode_speed(engine, [FreshSegment(ids)], ids, new_tokens=6, rounds=2)
    assert report["new_tokens"] == 6 and len(report["runs"]["engine"]) == len(report["runs"]["hf_generate"]) == 2
    assert report["ratio"] == pytest.approx(report["engine_tokens_per_s"] / report["hf_generate_tokens_per_s"])
    assert report["target_met"] == (report["ratio"] >= 1.0)
