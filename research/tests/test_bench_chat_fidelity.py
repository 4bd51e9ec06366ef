"""research/bench_chat_fidelity.py on a tiny engine: benchmarks/bench_chat.py's conversation for one setting of
prefix+blending, each turn's KL and token counts."""

from __future__ import annotations

import json


def test_bench_chat_fidelity_gives_each_turn_its_kl_and_tokens_for_a_setting(chat_musique, tmp_path, monkeypatch,
                                                                              capsys, research_module):
    with research_module("bench_chat_fidelity") as fidelity:
        monkeypatch.setattr(fidelity.bc, "SYSTEM_PROMPT", "Answer from the passages in a few words.")  # bench_chat
        common = ["--model", "tiny-llama", "--data", str(chat_musique), "--turns", "3", "--passages", "2",
                  "--max-passage-tokens", "24", "--max-new-tokens", "4", "--teacher-tokens", "3"]
        out = tmp_path / "rows.jsonl"
        rows = {}
        for factor in (1.0, 3.0):
            options = json.dumps({"approximate_prefix_chunk_factor": factor, "min_blend_tokens": 0})
            rows[factor] = fidelity.run(fidelity.parse_args([*common, "--options", options, "--out", str(out)]))
        refreshed = fidelity.run(fidelity.parse_args([*common, "--refresh", "--options", '{"min_blend_tokens": 0}']))
    assert len(out.read_text().splitlines()) == 6
    for _factor, turns in rows.items():
        assert [r["turn"] for r in turns] == [1, 2, 3] and all(r["kl"] >= 0 for r in turns)
        assert all(r["approximate_prefix_tokens"] > 0 for r in turns[1:]), turns
    # Behind the approximate history the new passages take three times the share; turn 1 has none.
    assert rows[3.0][0]["recomputed_tokens"] == rows[1.0][0]["recomputed_tokens"]
    assert all(b["recomputed_tokens"] > a["recomputed_tokens"] for a, b in zip(rows[1.0][1:], rows[3.0][1:]))
    assert all(r["approximate_prefix_tokens"] == 0 and r["exact_tokens"] > 0 for r in refreshed[1:]), refreshed
    capsys.readouterr()
