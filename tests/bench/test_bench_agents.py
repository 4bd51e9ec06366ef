"""benchmarks/bench_agents.py on the tiny model: every way runs the task, the table has each way's rates, and a
second run with ``--resume`` reads the finished runs back instead of running them again."""

from __future__ import annotations

import json


def test_every_way_runs_and_a_resumed_run_keeps_what_was_done(musique_file, tmp_path, capsys, script_module):
    resume, out = tmp_path / "runs.jsonl", tmp_path / "agents.json"
    args = ["--model", "tiny-llama", "--data", str(musique_file), "--runs", "1", "--k", "2", "--max-tokens", "6",
            "--max-steps", "2", "--resume", str(resume), "--out", str(out)]
    with script_module("bench_agents") as bench:
        assert bench.main(args) == 0
        document = json.loads(capsys.readouterr().out)
        assert json.loads(out.read_text()) == document and document["machine"]["cpu"]
        assert list(document["table"]) == list(bench.WAYS)
        for row in document["table"].values():
            assert row["runs"] == 1 and 0 <= row["called_the_tool"] <= 1 and 0 <= row["answer_holds_gold"] <= 1
        assert len(resume.read_text().splitlines()) == len(bench.WAYS)
        assert bench.main(args) == 0  # every run read back: none appended
        assert len(resume.read_text().splitlines()) == len(bench.WAYS)
        assert json.loads(capsys.readouterr().out)["table"] == document["table"]


def test_gold_is_found_after_normalization_and_calculate_is_safe(script_module):
    with script_module("bench_agents") as bench:
        assert bench.holds_gold("It was the Exeter College, in Oxford.", ["exeter college"])
        assert not bench.holds_gold("Exeterville", ["Exeter"])
        assert bench.calculate("(3 + 4) * 2") == "14" and "cannot evaluate" in bench.calculate("__import__('os')")
