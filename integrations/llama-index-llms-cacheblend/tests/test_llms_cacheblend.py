"""CacheBlendLLM on a tiny random Llama: the LlamaIndex LLM API (sync, streaming, async), its
settings and their validation. Query engines and the postprocessor are tested in
llama-index-postprocessor-cacheblend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.llms import ChatMessage
from pydantic import ValidationError

from cacheblend_rag import BlendConfig
from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.testing import tiny_engine
from llama_index.llms.cacheblend import CacheBlendLLM

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture
def llm(engine):
    # prefix_cache_bytes=0: a prompt sent twice would come back from the prefix cache (its first blend's
    # approximate blocks, mode "prefix_cached"); these tests compare each API's own blend of it.
    return CacheBlendLLM.from_engine(engine, max_new_tokens=6, prefix_cache_bytes=0)


def test_class_is_a_llamaindex_llm():
    assert BaseLLM.__name__ in [b.__name__ for b in CacheBlendLLM.__mro__]


def test_llm_streaming_and_async_apis_agree(llm):
    chunk = "Paris is the capital of France."
    llm.announce_chunks([chunk])
    prompt = f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:"
    sync = llm.complete(prompt)

    responses = list(llm.stream_complete(prompt))
    assert "".join(r.delta for r in responses) == sync.text == responses[-1].text
    assert responses[-1].additional_kwargs["mode"] == "blend"  # stats ride on the last delta

    messages = [ChatMessage(role="user", content=prompt)]
    chat = llm.chat(messages)

    async def run_async():
        completion = await llm.acomplete(prompt)
        chunks = [r.delta async for r in await llm.astream_complete(prompt)]
        achat = await llm.achat(messages)
        achat_chunks = [r async for r in await llm.astream_chat(messages)]
        return completion, "".join(chunks), achat, achat_chunks

    completion, streamed, achat, achat_chunks = asyncio.run(run_async())
    assert completion.text == streamed == sync.text
    assert achat.message.content == chat.message.content
    assert "".join(r.delta for r in achat_chunks) == chat.message.content
    assert achat_chunks[-1].additional_kwargs["chunks_found"] == 1


def test_async_does_not_block_the_event_loop(llm):
    chunk = "Paris is the capital of France."
    llm.announce_chunks([chunk])
    prompt = f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:"

    async def run() -> int:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await llm.acomplete(prompt, max_new_tokens=24)
        stop.set()
        await task
        return ticks

    assert asyncio.run(run()) > 1


def test_announced_chunks_are_bounded(engine):
    llm = CacheBlendLLM.from_engine(engine, max_announced_chunks=3)
    for i in range(10):
        llm.announce_chunks([f"chunk number {i}"])
    assert len(llm.service.announced) == 3
    assert llm.service.announced.known() == ["chunk number 7", "chunk number 8", "chunk number 9"]


def test_metadata(llm, engine):
    meta = llm.metadata
    assert meta.is_chat_model is True  # the tiny tokenizer has a ChatML template
    assert meta.context_window == engine.context_window
    assert meta.num_output == 6
    assert meta.model_name == "tiny-llama"


def test_bad_store_path_fails_at_construction(engine, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValidationError, match=r"store_path=.*cannot hold a chunk KV store"):
        CacheBlendLLM.from_engine(engine, store_path=str(blocker / "store"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("recompute_ratio", 1.5, r"recompute_ratio=1.5 is out of range; allowed range is \[0.0, 1.0\]"),
        ("recompute_ratio", -0.1, r"recompute_ratio=-0.1 is out of range"),
        # refused as BlendConfig refuses it, not turned into 0.15 by pydantic first
        ("recompute_ratio", "0.15", r"recompute_ratio='0.15' must be a number in \[0.0, 1.0\]"),
        ("sink_tokens", 2.0, r"sink_tokens=2.0 must be an integer"),
        ("temperature", "0.5", r"temperature='0.5'"),
        ("selection", "nope", r"selection='nope' is not supported"),
        ("profile_layers", 0, r"profile_layers=0 is out of range"),
        ("profile_tokens", 0, r"profile_tokens=0 is out of range"),
        ("temperature", -1.0, r"temperature=-1.0 is out of range"),
        ("max_announced_chunks", 0, r"max_announced_chunks"),
        ("store_size_limit", "lots", r"size 'lots' is not understood"),
    ],
)
def test_bad_values_fail_at_construction(engine, field, value, message):
    with pytest.raises(ValidationError, match=message):
        CacheBlendLLM.from_engine(engine, **{field: value})


@pytest.mark.parametrize("option", ["max_tokens", "max_new_tokens"])
def test_an_answer_length_of_zero_is_refused_per_call(llm, option):
    # `0 or default` used to answer at the default length without a word; LangChain refuses it.
    with pytest.raises(ValueError, match=rf"CacheBlendLLM got {option}=0: the answer's length must be an integer"):
        llm.complete("Hello", **{option: 0})
    with pytest.raises(ValueError, match=r"max_new_tokens=2 and max_tokens=3 in one call: they disagree"):
        llm.complete("Hello", max_new_tokens=2, max_tokens=3)
    assert llm.complete("Hello", **{option: 2}).additional_kwargs["completion_tokens"] <= 2


def test_profile_layers_reaches_the_blend_config(engine):
    assert CacheBlendLLM.from_engine(engine, profile_layers=2).blend_config.profile_layers == 2
    assert CacheBlendLLM.from_engine(engine).blend_config.profile_layers is None
    assert CacheBlendLLM.from_engine(engine, profile_tokens=5).blend_config.profile_tokens == 5
    assert CacheBlendLLM.from_engine(engine).blend_config.profile_tokens == BlendConfig().profile_tokens


def test_check_layer_beyond_the_model_fails(engine):
    with pytest.raises(ValidationError, match=r"check_layer=9 is out of range for a model with 4 layers"):
        CacheBlendLLM.from_engine(engine, check_layer=9)


def test_unknown_model_fails_at_construction(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    with pytest.raises(ModelLoadError, match="could not load model 'no-such-org/no-such-model'"):
        CacheBlendLLM(model="no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        CacheBlendLLM(model=str(tmp_path / "missing.gguf"))


def test_bad_configuration_does_not_load_the_model(monkeypatch):
    # Field validation runs before the (slow) model load.
    def fail(*args: Any, **kwargs: Any):
        raise AssertionError("the model should not be loaded")

    monkeypatch.setattr("cacheblend_rag.engine.CacheBlendEngine.from_pretrained", fail)
    with pytest.raises(ValidationError):
        CacheBlendLLM(recompute_ratio=2.0)


def test_a_saved_calibration_is_used_unless_a_setting_is_given(engine, tmp_path):
    from cacheblend_rag.calibration.measure import calibrate
    from cacheblend_rag.bench.prompt import MusiqueExample, build_prompt
    from cacheblend_rag.testing import tiny_engine

    example = MusiqueExample(QUESTION, [], [("France", "Paris is the capital of France."),
                                            ("Fox", "The quick brown fox jumps over the lazy dog.")])
    prompts = [build_prompt(engine.tokenizer, example, passages=2)]
    result = calibrate(engine, prompts, "kv_deviation@0.3,kv_deviation@1.0", teacher_tokens=4, progress=False)
    path = result.save(tmp_path)

    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=4, calibration_dir=str(tmp_path))
    assert llm.config_source == f"calibrated: {path}" and not llm.conditions_chunks
    assert llm.blend_config == BlendConfig(**result.chosen.config)
    chunk = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."
    llm.announce_chunks([chunk])
    stats = llm.complete(f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:").additional_kwargs
    assert stats["mode"] == "blend" and stats["blend_setting"] == result.chosen.name
    assert stats["config_source"] == f"calibrated: {path}" and stats["condition_chunks"] is False
    assert llm.last_stats["config_source"] == stats["config_source"]
    # A call that sets its own ratio runs the user's setting, and says so.
    assert llm.complete(f"Context:\n{chunk}\nQuestion: {QUESTION}\nAnswer:",
                        recompute_ratio=0.5).additional_kwargs["config_source"] == "user"

    # A setting given by the user wins; another model never takes this model's result.
    mine = CacheBlendLLM.from_engine(engine, calibration_dir=str(tmp_path), recompute_ratio=0.3)
    assert mine.config_source == "user" and mine.blend_config == BlendConfig(recompute_ratio=0.3)
    assert mine.conditions_chunks
    other = CacheBlendLLM.from_engine(tiny_engine("llama", seed=1), calibration_dir=str(tmp_path))
    assert other.config_source == "built-in" and other.blend_config == BlendConfig()
