"""Fixtures of langchain-cacheblend's tests. Tiny random models make most tests fast; the SmolLM2 test is slow.
``cacheblend_server``: the real server's app on uvicorn in a thread, one per test module that uses it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache). Test prompts are
    shorter than the engine's ``min_blend_tokens``: they must blend, not fall back to full prefill."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(min_blend_tokens=0)


@dataclass
class RunningServer:
    """A ``cacheblend-rag serve`` app of the tiny Qwen2 answering at ``base_url``, which takes ``api_key`` only."""

    base_url: str
    api_key: str


@pytest.fixture(scope="module")
def cacheblend_server() -> Iterator[RunningServer]:
    """The server's app of the tiny Qwen2 with an in-memory store and an API key, on uvicorn in a thread of this
    process (``cacheblend_rag.server.testing.running_server``), once per module, stopped by its own shutdown call."""
    pytest.importorskip("fastapi", reason="the server needs cacheblend-rag's [server] extra")
    pytest.importorskip("uvicorn", reason="the server needs cacheblend-rag's [server] extra")
    from cacheblend_rag.server.testing import running_server

    api_key = f"test-{uuid.uuid4().hex}"
    with running_server("tiny-qwen2", api_key=api_key) as server:
        yield RunningServer(server.url, api_key)


def pytest_collection_modifyitems(config, items) -> None:
    """A test class with ``runs_only`` (test function names) runs only those of the suite it inherits (LangChain's
    standard suites have no such switch); the rest are deselected, as ``-k`` would, and counted as deselected."""
    kept, dropped = [], []
    for item in items:
        only = getattr(getattr(item, "cls", None), "runs_only", None)
        (dropped if only is not None and item.originalname not in only else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
