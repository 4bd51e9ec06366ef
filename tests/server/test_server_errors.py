"""Bad input gets OpenAI's error shape with the right status and the server keeps serving; a client that leaves
frees its slot; the queue, the key, the body bound, timeouts, a store outage and the loading model."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from cacheblend_rag.server import ServerConfig, ServerThread, create_app

TINY_MODEL = "tiny-llama"  # the model of tests/server/conftest.py's tiny_settings
HELLO = [{"role": "user", "content": "Hello"}]
# Generated on and on: the tests that need a request still running stop it themselves.
ENDLESS = {"max_tokens": 3000, "min_tokens": 3000}


def post(server, body, timeout=60, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout, **kwargs)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


BAD_REQUESTS = [
    # (what the body changes, status, param, code, a word of the message)
    ({"model": "gpt-4o"}, 404, "model", "model_not_found", "tiny-llama"),
    ({"n": 2}, 400, "n", None, "one choice"),
    ({"max_tokens": 0}, 400, "max_tokens", None, "at least 1"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens", None, "at least 1"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "max_tokens", None, "disagree"),
    ({"logprobs": True}, 400, "logprobs", None, "log probabilities"),
    ({"top_logprobs": 3}, 400, "top_logprobs", None, "log probabilities"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty", None, "repetition_penalty"),
    ({"presence_penalty": -1}, 400, "presence_penalty", None, "repetition_penalty"),
    ({"logit_bias": {"42": 5}}, 400, "logit_bias", None, "logit_bias"),
    ({"temperature": "hot"}, 400, "temperature", "invalid_type", "number"),
    ({"temperature": -1}, 400, "temperature", None, "out of range"),
    ({"top_p": 2}, 400, "top_p", None, "out of range"),
    ({"stop": [""]}, 400, "stop", None, "non-empty"),
    ({"min_tokens": 9, "max_tokens": 3}, 400, "min_tokens", None, "above"),
    ({"stream": "maybe"}, 400, "stream", "invalid_type", "boolean"),
    ({"messages": []}, 400, "messages", None, "empty"),
    ({"messages": None}, 400, "messages", "invalid_type", "list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None, "wizard"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", None, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", None, "image_url"),
    ({"documents": [{"title": "no text"}]}, 400, "documents[0].text", "missing_field", "required"),
    ({"cacheblend": {"recompute_ratoi": 0.2}}, 400, "cacheblend.recompute_ratoi", None, "recompute_ratio"),
    ({"cacheblend": {"recompute_ratio": 5}}, 400, "cacheblend.recompute_ratio", None, "range"),
    ({"cacheblend": {"reuse": "no"}}, 400, "cacheblend.reuse", None, "true, false"),
    ({"cacheblend": {"timeout": -1}}, 400, "cacheblend.timeout", None, "positive"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", None, "json_object"),
    ({"tool_choice": "required"}, 400, "tool_choice", None, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None, "names no bound tool"),
    ({"chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs", None, "passes itself"),
    ({"min_tokens": 5000, "max_tokens": 5000}, 400, "min_tokens", "context_length_exceeded", "4096"),
]


@pytest.mark.parametrize("change, status, param, code, word", BAD_REQUESTS,
                         ids=[next(iter(case[0])) + f"-{i}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_input_names_its_field(server, change, status, param, code, word):
    length = {} if {"max_tokens", "max_completion_tokens"} & set(change) else {"max_tokens": 2}
    response = post(server, {"model": TINY_MODEL, "messages": HELLO, **length, **change})
    error = error_of(response)
    assert response.status_code == status, error
    assert (error["param"], error["code"]) == (param, code), error
    assert word in error["message"]
    assert error["type"] == "invalid_request_error"


def test_malformed_json_and_unknown_routes_get_the_error_shape(server):
    for headers in ({"content-type": "application/json"}, {}):
        response = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": ', headers=headers)
        assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"
    response = httpx.post(f"{server.url}/v1/chat/completions", json=[1, 2])
    assert response.status_code == 400 and error_of(response)["type"] == "invalid_request_error"
    missing = httpx.get(f"{server.url}/v1/embeddings")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    assert httpx.get(f"{server.url}/v1/chat/completions").status_code == 405


def test_unknown_top_level_fields_are_ignored_and_the_server_keeps_serving(server):
    response = post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 2, "user": "u1",
                             "some_client_extra": {"x": 1}, "store": False, "metadata": {"k": "v"}})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_prompt_beyond_the_window_names_both_numbers(server):
    long = " ".join(f"word{i}" for i in range(5000))
    response = post(server, {"model": TINY_MODEL, "messages": [{"role": "user", "content": long}]})
    error = error_of(response)
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    tokens = int(error["message"].split(" has ")[1].split(" tokens")[0])
    assert tokens > 4096 and "4096" in error["message"]
    documents = [{"text": long[: len(long) // 2]}, {"text": long[len(long) // 2:]}]
    with_documents = post(server, {"model": TINY_MODEL, "messages": HELLO, "documents": documents})
    assert with_documents.status_code == 400 and error_of(with_documents)["code"] == "context_length_exceeded"


def test_max_tokens_beyond_the_window_is_capped_as_in_process(server, tiny_settings):
    window = tiny_settings.service.engine.context_window
    per_word = len(tiny_settings.service.engine.tokenize("word " * 100)) / 100
    text = "word " * int((window - 60) / per_word)  # a prompt that leaves a few dozen tokens of room
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 100_000,
            "min_tokens": 10}
    response = post(server, body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= window
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_beyond_the_bound_is_413(server):
    limit = 64 * 4096 + 1024 * 1024
    response = post(server, {"model": TINY_MODEL, "messages": [{"role": "user", "content": "x" * (limit + 10)}]})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    assert post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200


def test_a_timeout_is_504(server):
    response = post(server, {"model": TINY_MODEL, "messages": HELLO, "cacheblend": {"timeout": 1e-6}, **ENDLESS})
    assert response.status_code == 504 and error_of(response)["code"] == "timeout"


def test_an_unexpected_error_is_500_with_its_type_and_message(server, monkeypatch):
    def broken(settings, turn):
        raise RuntimeError("the engine caught fire")
        yield

    monkeypatch.setattr("cacheblend_rag.server.completions.run_turn", broken)
    response = post(server, {"model": TINY_MODEL, "messages": HELLO})
    error = error_of(response)
    assert response.status_code == 500 and error["message"] == "RuntimeError: the engine caught fire"
    assert "Traceback" not in response.text
    stream = post(server, {"model": TINY_MODEL, "messages": HELLO, "stream": True})
    assert stream.status_code == 500
    monkeypatch.undo()
    assert post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _first_content(lines) -> None:
    """Read ``lines`` (an SSE stream's, kept by the caller: a line iterator let go closes the connection) up
    to the first text."""
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return


def test_a_client_that_leaves_mid_stream_frees_its_slot(server, tiny_settings):
    scheduler = tiny_settings.service.scheduler
    cancelled = scheduler.stats()["cancelled"]
    body = {"model": TINY_MODEL, "messages": HELLO, "stream": True, **ENDLESS}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        _first_content(lines)
        assert scheduler.stats()["running"] == 1
    _wait_for(lambda: scheduler.stats()["cancelled"] == cancelled + 1 and scheduler.stats()["running"] == 0,
              "the stream's request to be cancelled")
    assert scheduler.stats()["kv_reserved_bytes"] == 0


def test_a_client_that_leaves_a_whole_answer_frees_its_slot(server, tiny_settings):
    scheduler = tiny_settings.service.scheduler
    cancelled = scheduler.stats()["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        post(server, {"model": TINY_MODEL, "messages": HELLO, **ENDLESS}, timeout=httpx.Timeout(60, read=1.0))
    _wait_for(lambda: scheduler.stats()["cancelled"] == cancelled + 1 and scheduler.stats()["running"] == 0,
              "the request to be cancelled")


def test_a_full_queue_is_429_with_retry_after(server, tiny_settings):
    scheduler = tiny_settings.service.scheduler
    saved = scheduler.config
    scheduler.configure(max_queued_requests=1, max_batch_size=1)
    queued: list[httpx.Response] = []
    try:
        body = {"model": TINY_MODEL, "messages": HELLO, "stream": True, **ENDLESS}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()
            _first_content(lines)  # it runs, and holds the one slot of the batch
            waiting = threading.Thread(target=lambda: queued.append(
                post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 1})))
            waiting.start()
            _wait_for(lambda: scheduler.stats()["queued"] == 1, "the second request to queue")
            refused = post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 1})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert error_of(refused)["code"] == "queue_full" and error_of(refused)["type"] == "rate_limit_error"
        waiting.join(60)
    finally:
        scheduler.configure(max_queued_requests=saved.max_queued_requests, max_batch_size=saved.max_batch_size)
    assert queued and queued[0].status_code == 200


def test_an_api_key_guards_every_route_but_health(tiny_settings):
    with ServerThread(create_app(tiny_settings, api_key="s3cret")) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = post(server, {"model": TINY_MODEL, "messages": HELLO}, headers=headers)
            assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        client = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model=TINY_MODEL, messages=HELLO, max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()


@dataclass
class GatedConfig(ServerConfig):
    """Loads the session's settings once the test opens the gate: the test sees the server while it loads."""

    loaded: object = None
    gate: threading.Event = field(default_factory=threading.Event)

    def load(self):
        assert self.gate.wait(60)
        return self.loaded


def test_health_is_503_until_the_model_answers(tiny_settings):
    config = GatedConfig(model=TINY_MODEL, loaded=tiny_settings, close_on_shutdown=False)
    server = ServerThread(create_app(config)).start(wait_ready=False)
    try:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        response = post(server, {"model": TINY_MODEL, "messages": HELLO})
        assert response.status_code == 503 and error_of(response)["code"] == "model_loading"
        assert response.headers["retry-after"] == "1"
        config.gate.set()
        server.wait_ready(60)
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200
    finally:
        config.gate.set()
        server.stop()
    assert not tiny_settings.service.scheduler.closed


def test_a_store_outage_is_answered_not_a_500(tiny_settings, unique_documents):
    from cacheblend_rag.serving import CacheBlendSettings
    from cacheblend_rag.store import ChunkCache, MemoryKVStore
    from cacheblend_rag.store.errors import StoreError

    class DownStore(MemoryKVStore):
        def __getattribute__(self, name):
            if name in {"get_layer", "put_layer", "get_manifest", "add_manifest", "contains", "delete",
                        "delete_layers", "stats"}:
                raise StoreError("connection refused (the store is down)")
            return super().__getattribute__(name)

    engine = tiny_settings.service.engine
    settings = CacheBlendSettings(engine=engine, chunk_cache=ChunkCache(engine, DownStore(), resident_bytes=0),
                                  temperature=0)
    with ServerThread(create_app(settings)) as server:
        for documents in (unique_documents, unique_documents[::-1]):
            response = post(server, {"model": TINY_MODEL, "messages": HELLO, "max_tokens": 2, "documents": documents})
            assert response.status_code == 200, response.text
            stats = response.json()["cacheblend"]
            assert stats["cache_hits"] == 0 and stats["cache_misses"] == 3  # nothing read back: computed afresh
            assert stats["store_error"].startswith("connection refused (the store is down)")  # and it says why
        assert "cacheblend_store_available 0.0" in httpx.get(f"{server.url}/metrics").text
