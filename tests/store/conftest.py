"""Fixtures of the store tests: one tiny engine, a few chunk texts, a question."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendConfig, FreshSegment, StoredSegment

from kvstore_samples import QUESTION, TEXTS  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine(config=BlendConfig(recompute_ratio=0.25, check_layer=1))


@pytest.fixture(scope="session")
def chunk_ids(engine) -> list[list[int]]:
    return [engine.tokenize(t) for t in TEXTS]


@pytest.fixture(scope="session")
def question_ids(engine) -> list[int]:
    return engine.tokenize(QUESTION)


@pytest.fixture
def stored_prompt(engine, chunk_ids, question_ids):
    """Segments of a prompt whose chunks come from a store, and the same prompt with in-memory chunk KV."""
    head = FreshSegment(engine.tokenize("Context:\n"))
    stored = [head, *(StoredSegment(ids) for ids in chunk_ids), FreshSegment(question_ids)]
    in_memory = [head, *engine.prefill_chunks(chunk_ids), FreshSegment(question_ids)]
    return stored, in_memory
