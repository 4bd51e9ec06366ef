"""``make gpu-check`` (benchmarks/gpu_check.py): it says so and exits 0 without CUDA, and every step
works, checked on tiny models on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_zero():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "CUDA is not available here" in done.stdout


@pytest.mark.slow
def test_every_step_runs_on_tiny_models_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| model | dtype | prompt tokens | full prefill |" in done.stdout
    import json

    report = json.loads(out.read_text())
    assert report["invariant_tests"]["passed"] and report["gate"]["passed"] and report["store_round_trip"]["passed"]
    assert [row["model"] for row in report["ttft"]][0] == "tiny Llama (smoke)"
    assert all(row["full prefill"] > 0 and row["default@0.15 (disk)"] > 0 for row in report["ttft"])
