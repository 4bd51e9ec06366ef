"""The fault trial of the README (benchmarks/fault_trial.py) on the embedded model: every fault but
the one it is there to show (a forged entry in a store without a key) is survived, and the file
planted outside the store is never touched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fault_trial.py"


@pytest.mark.slow
def test_every_fault_but_forgery_without_a_key_is_survived(tmp_path):
    out = tmp_path / "trial.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    lost = [row["fault"] for rows in report["results"].values() for row in rows if not row["survived"]]
    assert lost == ["forged layer, store without a key"]
    assert report["outside_file_intact"]
    assert all(row["outside_file_intact"] for rows in report["results"].values() for row in rows)
