"""The research loop's whole-chunk selectors (research/fidelity_explore.py, research/quality_notebook.md "Whole
chunks"): they recompute whole chunks first, the most read (or the last), and spend what is left of the budget on
single tokens outside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import pytest

from cacheblend_rag.engine import selection
from cacheblend_rag.engine.selection import SelectionContext

RESEARCH = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def research():
    """The research module, imported for one test: importing it registers its strategies, which the
    engine's own tests (parametrised over every registered strategy) must not see."""
    registry = dict(selection._REGISTRY)
    sys.path.insert(0, RESEARCH)
    try:
        import fidelity_explore
        yield fidelity_explore
    finally:
        sys.path.remove(RESEARCH)
        sys.modules.pop("fidelity_explore", None)
        selection._REGISTRY.clear()
        selection._REGISTRY.update(registry)


def _context(budget: int) -> SelectionContext:
    # Three chunks of 4 tokens; the question reads the middle one most (its first token, a sink, aside).
    attention = torch.tensor([9.0, 0, 0, 0, 0, 1, 1, 1, 0, 0.5, 0, 0])
    fresh_v = torch.zeros(1, 12, 2)
    fresh_v[0, 0] = 5.0  # the most deviating token: in the first chunk
    zeros = torch.zeros(1, 12, 2)
    return SelectionContext(layer=0, budget=budget, fresh_k=zeros, fresh_v=fresh_v, cached_k=zeros, cached_v=zeros,
                            chunk_spans=[(0, 4), (4, 8), (8, 12)], query_attention=lambda: attention)


def test_whole_most_read_chunk_then_tokens_by_attention(research):
    assert research.ChunkFocus().select(_context(5)).tolist() == [0, 4, 5, 6, 7]


def test_whole_most_read_chunk_then_tokens_by_deviation(research):
    assert research.ChunkFocusDeviation().select(_context(5)).tolist() == [0, 4, 5, 6, 7]
    assert research.ChunkFocusDeviation().select(_context(9)).tolist() == [0, 4, 5, 6, 7, 8, 9, 10, 11]


def test_last_chunks_first(research):
    assert research.ChunkLast().select(_context(4)).tolist() == [8, 9, 10, 11]
    assert research.ChunkLast().select(_context(3)).tolist() == [0, 1, 2]  # no whole chunk fits: deviation, ties early


def test_the_placement_table_groups_a_stride_and_ratio_by_probe_offset(research, tmp_path, capsys):
    """``placements`` reads rows of several runs; the engine's own placement (no offset named) is half a stride in."""
    probes = "kv_deviation@0.2;shift_probe_stride=20;stale_key_correction=1;stale_value_correction=1"
    kl = {"full_reuse": [1.0, 1.0], probes: [0.2, 0.4], probes + ";probe_offset=5": [0.6, 1.2],
          probes + ";shift_estimate=clip": [0.1, 0.1]}  # another option: not a placement
    rows = [{"model": "m", "setup": "s", "q": q, "method": method, "kl": values[q]}
            for method, values in kl.items() for q in (0, 1)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    research.main(["placements", str(first), str(second), "--model", "m", "--setup", "s",
                   "--plot", str(tmp_path / "p.png")])
    table = capsys.readouterr().out
    assert "| 0.2 | 20 | 5 | 5: 10% (1), 10: 70% (0) | 40% | 60 points |" in table
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_estimates_table_compares_each_variant_with_the_mean_at_the_same_placements(research, tmp_path, capsys):
    """``estimates``: a variant's recovery at every placement the base has too, and its gain over the base averaged
    over those placements; a variant measured at one placement is compared at that one only."""
    base = "b"
    kl = {"full_reuse": [1.0, 1.0], base: [0.4, 0.4], base + ";probe_offset=2": [0.6, 0.6],
          base + ";k=1": [0.2, 0.2], base + ";k=1;probe_offset=2": [0.6, 0.6], base + ";k=2": [1.2, 0.2]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"model": "m", "setup": "s", "q": q, "method": method, "kl": values[q]}) + "\n"
                            for method, values in kl.items() for q in (0, 1)))
    research.main(["estimates", str(path), "--base", base, "--variants", ",;k=1,;k=2", "--offsets", "2",
                   "--model", "m", "--setup", "s"])
    table = capsys.readouterr().out
    assert "| `(the mean)` | engine: 60% (0), 2: 40% (0) | 50% | +0.0 [+0.0, +0.0] points |" in table
    assert "| `;k=1` | engine: 80% (0), 2: 40% (0) | 60% | +10.0 [+10.0, +10.0] points |" in table
    assert "| `;k=2` | engine: 30% (1) | 30% | -30.0 [" in table


def test_the_windows_table_counts_known_errors_per_window(research, tmp_path, capsys):
    """``windows``: the window oracle fed every ``K``-th stale token's error knows ``window / K`` a window, all of them
    the stale share of it; probes every ``S`` tokens know ``window / S``, by their changes or their exact errors."""
    base = "query_profiled@0.2;x=1"
    probes = "query_profiled@0.2;shift_probe_stride=5;stale_key_correction=1;stale_value_correction=1;shift_window=10"
    kl = {"full_reuse": [1.0, 1.0], f"{base};oracle=kv_shift;oracle_window=10;oracle_sample=5": [0.5, 0.5],
          f"{base};oracle=kv_shift;oracle_window=10": [0.2, 0.2], probes: [1.5, 0.5],
          probes + ";shift_truth=1": [0.4, 0.4], f"{base};oracle=kv_shift": [0.1, 0.1],  # one shift a chunk: not a row
          f"{base};oracle=kv_shift;oracle_window=10;oracle_sample=5/1": [0.3, 0.3]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"model": "m", "setup": "s", "q": q, "method": method, "kl": values[q]}) + "\n"
                            for method, values in kl.items() for q in (0, 1)))
    research.main(["windows", str(path), "--base", base, "--model", "m", "--setup", "s",
                   "--plot", str(tmp_path / "w.png")])
    table = capsys.readouterr().out
    assert "| stale tokens' exact errors (oracle) | 2.0 | 50% | 0/2 |" in table
    assert "| stale tokens' exact errors (oracle, other offsets) | 2.0 | 70% | 0/2 |" in table
    assert "| stale tokens' exact errors (oracle) | 8.0 | 80% | 0/2 |" in table
    assert "| probes' changes in the blend | 2.0 | 0% | 1/2 |" in table
    assert "| probes' exact errors | 2.0 | 60% | 0/2 |" in table
    assert "oracle=kv_shift |" not in table
    assert (tmp_path / "w.png").stat().st_size > 0
