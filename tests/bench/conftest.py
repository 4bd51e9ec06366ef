"""Fixtures for the benchmark harness tests: tiny engine, two tiny MuSiQue-format questions."""

from __future__ import annotations

import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import torch

TINY_MUSIQUE = [
    {
        "question": "What is the capital of France?",
        "answers": ["Paris"],
        "ctxs": [
            {"title": "France", "text": "Paris is the capital of France. The quick brown fox jumps over the lazy dog."},
            {"title": "Amazon", "text": "The Amazon river flows through Brazil, Peru and Colombia."},
            {"title": "", "text": "Marie Curie was a physicist and chemist."},
        ],
    },
    {
        "question": "Where does the Amazon flow into?",
        "answers": ["the Atlantic Ocean", "Atlantic"],
        "ctxs": [
            {"title": "Amazon", "text": "The Amazon river flows into the Atlantic Ocean."},
            {"title": "Curie", "text": "Marie Curie won two Nobel prizes in Warsaw and Paris."},
            {"title": "Fox", "text": "The quick brown fox jumps over the lazy dog."},
        ],
    },
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models are dominated by thread hand-off; on a shared 2-core machine several threads
    # make these tests 30x slower, not faster.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def musique_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "musique_tiny.json"
    path.write_text(json.dumps(TINY_MUSIQUE), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine("llama")


BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


@contextmanager
def _research_module(name: str) -> Iterator[ModuleType]:
    sys.path.insert(0, BENCHMARKS)
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)
        for loaded in [m for m, module in sys.modules.items()
                       if (getattr(module, "__file__", None) or "").startswith(BENCHMARKS)]:
            sys.modules.pop(loaded, None)


@pytest.fixture(scope="session")
def research_module():
    """``with research_module("fidelity_oracle") as module:``, a research module of ``benchmarks/`` (they import
    each other by name), forgotten afterwards."""
    return _research_module


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
