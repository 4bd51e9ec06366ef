"""A server with a ``replica_id`` names itself in each answer's ``cacheblend`` stats (whole and streamed) and in
``/v1/documents/warm``; one without it adds no such key. Also: the per-request ``chunk_tiers`` in a response."""

from __future__ import annotations

import json

import httpx
import pytest

from cacheblend_rag.server import ServerConfig, ServerThread, create_app

TINY_MODEL = "tiny-llama"  # the model of tests/server/conftest.py's tiny_settings
QUESTION = [{"role": "user", "content": "What do the reports say?"}]


@pytest.fixture(scope="module")
def replica(tiny_settings):
    with ServerThread(create_app(tiny_settings, replica_id="r1")) as running:
        yield running


def whole(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": TINY_MODEL, "messages": QUESTION, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    return response.json()["cacheblend"]


def streamed_usage(server, **body) -> dict:
    """The ``cacheblend`` of the stream's usage chunk (``stream_options.include_usage``)."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": TINY_MODEL, "messages": QUESTION, "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}, **body}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("cacheblend" not in c for c in chunks[:-1])  # only the usage chunk carries the stats
    return chunks[-1]["cacheblend"]


def test_a_replica_names_itself_in_whole_and_streamed_answers(replica, unique_documents):
    assert whole(replica, documents=unique_documents)["replica"] == "r1"
    assert streamed_usage(replica, documents=unique_documents)["replica"] == "r1"
    warmed = httpx.post(f"{replica.url}/v1/documents/warm", json={"documents": unique_documents}).json()
    assert warmed["replica"] == "r1" and warmed["already_stored"] == 3


def test_without_a_replica_id_there_is_no_replica_key(server, unique_documents):
    assert ServerConfig().replica_id is None
    assert "replica" not in whole(server)
    assert "replica" not in streamed_usage(server)
    warmed = httpx.post(f"{server.url}/v1/documents/warm", json={"documents": unique_documents}).json()
    assert warmed == {"object": "documents.warm", "documents": 3, "computed": 3, "already_stored": 0, "failed": 0}


def test_a_response_counts_its_chunks_by_tier(server, unique_documents):
    first = whole(server, documents=unique_documents)
    assert first["chunk_tiers"] == {"memory": 0, "store": 0, "computed": 3}
    tiers = whole(server, documents=unique_documents[::-1])["chunk_tiers"]  # another order: not the prefix cache
    assert tiers["computed"] == 0 and tiers["memory"] + tiers["store"] == 3
