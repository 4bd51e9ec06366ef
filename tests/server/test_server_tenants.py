"""Tenant isolation through the server (issue 69): a guess of another salt's private prompt gets the stats of a
wrong guess, the chunk store is shared across salts unless ``--chunk-sharing per_salt``, and a response's
``cacheblend`` object holds its own request's counts while the counters over all requests are ``/metrics``'."""

from __future__ import annotations

import uuid

import httpx
import pytest

from cacheblend_rag.cli import build_parser
from cacheblend_rag.server.commands import _config
from cacheblend_rag.server.testing import running_server

# Fields a guesser reads to tell a right guess from a wrong one: how much of the prompt came from a cache.
REUSE_FIELDS = ("mode", "prefix_tokens", "approximate_prefix_tokens", "exact_tokens", "segment_tokens",
                "cache_hits", "cache_misses")
TIMED_FIELDS = {"ttft_s", "total_s", "decode_tokens_per_s", "timings"}


def private(secret: str) -> list[dict]:
    return [{"role": "user", "content": f"My account number is {secret}. " + "Tell me what the statements say "
             "about the payments of this year and the ones still due, one by one. " * 3}]


def chat(server, messages, documents, salt=None) -> dict:
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "documents": documents}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def reuse(response: dict) -> dict:
    stats = response["cacheblend"]
    return {**{k: stats.get(k) for k in REUSE_FIELDS},
            "cached_tokens": response["usage"]["prompt_tokens_details"]["cached_tokens"]}


def test_a_right_guess_under_another_salt_gets_a_wrong_guess_stats(server, unique_documents):
    secret = uuid.uuid4().hex[:12]
    chat(server, private(secret), unique_documents, salt="victim")
    right = chat(server, private(secret), unique_documents, salt="guesser")
    wrong = chat(server, private(uuid.uuid4().hex[:12]), unique_documents, salt="guesser-2")
    assert right["cacheblend"]["prefix_tokens"] == 0 and right["cacheblend"]["segment_tokens"] == 0
    assert reuse(right) == reuse(wrong)
    # The victim's own salt reuses its prompt as before.
    assert chat(server, private(secret), unique_documents, salt="victim")["cacheblend"]["prefix_tokens"] > 0


def test_stats_are_the_request_own_and_the_counters_are_in_metrics(server, unique_documents):
    # A salt of its own: what it caches answers no other test's unsalted request (their first expects none).
    messages, salt = private(uuid.uuid4().hex[:12]), uuid.uuid4().hex
    answers = [chat(server, messages, unique_documents, salt=salt) for _ in range(3)]
    chat(server, private("someone else"), unique_documents, salt="other")
    answers.append(chat(server, messages, unique_documents, salt=salt))
    own = [{k: v for k, v in a["cacheblend"].items() if k not in TIMED_FIELDS} for a in answers[1:]]
    assert own[0] == own[1] == own[2]  # the same request: the same stats, however many came before
    # store_error is this request's own (None, or why its store read failed), not a counter.
    assert not [k for k in own[0] if k.startswith(("prefix_cache_", "segment_cache_", "store_"))
                and k != "store_error"]
    text = httpx.get(f"{server.url}/metrics").text
    assert "cacheblend_prefix_cache_hits_total" in text and "cacheblend_segment_cache_entries" in text


def test_documents_warmed_under_a_salt_are_shared_unless_per_salt(server, unique_documents):
    warm = {"documents": unique_documents[:1], "cache_salt": "warmer"}
    assert httpx.post(f"{server.url}/v1/documents/warm", json=warm).json()["computed"] == 1
    shared = chat(server, [{"role": "user", "content": "What do they say?"}], unique_documents[:1], salt="reader")
    assert shared["cacheblend"]["cache_hits"] == 1
    with running_server("tiny-llama", chunk_sharing="per_salt", temperature=0) as apart:
        assert httpx.post(f"{apart.url}/v1/documents/warm", json=warm).json()["computed"] == 1
        other = chat(apart, [{"role": "user", "content": "What do they say?"}], unique_documents[:1], salt="reader")
        assert other["cacheblend"]["cache_hits"] == 0 and other["cacheblend"]["cache_misses"] == 1
        own = chat(apart, [{"role": "user", "content": "And else?"}], unique_documents[:1], salt="warmer")
        assert own["cacheblend"]["cache_hits"] == 1


def test_the_serve_flag_sets_chunk_sharing():
    parse = build_parser().parse_args
    assert _config(parse(["serve", "--chunk-sharing", "per_salt"])).settings["chunk_sharing"] == "per_salt"
    assert "chunk_sharing" not in _config(parse(["serve"])).settings
    with pytest.raises(SystemExit):
        parse(["serve", "--chunk-sharing", "everyone"])
