"""The soak through the Ray app (benchmarks/soak_replicas.py) for one minute on two tiny-model replicas: soak_faults'
Redis faults and burst, plus one replica killed with SIGKILL and replaced by Ray, and every invariant holds: no hangs,
no answer lost but the killed replica's in-flight ones, every error clear, each replica's RSS flat idle to idle. Its
plan, which costs nothing, is checked without Ray."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from shared_fixtures import REPO

SCRIPT = REPO / "benchmarks" / "soak_replicas.py"
FAULTS = {"redis_sigstop", "redis_restart", "flushall", "burst", "replica_kill"}
KEYS = {"settings", "machine", "traffic", "serve", "faults_left_out", "schedule", "warmup_end_s", "replica_kill",
        "phases", "totals", "healthy_ttft_p99_s", "replicas_seen", "chunk_tiers", "failures", "rss",
        "fault_injection_errors", "samples", "invariants", "passed", "requests"}


def test_the_plan_keeps_the_redis_faults_and_kills_a_replica_in_the_first_slot_left_free(script_module):
    with script_module("soak_replicas") as soak_replicas:
        warmup, phases = soak_replicas.plan(1, seed=3)
        again = soak_replicas.plan(1, seed=3)[1]
        full = soak_replicas.schedule(1, seed=3)[1]
        kept, left_out = soak_replicas.KEPT, set(soak_replicas.LEFT_OUT)
    assert {p.name for p in phases} == FAULTS and warmup >= 8
    assert [(p.name, p.planned_at) for p in phases] == [(p.name, p.planned_at) for p in again]
    assert [p.planned_at for p in phases] == sorted(p.planned_at for p in phases)
    assert {p.name for p in full} == set(kept) | left_out
    kill = next(p for p in phases if p.name == "replica_kill")
    assert kill.planned_at == min(p.planned_at for p in full if p.name in left_out)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)")
def test_a_one_minute_soak_through_two_tiny_replicas_holds_every_invariant(tmp_path):
    pytest.importorskip("ray.serve")
    out = tmp_path / "soak_replicas.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "1", "--model", "tiny-llama", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    failed = {name: what for name, (ok, what) in report["invariants"].items() if not ok}
    assert done.returncode == 0 and not failed, (failed, done.stderr[-3000:])
    assert KEYS <= set(report), KEYS - set(report)
    assert {p["name"] for p in report["schedule"]} == FAULTS and not report["fault_injection_errors"]
    assert all(p["began"] is not None and p["cleared"] is not None for p in report["schedule"])
    kill = report["replica_kill"]
    assert kill["replacement_pid"] not in (None, kill["victim_pid"])
    assert kill["killed_replica_id"] in kill["ids_before_kill"] and kill["killed_replica_id"] not in kill["survivor_ids"]
    assert set(report["failures"]) == {"in_flight_at_kill", "sent_to_it_before_ray_saw_it_gone",
                                       "clear_during_redis_fault", "unexplained"}
    totals = report["totals"]
    assert totals["answers"] >= 30 and totals["cancelled_on_purpose"] >= 1 and totals["hangs"] == 0
    assert len(report["replicas_seen"]) >= 2 and sum(report["chunk_tiers"].values()) > 0
    roles = {r["role"]: r for r in report["rss"]["replicas"]}
    assert {"original", "killed", "replacement"} <= set(roles) and roles["original"]["growth"] is not None
    assert report["serve"]["exit_code"] == 0 and report["serve"]["processes_left"] == 0
    assert out.with_suffix(".png").stat().st_size > 10_000
