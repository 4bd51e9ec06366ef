"""The server as OpenAI's clients see it: the openai library, LangChain's ChatOpenAI and LlamaIndex's
OpenAILike against a real uvicorn on a tiny model (tests/server/conftest.py)."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import openai
import pytest

TINY_MODEL = "tiny-llama"  # the model of tests/server/conftest.py's tiny_settings

QUESTION = [{"role": "user", "content": "What do the reports say?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_completion_has_openai_shape_and_our_stats(client):
    # A salt of its own: other files ask the same engine the same question first, in any order (prefix-cache hits)
    response = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=4,
                                              extra_body={"cache_salt": uuid.uuid4().hex})
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == TINY_MODEL
    choice = response.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    usage = response.usage
    assert usage.completion_tokens <= 4 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # always present, 0 included
    stats = response.model_extra["cacheblend"]
    assert {"ttft_s", "mode", "recomputed_tokens", "cache_hits", "cache_misses", "fallback_reason"} <= set(stats)


def test_content_parts_and_developer_messages_are_read(client):
    response = client.chat.completions.create(model=TINY_MODEL, max_tokens=2, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    assert response.choices[0].message.role == "assistant"


def test_the_same_documents_are_a_cache_hit_with_another_question(client, unique_documents):
    first = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=3,
                                           extra_body={"documents": unique_documents})
    assert first.model_extra["cacheblend"]["cache_misses"] == 3
    assert first.model_extra["cacheblend"]["cache_hits"] == 0
    # Another question, the passages in another order (else the prefix cache answers, not the chunk store).
    second = client.chat.completions.create(
        model=TINY_MODEL, max_tokens=3, messages=[{"role": "user", "content": "Which one is oldest?"}],
        extra_body={"documents": unique_documents[::-1]})
    stats = second.model_extra["cacheblend"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert stats["cache_hits"] > 0 and stats["cache_misses"] == 0


def test_another_cache_salt_shares_the_chunks_but_no_prefix(client, unique_documents):
    salted = {"documents": unique_documents, "cache_salt": "tenant-a"}
    first = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2, extra_body=salted)
    other = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2,
                                           extra_body={**salted, "cache_salt": "tenant-b"})
    stats = other.model_extra["cacheblend"]  # the chunk store is shared (--chunk-sharing shared, the default)
    assert stats["cache_hits"] == 3 and stats["prefix_tokens"] == 0 and stats["segment_tokens"] == 0
    same = client.chat.completions.create(model=TINY_MODEL, max_tokens=2, extra_body=salted, messages=QUESTION)
    assert same.model_extra["cacheblend"]["prefix_tokens"] > 0
    assert same.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


def test_warmed_documents_are_hits_on_their_first_request(server, client, unique_documents):
    warmed = httpx.post(f"{server.url}/v1/documents/warm", json={"documents": unique_documents}).json()
    assert warmed == {"object": "documents.warm", "documents": 3, "computed": 3, "already_stored": 0, "failed": 0}
    again = httpx.post(f"{server.url}/v1/documents/warm", json={"documents": [d["text"] for d in unique_documents]})
    assert again.json()["already_stored"] == 3
    response = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2,
                                              extra_body={"documents": unique_documents})
    assert response.model_extra["cacheblend"]["cache_hits"] == 3


def test_reuse_false_is_full_prefill_and_blend_overrides_apply(client, unique_documents):
    body = {"documents": unique_documents, "cacheblend": {"reuse": False}}
    full = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2, extra_body=body)
    assert full.model_extra["cacheblend"]["mode"] == "full_prefill"
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    tuned = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2, extra_body={
        "documents": unique_documents, "cacheblend": {"recompute_ratio": 0.5, "timeout": 120}})
    assert tuned.model_extra["cacheblend"]["recompute_ratio"] == 0.5


def test_a_stream_with_usage(client, unique_documents):
    chunks = list(client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"documents": unique_documents}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens <= 5
    assert last.usage.prompt_tokens_details.cached_tokens >= 0 and "cache_misses" in last.model_extra["cacheblend"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=5,
                                           extra_body={"documents": unique_documents})
    assert isinstance(text, str) and whole.usage.prompt_tokens == last.usage.prompt_tokens


def test_a_stream_ends_with_done(server):
    body = {"model": TINY_MODEL, "messages": QUESTION, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert "usage" not in json.loads(events[-2][len("data: "):])  # no include_usage: no usage chunk


def test_a_required_tool_call_comes_back_as_tool_calls(client):
    response = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                              max_tokens=60, tools=[WEATHER_TOOL], tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert "city" in json.loads(call.function.arguments)
    # The call and its result, sent back: the conversation goes on.
    follow = client.chat.completions.create(model=TINY_MODEL, max_tokens=3, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.role == "assistant"


def test_a_streamed_tool_call(client):
    chunks = list(client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                 max_tokens=60, tools=[WEATHER_TOOL], stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "get_weather"
    json.loads(calls[0][0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_json_object_response_format_parses(client):
    response = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                              max_tokens=10, response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    typed = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "A number"}],
                                           max_tokens=20, response_format={"type": "json_schema", "json_schema": {
                                               "name": "number", "schema": schema}})
    assert isinstance(json.loads(typed.choices[0].message.content)["n"], int)
    plain = client.chat.completions.create(model=TINY_MODEL, messages=QUESTION, max_tokens=2,
                                           response_format={"type": "text"})
    assert plain.choices[0].message.content is not None


def test_concurrent_requests_are_decoded_together(server, client, tiny_settings):
    scheduler = tiny_settings.service.scheduler
    before = scheduler.stats()
    results = []

    def ask(i: int) -> None:
        results.append(client.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": f"Question {i}"}], max_tokens=16,
            extra_body={"min_tokens": 16}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = scheduler.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["mean_batch_size"] * after["decode_steps"] - before["mean_batch_size"] * before["decode_steps"]
    assert len(results) == 4 and all(r.usage.completion_tokens == 16 for r in results)
    assert tokens / steps > 1.2  # more than one request per decode step: they reached the scheduler together


def test_models_health_and_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY_MODEL] and models[0].owned_by == "cacheblend-rag"
    assert models[0].model_extra["max_model_len"] == 4096
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("cacheblend_http_requests_total", "cacheblend_request_latency_seconds_bucket",
                 "cacheblend_time_to_first_token_seconds_bucket", 'cacheblend_prompt_tokens_total{origin="reused"}',
                 'cacheblend_prompt_tokens_total{origin="recomputed"}',
                 'cacheblend_prompt_tokens_total{origin="fresh"}',
                 "cacheblend_chunk_hits_total", "cacheblend_chunk_misses_total", "cacheblend_fallbacks_total",
                 "cacheblend_queue_depth", "cacheblend_running_requests", "cacheblend_store_hits_total",
                 "cacheblend_store_load_failures_total", "cacheblend_store_available", "cacheblend_errors_total"):
        assert name in text, name


def test_langchain_chat_openai(server, unique_documents):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="unused", model=TINY_MODEL, max_tokens=3,
                                       max_retries=0, extra_body={"documents": unique_documents})
    chat.invoke("What do the reports say?")
    reply = chat.invoke("Which report is the longest?")
    assert isinstance(reply.content, str)
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
    streamed = list(chat.stream("And the shortest?"))
    assert streamed and all(isinstance(c.content, str) for c in streamed)


def test_llamaindex_openai_like(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    # min_tokens: the random model's first token can be its end of sequence (an empty answer, which OpenAILike
    # reads as content None); so it failed once in a full run, where the shared engine's caches held other prompts.
    llm = openai_like.OpenAILike(api_base=server.base_url, model=TINY_MODEL, is_chat_model=True, api_key="unused",
                                 max_tokens=3, max_retries=0, additional_kwargs={"extra_body": {"min_tokens": 3}})
    reply = llm.chat([ChatMessage(role="user", content="Hello")])
    assert reply.message.role == "assistant" and reply.raw.choices[0].finish_reason == "length"
    assert reply.additional_kwargs["completion_tokens"] == 3
    assert "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content="Hi")])) is not None
