"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from cacheblend_rag.kv.segments import CachedSegment, FreshSegment
from cacheblend_rag.testing import tiny_engine


@pytest.fixture(scope="module")
def passages_prompt():
    """A tiny Qwen2 engine and a prompt maker: a fresh lead, each text one cached chunk, a fresh question."""
    engine = tiny_engine("qwen2")

    def segments(texts: list[str]) -> list:
        chunks = engine.prefill_chunks([engine.tokenize(t) for t in texts])
        return [FreshSegment(engine.tokenize("Passages:\n")), *map(CachedSegment, chunks),
                FreshSegment(engine.tokenize("Question: who won two Nobel prizes?"))]

    return engine, segments
