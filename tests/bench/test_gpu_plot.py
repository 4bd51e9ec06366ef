"""benchmarks/gpu_plot.py draws the committed GPU reports (with and without the host-memory tier's rows)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("report", ["gpu_check_h200_run3.json", "gpu_check_h200_run2.json"])
def test_a_committed_report_plots_to_a_png(tmp_path, report):
    out = tmp_path / "speed.png"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_plot.py"),
                           str(REPO / "docs" / "data" / report), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
