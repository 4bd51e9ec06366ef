"""Fixtures for the benchmark harness tests: tiny engine, two tiny MuSiQue-format questions."""

from __future__ import annotations

import json
from pathlib import Path

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
