"""``generate_kwargs`` as HuggingFaceLLM and HuggingFacePipeline take it (issue 56, item 8), on both
integrations, at construction and per call: model.generate's keys a blend's decoding applies are mapped onto
its GenerationConfig, those that cannot apply to one streamed sequence are refused naming the key, why and
what to use, and an unknown key gets the closest spelling."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import ValidationError

from cacheblend_rag.testing import tiny_engine

CLASSES = [CacheBlendLLM, ChatCacheBlend]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", num_hidden_layers=2)


def _call(llm, prompt: str, **kwargs):
    """The answer's token ids and text, through the framework's own call."""
    if isinstance(llm, CacheBlendLLM):
        response = llm.complete(prompt, **kwargs)
        return response.raw["token_ids"], response.text
    message = llm.invoke(prompt, **kwargs)
    return None, message.content


@pytest.mark.parametrize("cls", CLASSES)
def test_generate_kwargs_at_construction_set_the_answer(cls, engine):
    llm = cls(engine=engine, generate_kwargs={
        "max_new_tokens": 5, "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.01,
        "repetition_penalty": 1.1, "no_repeat_ngram_size": 3, "seed": 4, "stop_strings": ["zz"],
        "num_beams": 1, "num_return_sequences": 1, "pad_token_id": 0, "use_cache": True})
    assert llm.generate_kwargs["no_repeat_ngram_size"] == 3  # kept as given
    # keys with a field of their own set it
    assert (llm.temperature, llm.top_k, llm.seed, getattr(llm, llm._max_tokens_field)) == (0.7, 20, 4, 5)
    assert llm.stop == ["zz"]
    gen = llm.generation_config_with(5, llm.stop, {})
    assert gen.do_sample is True and gen.no_repeat_ngram_size == 3 and gen.stop == ("zz",)
    assert _call(llm, "Hello")[1] == _call(llm, "Hello")[1]  # seeded: the same answer


@pytest.mark.parametrize("cls", CLASSES)
def test_generate_kwargs_per_call_win_over_the_objects(cls, engine):
    llm = cls(engine=engine, temperature=0.9, seed=1, **{cls._max_tokens_field: 8})
    gen = llm.generation_config_with(8, None, {"generate_kwargs": {"do_sample": False, "max_new_tokens": 3,
                                                                   "eos_token_id": [7], "stop_strings": "\n\n"}})
    assert gen.resolved().greedy and gen.max_new_tokens == 3 and gen.eos_token_id == (7,) and gen.stop == ("\n\n",)
    greedy = cls(engine=engine, temperature=0.0, **{cls._max_tokens_field: 3})
    assert _call(llm, "Hello", generate_kwargs={"do_sample": False, "max_new_tokens": 3}) == _call(greedy, "Hello")
    if cls is ChatCacheBlend:  # HuggingFacePipeline's per-call spelling, and bind
        assert _call(llm, "Hello", pipeline_kwargs={"do_sample": False, "max_new_tokens": 3}) == _call(greedy, "Hello")
        bound = llm.bind(generate_kwargs={"do_sample": False, "max_new_tokens": 2})
        assert bound.invoke("Hello").usage_metadata["output_tokens"] <= 2
    else:
        token_ids, _ = _call(llm, "Hello", generate_kwargs={"max_new_tokens": 4})
        assert len(token_ids) <= 4


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 4}, r"generate_kwargs num_beams=4: beam search keeps several candidate sequences .* sample instead"),
    ({"num_return_sequences": 2}, r"num_return_sequences=2: a call answers with one sequence; call again"),
    ({"assistant_model": "draft"}, r"assistant_model='draft': assisted \(speculative\) decoding"),
    ({"penalty_alpha": 0.6}, r"penalty_alpha=0.6: contrastive search"),
    ({"max_length": 50}, r"max_length=50: it counts the prompt's tokens too; pass max_new_tokens"),
    ({"typical_p": 0.9}, r"typical_p=0.9: a blend's decoding does not apply this transformers generation option"),
    ({"use_cache": False}, r"use_cache=False: decoding reads the blended KV cache"),
    ({"num_beam": 2}, r"unknown generate_kwargs key\(s\) 'num_beam' \(did you mean 'num_beams'\?\)"),
    ({"max_tokens": 2}, r"unknown generate_kwargs key\(s\) 'max_tokens' \(did you mean 'max_new_tokens'\?\)"),
    ({"top_p": 1.5}, r"top_p=1.5 is out of range"),
    ({"do_sample": True, "temperature": 0}, r"do_sample=True with temperature=0"),
])
def test_what_cannot_apply_is_refused_naming_the_key_why_and_what_instead(cls, engine, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        cls(engine=engine, generate_kwargs=kwargs)
    llm = cls(engine=engine, **{cls._max_tokens_field: 2})
    with pytest.raises(ValueError, match=message):
        _call(llm, "Hello", generate_kwargs=kwargs)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_setting_given_twice_must_agree(cls, engine):
    with pytest.raises(ValidationError, match=r"temperature=0.5 and generate_kwargs temperature=0.7: they disagree"):
        cls(engine=engine, temperature=0.5, generate_kwargs={"temperature": 0.7})
    with pytest.raises(ValidationError, match=r"generate_kwargs do_sample=False: they disagree"):
        cls(engine=engine, temperature=0.5, generate_kwargs={"do_sample": False})
    assert cls(engine=engine, temperature=0.7, generate_kwargs={"temperature": 0.7}).temperature == 0.7
    # do_sample=False is greedy whatever the temperature, as model.generate
    assert cls(engine=engine, generate_kwargs={"do_sample": False, "temperature": 0.7}).temperature == 0.0
    llm = cls(engine=engine)
    clash = rf"{cls._max_tokens_field}=3 and generate_kwargs max_new_tokens=5 in one call"
    with pytest.raises(ValueError, match=clash):
        _call(llm, "Hello", generate_kwargs={"max_new_tokens": 5}, **{cls._max_tokens_field: 3})
    with pytest.raises(ValueError, match=r"pass a dict of model.generate's keyword arguments"):
        _call(llm, "Hello", generate_kwargs=[("max_new_tokens", 5)])


def test_generate_kwargs_survive_serialization():
    from langchain_core.load import dumpd, load

    given = {"do_sample": False, "max_new_tokens": 7, "no_repeat_ngram_size": 2, "stop_strings": ["END"]}
    chat = ChatCacheBlend(model="tiny-llama", generate_kwargs=given)
    again = load(dumpd(chat), valid_namespaces=["langchain_cacheblend"], allowed_objects=[ChatCacheBlend])
    assert (again.generate_kwargs, again.max_tokens, again.temperature, again.stop) == (given, 7, 0.0, ["END"])
    llm = CacheBlendLLM(model="tiny-llama", generate_kwargs={"do_sample": True, "max_new_tokens": 7})
    assert CacheBlendLLM.from_dict(llm.to_dict()).generate_kwargs == llm.generate_kwargs
