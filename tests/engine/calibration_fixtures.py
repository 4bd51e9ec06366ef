"""Fixtures the calibration tests share: one thread, a calibration folder of the test's own, a tiny engine, three
demo prompts and one calibration's measurements in a state file (import them into a test module to use them)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.calibration.measure import calibrate
from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt
from cacheblend_rag.data import load_demo_corpus, load_demo_questions
from cacheblend_rag.calibration.lookup import CALIBRATION_DIR_ENV
from cacheblend_rag.testing import tiny_engine

CANDIDATES = "kv_deviation@0.1,kv_deviation@0.5,kv_deviation@1.0,query_profiled+prefix@0.15"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _own_calibration_dir(tmp_path, monkeypatch):
    # Never the user's ~/.cache: a test's engine must not find (or leave) a real calibration.
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path / "calibration"))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def prompts(engine):
    docs, questions = load_demo_corpus(), load_demo_questions()
    return [build_prompt(engine.tokenizer, MusiqueExample(q.question, [q.answer],
                                                          [(d.title, d.text) for d in docs[i:i + 3]]),
                         passages=3, max_passage_tokens=40) for i, q in enumerate(questions[:3])]


@pytest.fixture(scope="module")
def measured(engine, prompts, tmp_path_factory):
    """One calibration's measurements, in a state file the tests calibrate from again (no new work)."""
    state = tmp_path_factory.mktemp("state") / "state.json"
    result = calibrate(engine, prompts, CANDIDATES, progress=False, state_path=state, resume=False)
    return result, state
