"""Fixtures for the benchmark harness tests: tiny engine, two tiny MuSiQue-format questions, and (from
shared_fixtures.py, shared with research/tests) one torch thread, benchmarks/ scripts by name and the chat
scripts' MuSiQue file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_fixtures import REPO, _one_thread, chat_musique, script_importer  # noqa: E402, F401 (fixtures)

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


@pytest.fixture(scope="module")
def musique_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "musique_tiny.json"
    path.write_text(json.dumps(TINY_MUSIQUE), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine("llama")


@pytest.fixture(scope="session")
def script_module():
    """``with script_module("bench_decode") as module:``, a script of ``benchmarks/`` (they import each other by
    name), forgotten afterwards."""
    return script_importer(REPO / "benchmarks")
