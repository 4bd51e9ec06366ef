"""benchmarks/bench_agentic_rag.py on a tiny engine: the agent loop's three answering calls, their stats, the
fidelity block and the summary the must-show reads."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_bench_agentic_rag_times_the_answering_call_three_ways(musique_file, tmp_path, capsys):
    bench = script("bench_agentic_rag")
    out = tmp_path / "agentic.json"
    assert bench.main(["--model", "tiny-llama", "--data", str(musique_file), "--questions", "1", "--repeats", "2",
                       "--k", "2", "--passage-tokens", "12", "--max-new-tokens", "4", "--teacher-tokens", "3",
                       "--out", str(out)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == document
    assert document["machine"]["cpu"] and set(document["configs"]) == set(bench.CONFIGS)
    (row,) = document["questions"]
    runs = row["runs"]
    assert all(len(runs[name]) == 2 for name in bench.CONFIGS)
    blended, off, full = runs["blended"][0], runs["blending_off"][0], runs["full_prefill"][0]
    # Blended: both passages found in the tool message, the earlier turns from the prefix cache.
    assert blended["chunks_found"] == 2 and blended["prefix_tokens"] > 0
    assert blended["cached_tokens"] - blended["prefix_tokens"] == row["passage_tokens"]
    # Off: the same prefix, no passage recognised; full prefill: nothing reused. One prompt for all three.
    assert off["chunks_found"] == 0 and off["prefix_tokens"] == blended["prefix_tokens"]
    assert full["mode"] == "full_prefill" and full["reused_tokens"] == 0
    assert blended["prompt_tokens"] == off["prompt_tokens"] == full["prompt_tokens"]
    fidelity = row["fidelity"]
    assert {"blend_kl", "full_reuse_kl", "recovery", "blend_top1", "answer_matches_reference"} <= set(fidelity)
    summary = document["summary"]
    assert summary["target_vs_blending_off"] == 3.0 and summary["speedup_vs_blending_off"] > 0
    assert 0.0 <= summary["fidelity"]["answers_identical_to_full_prefill"] <= 1.0
