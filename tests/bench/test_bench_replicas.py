"""benchmarks/bench_replicas.py: its arguments and its goals without Ray, and ``--quick`` end to end with Ray's
default router alone (two tiny-model replicas on a real local Ray, the session's Redis): the report's keys,
every request answered, the command's processes gone. The chunk router's path through a real Ray is
tests/server/replicas/test_ray_app.py's and the replicas' soak test's; one router here is one local Ray
start, not two (~65 s of the suite)."""

from __future__ import annotations

import json

import pytest


def test_order_names_one_router_or_both_each_once(script_module):
    with script_module("bench_replicas") as bench:
        assert bench.parse_args(["--order", "default,chunk"]).routers == ["default", "chunk"]
        assert bench.parse_args(["--order", "chunk"]).routers == ["chunk"]
        for bad in ("", "chunk,chunk", "chunk,random"):
            with pytest.raises(SystemExit):
                bench.parse_args(["--order", bad])


def test_the_goals_compare_the_chunk_router_with_the_default(script_module):
    row = {"errors": 0, "warmup_errors": 0}
    with script_module("bench_replicas") as bench:
        goals = bench.goals({"chunk": {**row, "memory_share": 0.45, "ttft_p50_ms": 900.0},
                             "default": {**row, "memory_share": 0.30, "ttft_p50_ms": 1000.0}})
    assert goals == {"memory_share_chunk_over_default": 1.5, "ttft_p50_chunk_over_default": 0.9,
                     "memory_share_at_least_1_5x": True, "ttft_p50_lower": True, "zero_errors": True}


@pytest.mark.slow
def test_quick_run_of_the_default_router_answers_every_request(script_module, redis_url, musique_file, tmp_path):
    pytest.importorskip("ray.serve")
    pytest.importorskip("psutil")
    out, png = tmp_path / "replicas.json", tmp_path / "replicas.png"
    # The tiny file has two questions of three passages: two sets, each of two or three passages.
    argv = ["--quick", "--redis-url", redis_url, "--data", str(musique_file), "--sets", "2", "--min-passages", "2",
            "--max-passages", "3", "--requests", "12", "--warmup", "2", "--clients", "4", "--order", "default",
            "--out", str(out), "--plot", str(png)]
    with script_module("bench_replicas") as bench:
        assert bench.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    assert report["cpu"] and report["torch_threads_per_replica"] >= 1 and "share its cores" in report["note"]
    assert report["config"]["model"] == "tiny-llama" and report["order"] == ["default"]
    assert "flushed before each router" in report["redis"]
    sizing = report["sizing"]
    assert sizing["corpus_chunks"] >= 4 and sizing["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * 4  # tiny-llama, fp32
    assert 0 < sizing["resident_bytes_per_replica"] < sizing["corpus_chunk_bytes"]
    assert set(report["lru_model"]) == {"chunk_memory_share", "default_memory_share", "ratio"}
    assert list(report["routers"]) == ["default"] and report["goals"] is None  # no comparison: nothing judged
    row = report["routers"]["default"]
    assert row["requests"] == 12 and row["errors"] == 0 and row["unsent"] == 0, row
    assert row["warmup_errors"] == 0 and row["exit_code"] == 0 and row["processes_left"] == 0, row
    assert sum(row["per_replica_requests"].values()) == 12
    assert sum(row["chunk_tiers"].values()) > 0
    assert abs(row["memory_share"] + row["store_share"] + row["computed_share"] - 1) < 1e-3
    assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] and row["requests_per_s"] > 0
    assert 0 <= row["repeats_on_first_replica_share"] <= 1
