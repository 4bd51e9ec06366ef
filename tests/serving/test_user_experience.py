"""The integrations as a user moving from HuggingFaceLLM or ChatHuggingFace meets them: their
spellings, settings that are never silently dropped, a warm job that the integrations hit, reuse
that never drops to zero unnoticed, structured output and tools, token usage, serialization."""

from __future__ import annotations

import logging
import time
import typing
from typing import Literal

import pytest
import torch
from langchain_cacheblend import ChatCacheBlend
from langchain_core.messages import HumanMessage
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import BaseModel, ValidationError

from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.models.loader import resolve_device
from cacheblend_rag.serving import AnnouncedChunks, BlendService, chunk_cache_for
from cacheblend_rag.testing import save_tiny_model, tiny_engine

CHUNKS = [
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Llama saved as a model folder, as a user's own fine-tune would be."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# ------------------------------------------------------------------ 1. settings are never dropped
@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_hugging_face_spellings_are_honoured(cls, model_folder):
    llm = cls(model_name=str(model_folder), device_map="auto", torch_dtype="float32",
              model_kwargs={"attn_implementation": "eager"},
              generate_kwargs={"do_sample": False, "max_new_tokens": 7, "repetition_penalty": 1.2, "min_new_tokens": 2})
    # device_map='auto' is the one device it maps to here (tests/serving/test_first_hour.py says how it is told)
    assert llm.model == str(model_folder) and llm.device == str(resolve_device(None)) and llm.dtype == "float32"
    assert llm.engine.model.config._attn_implementation == "eager"
    assert llm.temperature == 0.0 and llm.repetition_penalty == 1.2 and llm.min_new_tokens == 2
    assert getattr(llm, llm._max_tokens_field) == 7


@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
@pytest.mark.parametrize("arguments, message", [
    ({"recompute_ration": 0.3}, r"'recompute_ration' \(did you mean 'recompute_ratio'\?\)"),
    ({"generate_kwargs": {"num_beams": 4}}, r"cannot honour generate_kwargs num_beams=4: beam search"),
    ({"device_map": "balanced"}, r"a blend runs the whole model on one device"),
    ({"model_name": "tiny-qwen2", "model": "tiny-llama"}, r"pass only model="),
    ({"storage_dtype": "int3"}, r"storage_dtype='int3' is not supported"),
])
def test_what_cannot_be_honoured_is_an_error_that_says_what_to_use(cls, engine, arguments, message):
    with pytest.raises(ValidationError, match=message):
        cls(engine=engine, **arguments)


def test_call_options_are_checked_too(engine):
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"min_new_tokens=5 is above max_new_tokens=3"):
        llm.complete("Hello", min_new_tokens=5)
    with pytest.raises(ValueError, match=r"'recompute_ration' \(did you mean 'recompute_ratio'\?\)"):
        llm.complete("Hello", recompute_ration=0.3)
    with pytest.raises(ValueError, match=r"recompute_ratio=5 is out of range"):
        llm.complete("Hello", recompute_ratio=5)
    assert llm.complete("Hello", recompute_ratio=0.5, temperature=0.0).text is not None
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    with pytest.raises(ValueError, match=r"'tempreature' \(did you mean 'temperature'\?\)"):
        chat.invoke("Hello", tempreature=0.1)


@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_a_model_that_cannot_be_found_fails_at_construction_within_seconds(cls, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache .* cannot be reached"):
        cls(model="no-such-org/no-such-model")
    assert time.monotonic() - started < 10
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        cls(model="no-such-org/no-such-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_an_unavailable_device_is_a_clear_error(cls, model_folder):
    with pytest.raises(ModelLoadError, match="torch sees no CUDA device here"):
        cls(model=str(model_folder), device="cuda")


# ------------------------------------------------------------------ 2. the warm job the integrations hit
def test_a_cli_warm_job_is_hit_by_both_integrations(model_folder, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"  {c}  " for c in CHUNKS))  # whitespace around: the same normal form
    store = tmp_path / "kv"
    assert cli_main(["warm", "--model", str(model_folder), "--path", str(store), "--no-progress", str(corpus)]) == 0
    question = f"Context:\n{CHUNKS[0]}\n\n{CHUNKS[1]}\nWho won two Nobel prizes?"
    short = {"min_blend_tokens": 0}  # two short chunks: blend them rather than answer by full prefill
    chat = ChatCacheBlend(model=str(model_folder), store_path=str(store), max_tokens=3, **short)
    chat.announce_chunks(CHUNKS)
    meta = chat.invoke([HumanMessage(question)]).response_metadata["cacheblend"]
    assert meta["cache_hits"] == 2 and meta["cache_misses"] == 0
    # prefix_cache_bytes=0: the prompt is the one just blended, whose K/V the shared prefix cache now
    # holds (approximate blocks), so with it the chunks would not be read from the store at all.
    llama = CacheBlendLLM(model=str(model_folder), store_path=str(store), max_new_tokens=3, prefix_cache_bytes=0,
                          **short)
    llama.announce_chunks(CHUNKS)
    stats = llama.chat([ChatMessage(role="user", content=question)]).additional_kwargs
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    # Computed alone (condition_chunks=False) they are another key, and --no-condition warms those.
    alone = ChatCacheBlend(model=str(model_folder), store_path=str(store), condition_chunks=False, max_tokens=3,
                           prefix_cache_bytes=0, **short)
    alone.announce_chunks(CHUNKS)
    assert alone.invoke([HumanMessage(question)]).response_metadata["cacheblend"]["cache_hits"] == 0


# ------------------------------------------------------------------ 3. reuse that drops is reported
@pytest.fixture
def service(engine):
    return BlendService(engine, chunk_cache_for(engine, None), AnnouncedChunks(16))


def _reason(service, prompt, caplog):
    with caplog.at_level(logging.WARNING):
        reason = service.prepare(prompt).reason
    return reason, [r.getMessage() for r in caplog.records]


def test_reuse_that_drops_to_zero_is_warned_once_per_cause(service, caplog):
    long_prompt = "Context: " + " ".join(["unrelated words"] * 150) + "\nQuestion?"
    reason, warnings = _reason(service, long_prompt, caplog)
    assert "no chunk text was announced" in reason and len(warnings) == 1
    caplog.clear()
    assert _reason(service, long_prompt, caplog)[1] == []  # once per cause, not per request
    service.announce([f"{CHUNKS[0]}\nSecond line."])
    escaped = str([f"{CHUNKS[0]}\nSecond line."])  # what response_mode='simple_summarize' renders
    reason, warnings = _reason(service, f"Context: {escaped}\nQuestion?", caplog)
    assert "simple_summarize" in reason and warnings
    caplog.clear()
    reason, _ = _reason(service, f"Context: {CHUNKS[0].upper()}\n  SECOND   LINE.\nQuestion?", caplog)
    assert "changed" in reason
    reason, _ = _reason(service, f"Context: {CHUNKS[0]}\nQuestion?", caplog)
    assert "only part of an announced chunk" in reason
    quiet, warnings = _reason(service, "Condense this conversation.", caplog)
    assert quiet == "no announced chunk text appears verbatim in the prompt"


def test_a_prompt_without_retrieval_is_a_full_prefill_without_a_warning(service, caplog):
    """Structured output, a long plain chat, an agent's first turn: nothing was announced and the prompt does
    not read as a RAG prompt, so the reason says the full prefill is right, and nothing is warned."""
    long_plain = "Return a JSON verdict on this claim: " + " ".join(["the sky is green"] * 80)
    reason, warnings = _reason(service, long_plain, caplog)
    assert "right for a call without retrieval" in reason and "cacheblend_retriever_tool" in reason
    assert warnings == []
    reason, warnings = _reason(service, "Context: " + " ".join(["unrelated words"] * 150), caplog)
    assert "reads as a RAG prompt" in reason and len(warnings) == 1  # an unwrapped retriever: that one warns


def test_a_retriever_that_returned_nothing_is_said_so_without_a_warning(service, caplog):
    service.announce([])  # the postprocessor or CacheBlendRetriever of a retrieval that found nothing
    prompt = "Context: " + " ".join(["unrelated words"] * 150) + "\nQuestion?"
    reason, warnings = _reason(service, prompt, caplog)
    assert "returned nothing" in reason and warnings == []
    service.announce([f"{CHUNKS[0]}\nSecond line."])
    service.announce([])  # chunks known from before, none this time
    reason, warnings = _reason(service, prompt, caplog)
    assert "returned nothing" in reason and warnings == []


# ------------------------------------------------------------------ 4. structured output and tools
class Verdict(BaseModel):
    """A verdict on a claim."""

    verdict: Literal["true", "false"]
    confidence: Literal["low", "high"]


def set_mode(mode: Literal["fast", "safe"]) -> str:
    """Switch the pipeline's mode."""
    return mode


set_mode.__annotations__ = typing.get_type_hints(set_mode)  # resolved: LlamaIndex reads them as they are


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output_is_always_valid_json(engine, method):
    llm = ChatCacheBlend(engine=engine, max_tokens=120)  # the tiny model's tokens are short
    if method == "json_mode":
        result = llm.with_structured_output(Verdict.model_json_schema(), method=method).invoke("A claim.")
        assert isinstance(result, dict)
    else:
        result = llm.with_structured_output(Verdict, method=method).invoke("Is the sky green?")
        assert isinstance(result, Verdict)
    raw = llm.with_structured_output(Verdict, method=method, include_raw=True).invoke("Claim?")
    assert raw["parsing_error"] is None or method == "json_mode"


def test_langchain_tool_calls_follow_the_tool_schema(engine):
    """A random tiny model, constrained: whatever it picks is a valid call of the bound tool (a real
    model's calls are checked by LangChain's standard suite on SmolLM2)."""
    llm = ChatCacheBlend(engine=engine, max_tokens=80).bind_tools([set_mode], tool_choice="any")
    message = llm.invoke("Switch to the safe mode.")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "set_mode" and call["args"]["mode"] in ("fast", "safe") and call["id"]
    streamed = None
    for chunk in llm.stream("Switch to the safe mode."):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "set_mode"
    with pytest.raises(ValueError, match="names no bound tool"):
        ChatCacheBlend(engine=engine).bind_tools([set_mode], tool_choice="other_function")


def test_llamaindex_function_calling_and_structured_predict(engine):
    from llama_index.core.prompts import PromptTemplate

    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=120)
    assert llm.metadata.is_function_calling_model
    tool = FunctionTool.from_defaults(fn=set_mode)
    response = llm.chat_with_tools([tool], user_msg="Switch to the safe mode.", tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "set_mode" and selection.tool_kwargs["mode"] in ("fast", "safe")
    verdict = llm.structured_predict(Verdict, PromptTemplate("Judge the claim: {claim}"), claim="Water is wet.")
    assert isinstance(verdict, Verdict)


# ------------------------------------------------------------------ 5. usage, serialization, sampling
def test_llamaindex_token_counting_sees_the_tokens_the_model_saw(engine):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=lambda text: [0] * 4)  # a wrong count, if it were used
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=5, callback_manager=CallbackManager([counter]))
    response = llm.complete("How many tokens does this prompt have?")
    assert counter.prompt_llm_token_count == response.raw["usage"]["prompt_tokens"] > 4
    assert counter.completion_llm_token_count == response.raw["usage"]["completion_tokens"]


def test_langchain_chat_model_serializes_and_loads(engine):
    from langchain_core.load import dumpd, load

    llm = ChatCacheBlend(model="tiny-llama", recompute_ratio=0.3, max_tokens=9)
    data = dumpd(llm)
    assert data["type"] == "constructor" and data["kwargs"]["recompute_ratio"] == 0.3
    again = load(data, valid_namespaces=["langchain_cacheblend"], allowed_objects=[ChatCacheBlend])
    assert again.model_dump() == llm.model_dump()


def test_sampling_honours_the_models_generation_config_and_repetition_penalty(engine, monkeypatch):
    prompt = [engine.tokenize("The quick brown fox")]
    greedy = engine.generate(prompt, max_new_tokens=12).token_ids
    monkeypatch.setattr(engine.model.generation_config, "do_sample", True)
    monkeypatch.setattr(engine.model.generation_config, "temperature", 1.5, raising=False)
    sampled = engine.generate(prompt, max_new_tokens=12, seed=3).token_ids
    assert sampled != greedy  # the model's config samples, so unset fields sample too
    assert engine.generate(prompt, max_new_tokens=12, seed=3).token_ids == sampled
    assert engine.generate(prompt, max_new_tokens=12, temperature=0.0).token_ids == greedy
    penalised = engine.generate(prompt, max_new_tokens=12, temperature=0.0, repetition_penalty=3.0).token_ids
    assert penalised != greedy and len(set(penalised)) >= len(set(greedy))
