"""research/speed_fidelity.py: quality rows and measured speedups matched by setting, into a table and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def speed_fidelity(research_module):
    with research_module("speed_fidelity") as module:
        yield module


def harness_run(path: Path, methods: list[dict]) -> Path:
    path.write_text(json.dumps({"examples": [{}, {}, {}], "methods": [
        {"name": "full_prefill", "kind": "full_prefill", "quality": {"recovery": 1.0}}, *methods]}))
    return path


def blend(name: str, recovery: float, worse: int, **extra) -> dict:
    return {"name": name, "kind": "blend", "quality": {"recovery": recovery, "recovery_ci95": [recovery - 0.1,
                                                                                           recovery + 0.1],
                                                        "worse_than_full_reuse": worse}, **extra}


def test_settings_match_across_runs_and_the_last_speed_file_wins(speed_fidelity, tmp_path, capsys):
    quality = harness_run(tmp_path / "q.json", [
        blend("query_profiled+prefix@0.15", 0.45, 2),
        blend("default", 0.5, 1, setting="query_profiled+prefix@0.2"),  # a calibrated setting, by its setting
        blend("query_profiled+prefix+probeshift10@0.2", 0.6, 0),
        blend("cacheblend@0.3", 0.4, 1),  # never timed
    ])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": {"full_prefill": {"speedup": 1.0}, "default@0.15": {"speedup": 5.0}}}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"results": {"full_prefill": {"speedup": 1.0}, "default@0.15": {"speedup": 4.8},
                                           "query_profiled@0.2": {"speedup": 4.1},
                                           "query_profiled+probeshift10@0.2": {"speedup": 4.2}}}))
    points, unmatched = speed_fidelity.match([quality], [old, new])
    assert [(p.method, p.speedup, p.worse, p.questions) for p in points] == [
        ("query_profiled+prefix@0.15", 4.8, 2, 3), ("query_profiled+prefix+probeshift10@0.2", 4.2, 0, 3),
        ("query_profiled+prefix@0.2", 4.1, 1, 3)]
    assert unmatched == ["cacheblend@0.3"]
    png = tmp_path / "curve.png"
    assert speed_fidelity.main(["--quality", str(quality), "--speed", str(old), str(new), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "| query_profiled+prefix+probeshift10@0.2 | 4.20x | 60% [50%, 70%] | 0/3 | new.json |" in out
    assert "no measured speed" in out and "cacheblend@0.3" in out
    empty = tmp_path / "empty.json"
    empty.write_text('{"results": {}}')
    with pytest.raises(SystemExit, match="no method has both"):
        speed_fidelity.main(["--quality", str(quality), "--speed", str(empty)])
