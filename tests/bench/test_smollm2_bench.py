"""The harness on real SmolLM2 weights and real MuSiQue questions (slow)."""

from __future__ import annotations

import pytest

from cacheblend_rag.bench import BenchConfig, run_benchmark


@pytest.mark.slow
def test_smollm2_two_questions(smollm2_engine, musique_path):
    config = BenchConfig(
        data=str(musique_path), n=2, passages=3, max_passage_tokens=60, ratios="0.15,1.0",
        methods="full_prefill,prefix_caching,full_reuse,cacheblend", prefix_conditioned="both",
        max_new_tokens=16, throughput_requests=1, throughput_new_tokens=4, show_progress=False,
        # No cold pass: nothing here asserts on it, and tests/bench/test_harness.py checks it on a tiny
        # model (it recomputes every chunk of every method: a fifth of this test's time).
        cold_examples=0,
    )
    document = run_benchmark(config, engine=smollm2_engine)
    methods = {m["name"]: m for m in document["methods"]}
    # Exact methods agree with full prefill up to float error (and 16-bit storage for the blends).
    assert methods["prefix_caching"]["quality"]["kl"] < 1e-4
    assert methods["prefix_caching"]["quality"]["top1"] == 1.0
    assert methods["cacheblend@1"]["quality"]["kl"] < 1e-3
    assert methods["full_reuse"]["quality"]["kl"] > methods["cacheblend@1"]["quality"]["kl"]
    for m in document["methods"]:
        assert m["ttft_s"]["median"] > 0 and m["quality"]["f1"] is not None
