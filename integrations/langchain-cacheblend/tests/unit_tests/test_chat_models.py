"""ChatCacheBlend on a tiny random model: options, stats, callbacks, async behaviour, errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from pydantic import ValidationError

from cacheblend_rag.errors import BlendInputError
from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import ChatCacheBlend

CHUNKS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def _messages(question: str = "Who won two Nobel prizes?") -> list:
    context = "\n\n".join(CHUNKS)
    return [SystemMessage(f"Answer from the context.\nContext:\n{context}\n"), HumanMessage(question)]


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.ended = 0

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.ended += 1


def test_plain_prompt_is_full_prefill_with_usage(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=8)
    message = llm.invoke("Hello")
    meta = message.response_metadata["cacheblend"]
    assert message.response_metadata["model_name"] == "tiny-llama" and meta["mode"] == "full_prefill"
    assert meta["cache_hits"] == meta["cache_misses"] == 0 and meta["ttft_s"] > 0
    usage = message.usage_metadata
    assert usage["input_tokens"] == meta["prompt_tokens"] > 0
    assert usage["output_tokens"] == meta["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_token_details"]["cache_read"] == 0


def test_warmed_chunks_are_blended_and_counted(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=8)
    summary = llm.warm([Document(page_content=c) for c in CHUNKS], show_progress=False)
    assert summary.new + summary.present == 2
    assert set(CHUNKS) <= set(llm.known_chunk_texts)
    meta = llm.invoke(_messages()).response_metadata["cacheblend"]
    assert meta["mode"] == "blend" and meta["chunks_found"] == 2
    assert meta["cache_hits"] == 2 and meta["cache_misses"] == 0
    # The lead's tokens that an earlier test's prompt shared come from the prefix cache (to the token).
    assert meta["cached_tokens"] == sum(len(engine.tokenize(c)) for c in CHUNKS) + meta["prefix_tokens"]
    assert 0 < meta["recomputed_tokens"] < meta["cached_tokens"]
    assert meta["reused_tokens"] == meta["cached_tokens"] - meta["recomputed_tokens"]
    again = llm.invoke(_messages())  # its lead now comes from the prefix cache too
    again_stats = again.response_metadata["cacheblend"]
    # Every cached token was read from a cache (the store, the prefix cache): cache_read is all those kept as is.
    assert again_stats["loaded_tokens"] == again_stats["cached_tokens"]
    assert again.usage_metadata["input_token_details"]["cache_read"] == again_stats["reused_tokens"]
    assert again_stats["reused_tokens"] >= meta["reused_tokens"]


def test_announced_but_uncached_chunks_are_computed_on_the_fly(engine) -> None:
    # prefix_cache_bytes=0: the same prompt again would come back from the prefix cache (the first
    # request's approximate blocks), not as chunks read from the store.
    llm = ChatCacheBlend(engine=tiny_engine("llama"), max_tokens=4, prefix_cache_bytes=0)
    llm.announce_chunks(CHUNKS)
    first_message = llm.invoke(_messages())
    first = first_message.response_metadata["cacheblend"]
    assert first["cache_misses"] == 2 and first["cache_hits"] == 0
    # The chunks' K/V was computed for this call, not read: blended (reused_tokens), yet no cache read.
    assert first["reused_tokens"] > 0 and first_message.usage_metadata["input_token_details"]["cache_read"] == 0
    llm.chunk_cache.flush()  # the missed chunks are written back on a writer thread
    second_message = llm.invoke(_messages())
    second = second_message.response_metadata["cacheblend"]
    assert second["cache_hits"] == 2 and second["cache_misses"] == 0
    assert second_message.usage_metadata["input_token_details"]["cache_read"] == second["reused_tokens"] > 0


def test_ratio_one_equals_the_plain_model(engine) -> None:
    blended = ChatCacheBlend(engine=engine, recompute_ratio=1.0, max_tokens=12)
    blended.warm(CHUNKS, show_progress=False)
    plain = ChatCacheBlend(engine=engine, max_tokens=12, prefix_cache_bytes=0)
    a, b = blended.invoke(_messages()), plain.invoke(_messages())
    a_stats, b_stats = a.response_metadata["cacheblend"], b.response_metadata["cacheblend"]
    assert a_stats["mode"] == "blend" and b_stats["mode"] == "full_prefill"
    assert a_stats["prompt_tokens"] == b_stats["prompt_tokens"]
    assert a.content == b.content


def test_stream_matches_invoke_and_fires_one_callback_per_chunk(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=10)
    llm.warm(CHUNKS, show_progress=False)
    counter = TokenCounter()
    chunks = list(llm.stream(_messages(), config={"callbacks": [counter]}))
    assert "".join(c.content for c in chunks) == llm.invoke(_messages()).content
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] == 10
    assert sum(1 for c in chunks if c.usage_metadata) == 1  # input tokens are counted once
    assert len(counter.tokens) == len(chunks) and counter.ended == 1


def test_streaming_flag_fires_token_callbacks_on_invoke(engine) -> None:
    counter = TokenCounter()
    llm = ChatCacheBlend(engine=engine, max_tokens=6, streaming=True, callbacks=[counter])
    message = llm.invoke("Hello")
    assert "".join(counter.tokens) == message.content and len(counter.tokens) > 1


def test_bind_and_call_options(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=20, prefix_cache_bytes=0)  # ratio 0 below is full reuse
    assert llm.bind(max_tokens=3).invoke("Hello").usage_metadata["output_tokens"] == 3
    with pytest.raises(ValueError, match=r"ChatCacheBlend got max_tokens=0: the answer's length must be an integer"):
        llm.invoke("Hello", max_tokens=0)  # the same check as CacheBlendLLM's (serving.call_answer_length)
    full = llm.invoke("Hello").content
    stop = full[len(full) // 2 :][:3]
    cut = llm.invoke("Hello", stop=[stop])
    assert cut.response_metadata["finish_reason"] == "stop" and cut.content == full[: full.find(stop)]
    assert ChatCacheBlend(engine=engine, max_tokens=20, stop=[stop]).invoke("Hello").content == cut.content
    # Seeded sampling is reproducible; greedy (temperature 0) is the default.
    sampled = llm.bind(temperature=1.0, top_p=0.9, seed=7)
    assert sampled.invoke("Hello").content == sampled.invoke("Hello").content
    assert llm.with_config(tags=["x"]).invoke("Hello").content == full
    blend_override = llm.bind(recompute_ratio=0.0)
    llm.warm(CHUNKS, show_progress=False)
    assert blend_override.invoke(_messages()).response_metadata["cacheblend"]["mode"] == "full_reuse"
    assert llm._blend_config({"profile_layers": 2}).profile_layers == 2
    assert ChatCacheBlend(engine=engine, profile_layers=3)._blend_config({}).profile_layers == 3
    assert llm._blend_config({"profile_tokens": 5}).profile_tokens == 5
    assert ChatCacheBlend(engine=engine, profile_tokens=None)._blend_config({}).profile_tokens is None


def test_identifying_and_tracing_params(engine) -> None:
    llm = ChatCacheBlend(engine=engine, recompute_ratio=0.3, max_tokens=9, stop=["\n"])
    assert llm._llm_type == "cacheblend-chat"
    params = llm._identifying_params
    assert params["model"] == "tiny-llama" and params["recompute_ratio"] == 0.3 and params["max_tokens"] == 9
    ls = llm._get_ls_params()
    assert ls["ls_provider"] == "cacheblend" and ls["ls_max_tokens"] == 9 and ls["ls_stop"] == ["\n"]
    assert "engine" not in llm.model_dump()


def test_models_named_alike_share_one_engine() -> None:
    a, b = ChatCacheBlend(model="tiny-llama"), ChatCacheBlend(model="tiny-llama", recompute_ratio=0.5)
    assert a.get_engine() is b.get_engine() and a.chunk_cache is b.chunk_cache
    assert ChatCacheBlend(model="tiny-qwen2").get_engine() is not a.get_engine()


async def test_async_matches_sync_and_keeps_the_loop_free(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=48)
    llm.warm(CHUNKS, show_progress=False)
    expected = llm.invoke(_messages()).content
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        result = await llm.ainvoke(_messages())
        streamed = "".join([c.content async for c in llm.astream(_messages())])
        batch = await llm.abatch([_messages(), _messages("Where does the Amazon flow?")])
    finally:
        task.cancel()
    assert result.content == streamed == batch[0].content == expected
    assert batch[1].content == llm.invoke(_messages("Where does the Amazon flow?")).content
    assert ticks >= 5, "the event loop was blocked while the model computed"


async def test_leaving_astream_early_frees_the_engine(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_tokens=3000)  # tens of seconds if it ran to the end
    stream = llm.astream("Hello")
    async for _ in stream:
        break
    await stream.aclose()
    short = await asyncio.wait_for(llm.bind(max_tokens=2).ainvoke("Hello"), timeout=5)
    assert short.usage_metadata["output_tokens"] == 2


def test_bad_arguments_say_what_to_fix(engine) -> None:
    with pytest.raises(ValidationError, match="did you mean 'recompute_ratio'"):
        ChatCacheBlend(engine=engine, recompute_raito=0.2)
    with pytest.raises(ValidationError, match="recompute_ratio"):
        ChatCacheBlend(engine=engine, recompute_ratio=1.5)
    with pytest.raises(ValidationError, match=r"recompute_ratio='0.15' must be a number in \[0.0, 1.0\]"):
        ChatCacheBlend(engine=engine, recompute_ratio="0.15")  # as BlendConfig refuses it, not coerced
    with pytest.raises(ValidationError, match="selection"):
        ChatCacheBlend(engine=engine, selection="nope")
    with pytest.raises(ValidationError, match="profile_layers=0 is out of range"):
        ChatCacheBlend(engine=engine, profile_layers=0)
    llm = ChatCacheBlend(engine=engine, max_tokens=4)
    with pytest.raises(ValueError, match="unknown call option"):
        llm.invoke("Hello", frobnicate=1)
    with pytest.raises(ValueError, match="cannot switch"):
        llm.invoke("Hello", model="other-model")
    with pytest.raises(BlendInputError, match="text only"):
        llm.invoke([HumanMessage(content=[{"type": "image", "url": "https://example.com/a.png"}])])
    with pytest.raises(ValueError, match="tiny test model"):
        ChatCacheBlend(model="tiny-gpt9").invoke("Hello")
    with pytest.raises(TimeoutError):
        ChatCacheBlend(engine=engine, max_tokens=500, timeout=1e-6).invoke("Hello")
    # max_retries, a standard parameter of hosted models, is accepted and has no effect; api_key is the
    # server's (with base_url), unused in process.
    ChatCacheBlend(engine=engine, api_key="unused", max_retries=2)


def test_store_path_keeps_chunk_kv_on_disk(tmp_path) -> None:
    first = ChatCacheBlend(engine=tiny_engine("llama"), store_path=str(tmp_path / "kv"), max_tokens=4)
    assert first.warm(CHUNKS, show_progress=False).new == 2
    first.chunk_cache.flush()
    # Another engine of the same weights (as in a new process) finds the chunks on disk.
    second = ChatCacheBlend(engine=tiny_engine("llama"), store_path=str(tmp_path / "kv"), max_tokens=4)
    assert second.warm(CHUNKS, show_progress=False).present == 2
    assert second.invoke(_messages()).response_metadata["cacheblend"]["cache_hits"] == 2


def test_unusable_store_path_fails_at_construction(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValidationError, match="store_path=.*cannot hold a chunk KV store"):
        ChatCacheBlend(model="tiny-llama", store_path=str(blocker / "kv"))


def test_announced_texts_are_bounded_most_recent_first(engine) -> None:
    llm = ChatCacheBlend(engine=engine, max_announced_chunks=2)
    llm.announce_chunks(["a", "b", "c", "  "])
    llm.announce_chunks([Document(page_content="b")])
    assert llm.known_chunk_texts == ["c", "b"]
    # Copies made by bind/with_config see the same announcements.
    assert llm.model_copy().known_chunk_texts == ["c", "b"]
    llm.forget_chunks()
    assert llm.known_chunk_texts == []


def test_a_saved_calibration_is_used_unless_a_setting_is_given(engine, tmp_path) -> None:
    from cacheblend_rag import BlendConfig
    from cacheblend_rag.calibration.measure import calibrate
    from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt

    example = MusiqueExample("Who won two Nobel prizes?", [], [("", text) for text in CHUNKS])
    prompts = [build_prompt(engine.tokenizer, example, passages=2)]
    result = calibrate(engine, prompts, "kv_deviation@0.3,kv_deviation@1.0", teacher_tokens=4, progress=False)
    path = result.save(tmp_path)

    llm = ChatCacheBlend(engine=engine, max_tokens=4, calibration_dir=str(tmp_path))
    assert llm.config_source == f"calibrated: {path}" and not llm.conditions_chunks
    assert llm._blend_config({}) == BlendConfig(**result.chosen.config)
    llm.warm(CHUNKS, show_progress=False)
    meta = llm.invoke(_messages()).response_metadata["cacheblend"]
    assert meta["mode"] == "blend" and meta["blend_setting"] == result.chosen.name
    assert meta["config_source"] == f"calibrated: {path}" and meta["condition_chunks"] is False
    assert llm.invoke(_messages(), recompute_ratio=0.5).response_metadata["cacheblend"]["config_source"] == "user"

    mine = ChatCacheBlend(engine=engine, calibration_dir=str(tmp_path), selection="kv_deviation")
    assert mine.config_source == "user" and mine._blend_config({}) == BlendConfig(selection="kv_deviation")
    other = ChatCacheBlend(engine=tiny_engine("llama", seed=1), calibration_dir=str(tmp_path))
    assert other.config_source == "built-in" and other._blend_config({}) == BlendConfig()
