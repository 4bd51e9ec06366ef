"""The soak of docs/operations.md ("Soak", benchmarks/soak.py) for 60 seconds: 16 clients through LangChain and
LlamaIndex on the tiny random Llama (``--model tiny-llama``: what the invariants judge, the store's and the engine's
handling of faults, does not depend on the weights; on SmolLM2 this test took 134 s of the suite's CPU, on the tiny
model 34 s; the published 10-minute soak runs SmolLM2) while every fault of the schedule runs once (shorter than in the 10-minute soak), and every
invariant but the timing one holds: no hangs, the control stream's answers at ratio 1.0 equal full prefill's, every
error a clear one, no healthy entry lost, the counter identity, RSS growth under 5% from a lull after the warm-up to
the end (each read with nothing running), open files and threads flat. The recovery-time invariant (p99 back within 20% of healthy within 5 s) is left out (``--no-timing``):
a minute leaves a few seconds after each fault and the test machine is shared. The schedule's pieces, which cost
nothing, are checked without a model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from shared_fixtures import REPO

RSS_GROWTH_LIMIT = 0.05  # benchmarks/soak_report.py's bound for the ten-minute soak

SCRIPT = REPO / "benchmarks" / "soak.py"
FAULTS = {"redis_sigstop", "redis_restart", "flushall", "disk_full", "rogue_writer", "warm_job_killed", "burst"}


def test_the_schedule_is_seeded_and_runs_every_fault_even_in_a_minute(script_module):
    with script_module("soak_faults") as soak_faults:
        warmup, phases = soak_faults.schedule(1, seed=3)
        again = soak_faults.schedule(1, seed=3)[1]
        other = soak_faults.schedule(1, seed=4)[1]
        ten = soak_faults.schedule(10, seed=3)[1]
        with pytest.raises(SystemExit, match="too short"):
            soak_faults.schedule(0.5, seed=3)
    assert {p.name for p in phases} == FAULTS and warmup >= 8
    assert [(p.name, p.planned_at) for p in phases] == [(p.name, p.planned_at) for p in again]
    assert [p.name for p in phases] != [p.name for p in other]
    starts = [p.planned_at for p in phases]
    assert starts == sorted(starts) and starts[-1] + phases[-1].planned_s < 60
    lasting = {p.name: p.planned_s for p in ten}
    assert lasting["redis_sigstop"] == 5 and lasting["disk_full"] == 30 and lasting["burst"] == 30


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)")
def test_a_one_minute_soak_holds_every_invariant_but_timing(tmp_path):
    out = tmp_path / "soak.json"
    # A smaller corpus than the ten-minute soak's (6 questions of 3 passages of 48 tokens, 3 control candidates):
    # its precomputing and the control answers cost ~50 s of SmolLM2 at one thread at the defaults, ~15 s so, and
    # no check depends on a passage's length or on how many questions there are.
    done = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "1", "--no-timing", "--threads", "1",
                           "--questions", "6", "--passage-tokens", "48", "--control-prompts", "3",
                           "--model", "tiny-llama", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    report = json.loads(out.read_text())
    assert report["settings"]["model"] == "tiny-llama"
    assert {p["name"] for p in report["schedule"]} == FAULTS and not report["fault_injection_errors"]
    assert all(p["began"] is not None and p["cleared"] is not None for p in report["schedule"])
    totals = report["totals"]
    # Answers in the minute: 30 and more alone; 22 in CI with the other worker running Ray's replicas beside it.
    assert totals["answers"] >= 12 and totals["cancelled_on_purpose"] >= 1 and totals["control_compared"] >= 1
    kinds = {(r["framework"], r["mode"], r["kind"]) for r in report["requests"] if r["outcome"] == "answer"}
    assert {f for f, _, _ in kinds} == {"langchain", "llamaindex"} and {"chat", "miss", "rag"} <= {k for *_, k in kinds}
    assert report["identity"]["blends_observed"] > 0 and report["healthy_entries"]["before"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    table = subprocess.run([sys.executable, str(SCRIPT), "--table", str(out)], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout
    assert table.count("\n| ") == 1 + len(FAULTS)  # a row for the warm-up and one for each fault
    # RSS is read idle to idle (a lull after the warm-up, and after the traffic stops): a 1-minute run on a 2-core
    # AMD EPYC in float32 grew +2.1% so (1,263 to 1,290 MB) while its busy medians said +8.6% and RSS ranged over
    # 1.26-1.51 GB with the blends in flight; the busy figures are reported, not judged.
    failed = {name: what for name, (ok, what) in report["invariants"].items() if not ok}
    assert not failed and done.returncode == 0, (failed, report["rss_growth_by_mapping_mb"], done.stderr[-3000:])
    resources = report["resources"]
    assert resources["rss_settled"]["warmup"]["idle"] and resources["rss_settled"]["end"]["idle"]
    assert resources["rss_growth"] < RSS_GROWTH_LIMIT and "rss_busy_growth" in resources
