"""The fault trial of docs/operations.md (benchmarks/fault_trial.py) on the embedded model: every fault but
the one it is there to show (a forged entry in a store without a key) is survived, and the file
planted outside the store is never touched.

The trial runs whole, every group and every case, on shorter passages than the published run
(16-token chunks instead of 120, load passages of 48 tokens instead of whole ones) and shorter answers
(3 tokens instead of 8: the first from the blend's logits, which are compared in full, and two decoded
from the blended KV): what a case checks does not depend on a chunk's or an answer's length, and each
request costs a fraction as much."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "fault_trial.py"
GROUPS = {"values under our keys", "forgery", "index and files", "eviction", "weights", "file systems", "redis",
          "load"}


def _store_faults() -> dict[str, list[str]]:
    """The names of the damaged-store faults the trial defines, by group."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fault_trial
    finally:
        sys.path.remove(str(BENCHMARKS))
    return {"values under our keys": list(fault_trial._value_faults()), "forgery": list(fault_trial._forgery_faults()),
            "index and files": list(fault_trial._index_faults())}


@pytest.mark.slow
def test_every_fault_but_forgery_without_a_key_is_survived(tmp_path):
    out = tmp_path / "trial.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--chunk-tokens", "16",
                           "--load-tokens", "48", "--answer-tokens", "3"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # Nothing of the trial is left out by the shorter passages.
    assert set(report["results"]) == GROUPS
    for group, names in _store_faults().items():
        assert [row["fault"] for row in report["results"][group]] == names
    assert report["total"]["tried"] == 43 and report["chunk_tokens"] == [16] * 4 and report["answer_tokens"] == 3
    lost = [row["fault"] for rows in report["results"].values() for row in rows if not row["survived"]]
    assert lost == ["forged layer, store without a key"]
    assert report["outside_file_intact"]
    assert all(row["outside_file_intact"] for rows in report["results"].values() for row in rows)
