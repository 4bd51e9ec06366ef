"""Fixtures of the store tests: one tiny engine, a few chunk texts, a question."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendConfig, FreshSegment, StoredSegment

TEXTS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2,
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris. " * 2,
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean. " * 2,
]
QUESTION = "Question: What is the capital of France? Answer:"


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
