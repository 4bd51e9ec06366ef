"""The research loop's whole-chunk selectors (benchmarks/fidelity_explore.py, docs/quality.md "Whole chunks"):
they recompute whole chunks first, the most read (or the last), and spend what is left of the budget on
single tokens outside them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from fidelity_explore import ChunkFocus, ChunkFocusDeviation, ChunkLast
finally:
    sys.path.remove(BENCHMARKS)

from cacheblend_rag.engine.selection import SelectionContext


def _context(budget: int) -> SelectionContext:
    # Three chunks of 4 tokens; the question reads the middle one most (its first token, a sink, aside).
    attention = torch.tensor([9.0, 0, 0, 0, 0, 1, 1, 1, 0, 0.5, 0, 0])
    fresh_v = torch.zeros(1, 12, 2)
    fresh_v[0, 0] = 5.0  # the most deviating token: in the first chunk
    zeros = torch.zeros(1, 12, 2)
    return SelectionContext(layer=0, budget=budget, fresh_k=zeros, fresh_v=fresh_v, cached_k=zeros, cached_v=zeros,
                            chunk_spans=[(0, 4), (4, 8), (8, 12)], query_attention=lambda: attention)


def test_whole_most_read_chunk_then_tokens_by_attention():
    assert ChunkFocus().select(_context(5)).tolist() == [0, 4, 5, 6, 7]


def test_whole_most_read_chunk_then_tokens_by_deviation():
    assert ChunkFocusDeviation().select(_context(5)).tolist() == [0, 4, 5, 6, 7]
    assert ChunkFocusDeviation().select(_context(9)).tolist() == [0, 4, 5, 6, 7, 8, 9, 10, 11]


def test_last_chunks_first():
    assert ChunkLast().select(_context(4)).tolist() == [8, 9, 10, 11]
    assert ChunkLast().select(_context(3)).tolist() == [0, 1, 2]  # no whole chunk fits: deviation, ties early
