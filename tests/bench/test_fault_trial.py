"""The fault trial of docs/operations.md (benchmarks/fault_trial.py): every fault but the one it is there to
show (a forged entry in a store without a key) is survived, and the file planted outside the store is never
touched.

The trial runs whole, every group and every case, on a tiny random model (``--model tiny-llama``, seeded, so
the child that is killed mid-warm builds the same weights) and shorter passages than the published run on the
embedded model (16-token chunks instead of 120, load passages of 48 tokens, answers of 3 tokens: the first from
the blend's logits, which are compared in full, and two decoded from the blended KV). What a case checks is the
store's and the engine's handling of damage, which does not depend on the weights, a chunk's length or an
answer's: on SmolLM2 the same run took 131 s of the suite, on the tiny model ~30 s.
"""

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
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--model", "tiny-llama", "--chunk-tokens",
                           "16", "--load-tokens", "48", "--answer-tokens", "3"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # Nothing of the trial is left out by the shorter passages.
    assert set(report["results"]) == GROUPS
    for group, names in _store_faults().items():
        assert [row["fault"] for row in report["results"][group]] == names
    assert report["total"]["tried"] == 43 and report["chunk_tokens"] == [16] * 4 and report["answer_tokens"] == 3
    assert report["model"] == "tiny-llama"
    lost = [row["fault"] for rows in report["results"].values() for row in rows if not row["survived"]]
    assert lost == ["forged layer, store without a key"]
    assert report["outside_file_intact"]
    assert all(row["outside_file_intact"] for rows in report["results"].values() for row in rows)
