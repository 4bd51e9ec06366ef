"""Shared fixtures. Tiny random models make most tests exact and fast; SmolLM2 tests are marked slow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MUSIQUE_PATH = Path(os.environ.get("CACHEBLEND_MUSIQUE", REPO_ROOT.parent / "shared" / "data" / "musique_dev.json"))


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache), in float32: its tests hold
    blends to float32's tolerances, whatever dtype the machine's default would be. Test prompts are
    shorter than the engine's ``min_blend_tokens``: they must blend, not fall back to full prefill."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(dtype="float32", min_blend_tokens=0)


@pytest.fixture(scope="session")
def musique_path() -> Path:
    if not MUSIQUE_PATH.exists():
        pytest.skip(f"MuSiQue data not found at {MUSIQUE_PATH}; set CACHEBLEND_MUSIQUE")
    return MUSIQUE_PATH


# --------------------------------------------------------------------------- Redis, for any test
sys.path.insert(0, str(Path(__file__).resolve().parent / "store_redis"))
from conftest_redis import require_redis_server  # noqa: E402
from redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session; tests that kill a server start their own (``fresh_redis_server``)."""
    require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server, emptied for this test."""
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url()


@pytest.fixture
def fresh_redis_server(tmp_path):
    """A server of this test's own, free to be killed and restarted."""
    require_redis_server()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
