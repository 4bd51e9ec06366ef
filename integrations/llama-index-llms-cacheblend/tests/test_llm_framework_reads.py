"""What LlamaIndex reads off CacheBlendLLM beside answers: the context window (checked against the
model's), the model's own tokenizer for token counting, chat template variables, a thinking model's
reasoning as the message's thinking block, and argument hints."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ThinkingBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import ChatMemoryBuffer
from pydantic import ValidationError

from cacheblend_rag.testing import script_answers, tiny_engine, tiny_thinking_engine
from llama_index.llms.cacheblend import CacheBlendLLM

SCRIPT = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def qwen3():
    return tiny_thinking_engine()


def test_context_window_is_checked_against_the_model(engine) -> None:
    with pytest.raises(ValidationError, match="context_window=-1 must be a positive number"):
        CacheBlendLLM.from_engine(engine, context_window=-1)
    with pytest.raises(ValidationError, match=r"context_window=100000 is above tiny-llama's own context window "
                                              r"of 4096 tokens; pass at most 4096"):
        CacheBlendLLM.from_engine(engine, context_window=100_000)
    assert CacheBlendLLM.from_engine(engine, context_window=1024).metadata.context_window == 1024
    assert CacheBlendLLM.from_engine(engine).metadata.context_window == 4096


def test_token_counting_uses_the_model_tokenizer(engine) -> None:
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=3)
    assert llm.tokenizer_fn("hello world") == engine.tokenize("hello world")
    memory = ChatMemoryBuffer.from_defaults(llm=llm, tokenizer_fn=llm.tokenizer_fn, token_limit=30)
    for turn in range(8):
        memory.put(ChatMessage(role="user", content=f"Question {turn} about Paris and France?"))
    kept = memory.get()
    assert 0 < len(kept) < 8
    assert sum(len(llm.tokenizer_fn(m.content)) for m in kept) <= 30


def test_a_token_counting_handler_pickles_without_the_model(engine) -> None:
    import pickle

    from llama_index.core.callbacks import TokenCountingHandler

    llm = CacheBlendLLM.from_engine(engine)
    counted = pickle.dumps(TokenCountingHandler(tokenizer=llm.tokenizer_fn))
    assert len(counted) < len(pickle.dumps(engine.tokenizer)) + 10_000  # the tokenizer, not the model's weights
    assert pickle.loads(counted).tokenizer("hello world") == engine.tokenize("hello world")


def test_chat_template_kwargs_reach_the_template(qwen3) -> None:
    question = [ChatMessage(role="user", content="What is the capital of France?")]
    plain = CacheBlendLLM.from_engine(qwen3, max_new_tokens=2)
    plain.chat(question)
    assert not plain.last_prompt.endswith("</think>\n\n")
    off = CacheBlendLLM.from_engine(qwen3, max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    off.chat(question)
    assert off.last_prompt == plain.last_prompt + "<think>\n\n</think>\n\n"
    with pytest.raises(ValidationError, match="must be a dict"):
        CacheBlendLLM.from_engine(qwen3, chat_template_kwargs=["enable_thinking"])


def scripted(engine, monkeypatch, answers: int = 1) -> CacheBlendLLM:
    """An LLM whose next calls run for real and answer with SCRIPT, as a thinking model writes it (the tiny
    model's own text is random)."""
    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=2)
    script_answers(llm, monkeypatch, *[[SCRIPT]] * answers)
    return llm


def test_thinking_is_the_messages_thinking_block(qwen3, engine, monkeypatch) -> None:
    question = [ChatMessage(role="user", content="What is the capital of France?")]
    for response in (scripted(qwen3, monkeypatch).chat(question),
                     asyncio.run(scripted(qwen3, monkeypatch).achat(question))):
        assert response.message.content == "Paris."
        thinking = [b for b in response.message.blocks if isinstance(b, ThinkingBlock)]
        assert [b.content for b in thinking] == ["The capital of France is Paris."]
        assert response.additional_kwargs["prompt_tokens"] > 0  # the stats stay where they were
    # A model whose tokenizer has no thinking tags answers with whatever text it wrote.
    assert scripted(engine, monkeypatch).chat(question).message.content == SCRIPT


@pytest.mark.parametrize(("given", "hint"), [
    ("max_tokens", "did you mean 'max_new_tokens'"),
    ("stop_sequences", "did you mean 'stop'"),
    ("trust_remote_code", "model_kwargs="),
])
def test_other_libraries_names_get_ours(engine, given: str, hint: str) -> None:
    with pytest.raises(ValidationError, match=hint):
        CacheBlendLLM.from_engine(engine, **{given: 8})


def test_a_conversation_past_the_window_says_so_before_it_runs(engine) -> None:
    """LlamaIndex has no context-overflow error type of its own: the serving layer's ContextWindowError (a
    ValueError) names the tokens and the window, and says the conversation no longer fits; the agents'
    ChatMemoryBuffer, sized from ``metadata.context_window`` and counting with the model's own tokenizer
    (``tokenizer_fn=llm.tokenizer_fn``, as the README says: LlamaIndex's default counts tiktoken's tokens, fewer
    than a small vocabulary's), trims the history so a loop never gets there."""
    from cacheblend_rag import ContextWindowError

    llm = CacheBlendLLM.from_engine(engine, max_new_tokens=2)
    window = engine.context_window
    history = [ChatMessage(role="user", content="tool result: " + "river delta " * 400),
               ChatMessage(role="assistant", content="noted")] * 4
    with pytest.raises(ContextWindowError, match=rf"more than the model's context window of {window}; the "
                                                 r"conversation no longer fits") as raised:
        llm.chat([*history, ChatMessage(role="user", content="and now?")])
    assert raised.value.tokens > raised.value.window == window
    memory = ChatMemoryBuffer.from_defaults(llm=llm, tokenizer_fn=llm.tokenizer_fn)
    for message in history:
        memory.put(message)
    kept = memory.get()
    assert len(kept) < len(history)
    assert llm.chat([*kept, ChatMessage(role="user", content="and now?")]).message.content is not None
