"""What the benchmark tests (tests/bench) and the research tests (research/tests) share: one torch thread, a script
of benchmarks/ or research/ imported by name, and a tiny MuSiQue-format file for the chat scripts.

Each folder's conftest.py imports the fixtures it needs from here (tests/ is no package: research/tests/conftest.py
puts this folder on ``sys.path``, as tests/conftest.py does for tests/store_redis)."""

from __future__ import annotations

import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable, ContextManager, Iterator

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models are dominated by thread hand-off; on a shared 2-core machine several threads
    # make these tests 30x slower, not faster.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def script_importer(folder: Path) -> Callable[[str], ContextManager[ModuleType]]:
    """``with importer("bench_decode") as module:``: a script of ``folder``, imported by name (scripts import each
    other by name, as python puts a script's folder first on ``sys.path``). Afterwards ``sys.path`` is as it was and
    every module loaded from a folder put on it (``folder``, or one the script added itself) is forgotten."""

    @contextmanager
    def importer(name: str) -> Iterator[ModuleType]:
        path_before, modules_before = list(sys.path), set(sys.modules)
        sys.path.insert(0, str(folder))
        try:
            yield importlib.import_module(name)
        finally:
            added = {str(folder)} | {p for p in sys.path if p not in path_before}
            sys.path[:] = path_before
            for loaded in set(sys.modules) - modules_before:
                if any((getattr(sys.modules[loaded], "__file__", None) or "").startswith(p) for p in added):
                    sys.modules.pop(loaded, None)

    return importer


# Five questions, each with its own passage and the previous question's, for the chat scripts of issue 31.
CHAT_QUESTIONS = [
    ("What is the capital of France?", ["Paris"], "France", "Paris is the capital of France. The Seine flows there."),
    ("Where does the Amazon flow into?", ["Atlantic"], "Amazon", "The Amazon river flows into the Atlantic Ocean."),
    ("Who won two Nobel prizes?", ["Marie Curie"], "Curie", "Marie Curie won two Nobel prizes in Warsaw and Paris."),
    ("What does the quick fox jump over?", ["the lazy dog"], "Fox", "The quick brown fox jumps over the lazy dog."),
    ("Where was Marie Curie born?", ["Warsaw"], "Warsaw", "Marie Curie was born in Warsaw, the capital of Poland."),
]


@pytest.fixture
def chat_musique(tmp_path) -> Path:
    """:data:`CHAT_QUESTIONS` as a MuSiQue-format file."""
    data = [{"question": q, "answers": a, "ctxs": [{"title": t, "text": x},
                                                   {"title": "", "text": CHAT_QUESTIONS[i - 1][3]}]}
            for i, (q, a, t, x) in enumerate(CHAT_QUESTIONS)]
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(data))
    return path
