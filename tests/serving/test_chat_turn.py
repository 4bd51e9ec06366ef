"""One chat turn (serving.chat_turn): documents found or rendered, cached tokens counted honestly, salts kept
apart, the timeout enforced on the request, and the same turn over a server's wire shape."""

from __future__ import annotations


import pytest

from cacheblend_rag.serving import CacheBlendSettings, ChatTurn, Document, TextDelta, TurnEnd, render_turn, run_turn
from cacheblend_rag.serving.chat_turn import render_documents
from cacheblend_rag.serving.remote import _events, request_body
from cacheblend_rag.testing import tiny_engine

DOCS = [
    {"title": "Varrow", "text": "The lighthouse on the isle of Varrow is painted red and white and was built in 1820 "
                                "by the harbour guild, who kept its lamp burning through every winter storm."},
    {"text": "Orla Fenwick wrote four novels about the sea and the rivers of the north, each of them in a single "
             "winter, and never once let a publisher change a word of them."},
]
QUESTION = [{"role": "user", "content": "Who built the lighthouse?"}]


@pytest.fixture(scope="module")
def settings():
    return CacheBlendSettings(engine=tiny_engine("qwen2"), min_blend_tokens=0, segment_cache_bytes=0)


def turn(settings, **kwargs):
    values = {"generation": settings.generation_config_with(4, None, {"temperature": 0}), "messages": QUESTION,
              "documents": DOCS, **kwargs}
    return ChatTurn(**values)


def ended(events) -> TurnEnd:
    events = list(events)
    assert isinstance(events[-1], TurnEnd)
    return events[-1]


def test_documents_not_in_a_message_open_the_last_user_message(settings):
    prompt = render_turn(settings.service.engine.tokenizer, turn(settings), [], False, {})
    block = render_documents([Document.of(d) for d in DOCS])
    assert block.startswith("Varrow\nThe lighthouse")
    assert f"{block}\n\nWho built the lighthouse?" in prompt


def test_a_document_pasted_into_a_message_is_found_there_not_rendered_twice(settings):
    pasted = [{"role": "user", "content": f"Context: {DOCS[0]['text']}\nWho built the lighthouse?"}]
    prompt = render_turn(settings.service.engine.tokenizer, turn(settings, messages=pasted), [], False, {})
    assert prompt.count(DOCS[0]["text"]) == 1 and DOCS[1]["text"] in prompt
    end = ended(run_turn(settings, turn(settings, messages=pasted)))
    assert end.stats["chunks_found"] == 2


def own_documents(tag: str) -> list[dict]:
    """DOCS made this test's own: the chunk store is shared across salts, so other tests' DOCS are hits."""
    return [{**d, "text": f"{tag}: {d['text']}"} for d in DOCS]


def test_the_second_turn_with_the_same_documents_reports_cached_tokens(settings):
    docs = own_documents("second turn")
    first = ended(run_turn(settings, turn(settings, documents=docs, cache_salt="cached-a")))
    assert first.stats["cache_misses"] == 2 and first.cached_tokens == 0  # computed here, not reused
    # In another order, so that the prefix cache (which would reuse the same opening) has no part in it.
    second = ended(run_turn(settings, turn(settings, cache_salt="cached-a", documents=docs[::-1],
                                           messages=[{"role": "user", "content": "What colour is it?"}])))
    assert second.stats["cache_hits"] == 2 and second.cached_tokens > 0


def test_turns_with_different_salts_share_chunks_but_no_prefix(settings):
    docs = own_documents("salts")
    ended(run_turn(settings, turn(settings, documents=docs, cache_salt="tenant-1")))
    other = ended(run_turn(settings, turn(settings, documents=docs, cache_salt="tenant-2")))
    # The chunk store is shared by default (chunk_sharing="shared"); the prompt's own K/V is not.
    assert other.stats["cache_hits"] == 2 and other.stats["cache_misses"] == 0
    assert other.stats["prefix_tokens"] == 0
    again = ended(run_turn(settings, turn(settings, documents=docs, cache_salt="tenant-1")))
    assert again.stats["prefix_tokens"] > 0 and again.cached_tokens > other.cached_tokens


def test_a_turn_looks_only_for_its_own_documents(settings):
    settings.announced.announce([DOCS[1]["text"]])
    try:
        end = ended(run_turn(settings, turn(settings, documents=DOCS[:1], cache_salt="own",
                                            messages=[{"role": "user", "content": DOCS[1]["text"]}])))
    finally:
        settings.announced.clear()
    assert end.stats["chunks_found"] == 1


def test_the_timeout_cancels_a_request_that_waits_too_long(settings):
    slow = turn(settings, timeout=1e-4, generation=settings.generation_config_with(64, None, {"temperature": 0}))
    with pytest.raises(TimeoutError, match="timeout"):
        list(run_turn(settings, slow))
    # The request left the scheduler: the next turn is answered.
    assert ended(run_turn(settings, turn(settings))).completion_tokens > 0


def test_the_wire_body_carries_what_the_turn_asks_for(settings):
    body = request_body(turn(settings, cache_salt="s", tools=[{"type": "function", "function": {"name": "f"}}],
                             tool_choice="any", response_format={"type": "object"}, timeout=5.0,
                             blend_options={"recompute_ratio": 0.3}), "m", {"check_layer": 1})
    assert body["documents"][0] == {"title": "Varrow", "text": DOCS[0]["text"]} and "title" not in body["documents"][1]
    assert body["tool_choice"] == "required" and body["cache_salt"] == "s" and body["stream"] is True
    assert body["response_format"]["type"] == "json_schema"
    assert body["cacheblend"] == {"check_layer": 1, "recompute_ratio": 0.3, "timeout": 5.0}
    assert body["temperature"] == 0 and body["max_tokens"] == 4


def test_server_sent_chunks_become_the_same_events():
    lines = [
        'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}',
        'data: {"choices": [{"index": 0, "delta": {"content": "lo"}}]}',
        'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function", '
        '"function": {"name": "f", "arguments": "{\\"x\\": "}}]}}]}',
        'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, '
        '"finish_reason": "tool_calls"}]}',
        'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, '
        '"prompt_tokens_details": {"cached_tokens": 5}}, "cacheblend": {"mode": "blend", "finish_reason": "eos"}}',
        "data: [DONE]",
    ]
    events = list(_events(iter(lines)))
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hel", "lo"]
    calls = events[-2].calls
    assert calls[0].name == "f" and calls[0].arguments == {"x": 1} and calls[0].id == "c1"
    assert events[-1].cached_tokens == 5 and events[-1].stats["mode"] == "blend"
