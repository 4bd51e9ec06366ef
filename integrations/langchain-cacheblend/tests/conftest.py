"""Fixtures of langchain-cacheblend's tests. Tiny random models make most tests fast; the SmolLM2 test is slow."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache). Test prompts are
    shorter than the engine's ``min_blend_tokens``: they must blend, not fall back to full prefill."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(min_blend_tokens=0)
