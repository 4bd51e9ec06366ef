"""Fixtures for the research scripts' tests: one torch thread and a research/ script by name (from
tests/bench/shared_fixtures.py, shared with the benchmark tests), and a tiny prompt of three chunks. The root
conftest.py (float32, and xdist's scheduling) applies here as everywhere in the repository."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "bench"))
from shared_fixtures import _one_thread, chat_musique, script_importer  # noqa: E402, F401 (fixtures)


@pytest.fixture(scope="session")
def research_module():
    """``with research_module("fidelity_oracle") as module:``, a script of ``research/`` (they import each other by
    name), forgotten afterwards."""
    return script_importer(REPO / "research")


@pytest.fixture(scope="module")
def three_chunk_prompt():
    """A tiny Qwen2 engine, a prompt of a lead, three 24-token chunks and a question, its full prefill, and
    ``blend(config)``: the prompt blended from the chunks' own KV."""
    from cacheblend_rag.testing import tiny_engine

    torch.manual_seed(0)
    engine = tiny_engine("qwen2")
    g = torch.Generator().manual_seed(1)
    lead = torch.randint(10, 200, (4,), generator=g).tolist()
    chunks = [torch.randint(10, 200, (24,), generator=g).tolist() for _ in range(3)]
    question = torch.randint(10, 200, (5,), generator=g).tolist()
    full = engine.full_prefill([*lead, *(t for c in chunks for t in c), *question])

    def blend(config):
        from cacheblend_rag.engine import CachedSegment, FreshSegment

        segments = [lead, *(CachedSegment(engine.prefill_chunk(c)) for c in chunks), FreshSegment(question)]
        return engine.blend(segments, config=config)

    return engine, lead, chunks, full, blend
