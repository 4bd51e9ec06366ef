"""Shared fixtures. Tiny random models make most tests exact and fast; SmolLM2 tests are marked slow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MUSIQUE_PATH = Path(os.environ.get("CACHEBLEND_MUSIQUE", REPO_ROOT.parent / "shared" / "data" / "musique_dev.json"))


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache)."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained()


@pytest.fixture(scope="session")
def musique_path() -> Path:
    if not MUSIQUE_PATH.exists():
        pytest.skip(f"MuSiQue data not found at {MUSIQUE_PATH}; set CACHEBLEND_MUSIQUE")
    return MUSIQUE_PATH
