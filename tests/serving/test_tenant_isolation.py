"""Tenant isolation (issue 69): what requests of different cache salts share.

A user who guesses another's private prompt must learn nothing from the stats: under another salt the
guess reuses no prefix-cache block and no segment-cache span of it, exactly as a wrong guess does. The
same salt (or none) reuses as before. The chunk store is shared across salts by default (a chunk's K/V
comes from its text alone) and keyed apart with ``chunk_sharing="per_salt"``. A response's stats are its
request's own: no counter over all requests, which would let one user watch another's.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.reuse.prompt import chunk_text
from cacheblend_rag.serving import CacheBlendSettings, ChatTurn, TurnEnd, render_turn
from cacheblend_rag.testing import tiny_engine

SYSTEM = "You answer questions about the user's own records, briefly and only from what they say."
# Fields a guesser reads to tell a right guess from a wrong one: how much of the prompt came from a cache.
REUSE_FIELDS = ("mode", "prefix_tokens", "approximate_prefix_tokens", "exact_tokens", "segment_tokens",
                "cache_hits", "cache_misses", "precomputed_for_request")
# Per request, but measured: never equal twice.
TIMED_FIELDS = {"ttft_s", "total_s", "decode_tokens_per_s", "timings"}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def settings(engine):
    return CacheBlendSettings(engine=engine, min_blend_tokens=0, recompute_ratio=0.15, temperature=0)


def tagged(text: str) -> str:
    """``text`` no other test sends: the engine's caches are shared by every object on it."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def document() -> str:
    return tagged("The clinic's records are kept in the archive on the second floor. " * 3)


def private_message(secret: str) -> str:
    """A message long enough (over the segment cache's 64-token partial match) for its span to be kept."""
    return (f"My diagnosis is {secret}. " + "Please keep this between us and tell me what my records say about "
            "the follow-up visits, the medication and the next appointment at the clinic. " * 3)


def ask(settings, message: str, documents=(), generation_tokens: int = 4, **turn) -> TurnEnd:
    chat = ChatTurn(generation=settings.generation_config_with(generation_tokens, None, {}),
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}],
                    documents=list(documents), **turn)
    events = list(settings.run_turn(chat))
    assert isinstance(events[-1], TurnEnd)
    return events[-1]


def reuse(end: TurnEnd) -> dict:
    return {**{name: end.stats.get(name) for name in REUSE_FIELDS}, "cached_tokens": end.cached_tokens}


def test_a_right_guess_under_another_salt_looks_like_a_wrong_one(settings):
    doc, secret = document(), tagged("stage two")
    ask(settings, private_message(secret), [doc], cache_salt="a")  # user A's private prompt
    right = ask(settings, private_message(secret), [doc], cache_salt="b")
    wrong = ask(settings, private_message(tagged("stage one")), [doc], cache_salt="b-wrong")
    assert right.stats["prefix_tokens"] == 0 and right.stats["segment_tokens"] == 0
    assert reuse(right) == reuse(wrong)
    # The chunk store is shared (chunk_sharing="shared"): both find the document, whoever warmed it.
    assert right.stats["cache_hits"] == wrong.stats["cache_hits"] == 1


def test_the_same_salt_and_no_salt_reuse_as_before(settings):
    for salt in ("a", None):
        doc, message = document(), private_message(tagged("stage two"))
        first = ask(settings, message, [doc], cache_salt=salt)
        again = ask(settings, message, [doc], cache_salt=salt)
        assert first.stats["prefix_tokens"] < again.stats["prefix_tokens"]
        # Another document before the same message: the prefix stops at the document, the message's
        # span (after the chunk) comes from the segment cache, within the salt.
        other = ask(settings, message, [document()], cache_salt=salt)
        assert other.stats["segment_tokens"] > 0, salt
        stranger = ask(settings, message, [document()], cache_salt=tagged("someone else"))
        assert stranger.stats["segment_tokens"] == 0 and stranger.stats["prefix_tokens"] == 0


def test_a_salted_span_from_the_segment_cache_blends_exactly_at_ratio_one(settings, engine):
    message = private_message(tagged("stage three"))
    ask(settings, message, [document()], cache_salt="exact")
    service = settings.service
    prompt_turn = ChatTurn(generation=settings.generation_config_with(4, None, {}), documents=[document()],
                           messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}])
    prompt = render_turn(engine.tokenizer, prompt_turn, [], False, settings.chat_template_kwargs)
    docs = [chunk_text(d) for d in prompt_turn.documents]  # as run_turn looks for them
    prepared = service.prepare(prompt, blend=settings.blend_config, chunks=docs, salt="exact")
    assert prepared.segment_tokens > 0  # a span another request of this salt computed
    exact = engine.blend(prepared.segments, config=BlendConfig(recompute_ratio=1.0), store=service.chunks_for("exact"))
    full = engine.full_prefill([t for s in prepared.segments for t in s.token_ids])
    torch.testing.assert_close(exact.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_a_chunk_warmed_under_one_salt_hits_under_another_when_shared(settings):
    doc = document()
    settings.service.warm([doc], salt="a")
    end = ask(settings, "What do the records say?", [doc], cache_salt="b")
    assert end.stats["cache_hits"] == 1 and end.stats["cache_misses"] == 0


def test_per_salt_chunks_miss_under_another_salt(engine):
    per_salt = CacheBlendSettings(engine=engine, min_blend_tokens=0, temperature=0, chunk_sharing="per_salt")
    doc = document()
    assert per_salt.service.warm([doc], salt="a").new == 1
    other = ask(per_salt, "What do the records say?", [doc], cache_salt="b")
    assert other.stats["cache_hits"] == 0 and other.stats["cache_misses"] == 1
    own = ask(per_salt, "What else do they say?", [doc], cache_salt="a")
    assert own.stats["cache_hits"] == 1
    with pytest.raises(ValueError, match="chunk_sharing"):
        CacheBlendSettings(engine=engine, chunk_sharing="everyone")


def test_a_response_carries_no_counter_over_all_requests(settings):
    doc, message = document(), private_message(tagged("stage four"))
    ends = [ask(settings, message, [doc]) for _ in range(3)]
    before = settings.service.stats()
    ask(settings, private_message(tagged("elsewhere")), [document()], cache_salt="busy")  # someone else's
    ends.append(ask(settings, message, [doc]))
    counted = {k: v for k, v in ends[1].stats.items() if k not in TIMED_FIELDS}
    for end in ends[2:]:  # the same request again: the same stats, however many requests came before
        assert {k: v for k, v in end.stats.items() if k not in TIMED_FIELDS} == counted
    # store_error is this request's own (None, or why its store read failed), not a counter.
    assert not [k for k in counted if k.startswith(("prefix_cache_", "segment_cache_", "store_"))
                and k != "store_error"]
    # The counters are the operator's, in an explicit call (and the server's /metrics).
    after = settings.service.stats()
    assert after["prefix_cache"]["hits"] > before["prefix_cache"]["hits"]
    assert after["segment_cache"]["entries"] >= 1 and "hits" in after["store"]  # >= 1 only after other tests
    assert after["scheduler"]["finished"] > before["scheduler"]["finished"]


def test_both_integrations_take_a_cache_salt_and_a_per_call_one(engine):
    from langchain_core.messages import HumanMessage

    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    prompt = private_message(tagged("stage five"))
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=2, cache_salt="tenant-x", temperature=0)
    chat = ChatCacheBlend(engine=engine, max_tokens=2, cache_salt="tenant-y", temperature=0)
    llm.complete(prompt)
    assert llm.complete(prompt).additional_kwargs["prefix_tokens"] > 0  # its own salt's
    # Another salt, LangChain's object: nothing of tenant-x's prompt.
    assert chat.invoke([HumanMessage(content=prompt)]).response_metadata["cacheblend"]["prefix_tokens"] == 0
    # Per call: the call's salt wins over the object's.
    assert llm.complete(prompt, cache_salt="tenant-y").additional_kwargs["prefix_tokens"] > 0
    again = chat.invoke([HumanMessage(content=prompt)], cache_salt="tenant-z")
    assert again.response_metadata["cacheblend"]["prefix_tokens"] == 0
    with pytest.raises(Exception, match="cache_salt"):
        llm.complete(prompt, cache_salt=7)


def test_against_a_server_the_salt_goes_with_each_request_and_warm(monkeypatch):
    from cacheblend_rag.serving.remote import RemoteChat, request_body

    remote = CacheBlendSettings(base_url="http://127.0.0.1:9", cache_salt="tenant-r")
    sent, warmed = [], []
    monkeypatch.setattr(RemoteChat, "run_turn", lambda self, turn, options: iter(sent.append(turn) or ()))
    monkeypatch.setattr(RemoteChat, "warm", lambda self, texts, cache_salt=None: warmed.append(cache_salt) or {})
    generation = remote.generation_config_with(2, None, {})
    list(remote.run_turn(ChatTurn(generation=generation, messages=[{"role": "user", "content": "hi"}])))
    list(remote.run_turn(ChatTurn(generation=generation, messages=[{"role": "user", "content": "hi"}], cache_salt="")))
    assert request_body(sent[0], None, {})["cache_salt"] == "tenant-r"
    assert "cache_salt" not in request_body(sent[1], None, {})  # a call's "" is no salt
    remote.precompute_texts(["a chunk"], show_progress=False, for_request=False)
    assert warmed == ["tenant-r"]
