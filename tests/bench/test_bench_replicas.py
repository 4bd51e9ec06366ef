"""benchmarks/bench_replicas.py --quick end to end: two tiny-model replicas on a real local Ray, the session's
Redis, the chunk router then Ray's default one on the same requests; the report's keys, every request answered
by both, and the command's processes gone after each. About a minute (a local Ray and two replicas, twice)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("psutil")

pytestmark = pytest.mark.slow


def test_quick_run_compares_both_routers_on_every_request(script_module, redis_url, musique_file, tmp_path):
    out, png = tmp_path / "replicas.json", tmp_path / "replicas.png"
    # The tiny file has two questions of three passages: two sets, each of two or three passages.
    argv = ["--quick", "--redis-url", redis_url, "--data", str(musique_file), "--sets", "2", "--min-passages", "2",
            "--max-passages", "3", "--requests", "12", "--warmup", "2", "--clients", "4", "--out", str(out),
            "--plot", str(png)]
    with script_module("bench_replicas") as bench:
        assert bench.main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    assert report["cpu"] and report["torch_threads_per_replica"] >= 1 and "share its cores" in report["note"]
    assert report["config"]["model"] == "tiny-llama" and report["order"] == ["chunk", "default"]
    assert "flushed before each router" in report["redis"]
    sizing = report["sizing"]
    assert sizing["corpus_chunks"] >= 4 and sizing["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * 4  # tiny-llama, fp32
    assert 0 < sizing["resident_bytes_per_replica"] < sizing["corpus_chunk_bytes"]
    assert set(report["lru_model"]) == {"chunk_memory_share", "default_memory_share", "ratio"}
    for name in ("chunk", "default"):
        row = report["routers"][name]
        assert row["requests"] == 12 and row["errors"] == 0 and row["unsent"] == 0, row
        assert row["warmup_errors"] == 0 and row["exit_code"] == 0 and row["processes_left"] == 0, row
        assert sum(row["per_replica_requests"].values()) == 12
        assert sum(row["chunk_tiers"].values()) > 0
        assert abs(row["memory_share"] + row["store_share"] + row["computed_share"] - 1) < 1e-3
        assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] and row["requests_per_s"] > 0
        assert 0 <= row["repeats_on_first_replica_share"] <= 1
    goals = report["goals"]
    assert set(goals) == {"memory_share_chunk_over_default", "ttft_p50_chunk_over_default",
                          "memory_share_at_least_1_5x", "ttft_p50_lower", "zero_errors"}
    assert goals["zero_errors"] is True
