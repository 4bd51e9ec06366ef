"""Fixtures of langchain-cacheblend's tests. Tiny random models make most tests fast; the SmolLM2 test is slow."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache)."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained()
