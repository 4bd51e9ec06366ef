"""Fixtures of the HTTP server's tests: a real uvicorn on 127.0.0.1, on a free port, in a thread of the test
process (``cacheblend_rag.server.ServerThread``), stopped by its own shutdown call.

``tiny_settings`` is the tiny-llama model with an in-memory store, loaded once per session (the engine is
shared by every settings object of the process); ``server`` is one server per test module over it. Tests
use document texts of their own (``unique_documents``), so that what one test cached never answers
another's request.
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cacheblend_rag.server import ServerThread, create_app  # noqa: E402

TINY_MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_settings():
    from cacheblend_rag.serving import CacheBlendSettings

    return CacheBlendSettings(model=TINY_MODEL, store_path="memory", temperature=0)


@pytest.fixture(scope="module")
def server(tiny_settings):
    """A running server over ``tiny_settings`` (``server.url``, ``server.base_url`` for OpenAI's clients)."""
    with ServerThread(create_app(tiny_settings)) as running:
        yield running


@pytest.fixture
def unique_documents():
    """Three passages no other test sends (each over the engine's min_blend_tokens, as retrieved passages are)."""
    tag = uuid.uuid4().hex[:8]
    topics = ("the river delta", "the mountain pass", "the harbour town")
    return [{"title": f"{topic} {tag}", "text": f"Report {tag} on {topic}. " + f"The {topic} is described here at "
             f"length, sentence after sentence, with facts about {topic} and its history. " * 4}
            for topic in topics]
