"""What LangChain reads off ChatCacheBlend beside answers: token counts (offline, the model's own
tokenizer), the model profile, the stats under one key, serialization as the README shows it, argument
hints, chat template variables and a thinking model's reasoning kept apart from its answer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool
from pydantic import ValidationError

from cacheblend_rag.testing import tiny_engine, tiny_thinking_engine
from langchain_cacheblend import ChatCacheBlend

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def qwen3():
    return tiny_thinking_engine()


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def test_token_counts_use_the_model_tokenizer_offline(engine, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = ChatCacheBlend(engine=engine, max_tokens=3)
    assert llm.get_token_ids("hello world") == engine.tokenize("hello world")
    assert llm.get_num_tokens("hello world") == len(engine.tokenize("hello world")) > 0
    messages = [SystemMessage("Answer briefly."), HumanMessage("What is the capital of France?")]
    counted = llm.get_num_tokens_from_messages(messages)
    # The chat template's own tokens count: the prompt the model sees, as usage reports it.
    assert counted > sum(llm.get_num_tokens(m.content) for m in messages)
    assert counted == llm.invoke(messages).usage_metadata["input_tokens"]
    assert llm.get_num_tokens_from_messages(messages, tools=[weather]) > counted
    assert llm.get_num_tokens_from_messages([]) == 0
    custom = ChatCacheBlend(engine=engine, custom_get_token_ids=lambda text: [0] * len(text))
    assert custom.get_num_tokens("hello") == 5


def test_trim_messages_counts_with_the_model(engine) -> None:
    llm = ChatCacheBlend(engine=engine)
    history = [SystemMessage("Answer briefly.")]
    for turn in range(6):
        history += [HumanMessage(f"Question {turn} about Paris and France?"), AIMessage(f"Answer {turn}: Paris.")]
    budget = llm.get_num_tokens_from_messages(history) // 2
    trimmed = trim_messages(history, max_tokens=budget, token_counter=llm, strategy="last", include_system=True)
    assert 1 < len(trimmed) < len(history) and isinstance(trimmed[0], SystemMessage)
    assert llm.get_num_tokens_from_messages(trimmed) <= budget


def test_profile_describes_the_loaded_model(engine, qwen3) -> None:
    profile = ChatCacheBlend(engine=engine).profile
    assert profile["max_input_tokens"] == engine.context_window == 4096
    assert profile["tool_calling"] and profile["structured_output"] and profile["tool_choice"]
    assert profile["text_inputs"] and not profile["image_inputs"] and profile["reasoning_output"] is False
    assert ChatCacheBlend(engine=qwen3).profile["reasoning_output"] is True
    assert ChatCacheBlend(engine=engine, profile={"max_input_tokens": 100}).profile == {"max_input_tokens": 100}


def test_stats_ride_under_one_key(engine) -> None:
    message = ChatCacheBlend(engine=engine, max_tokens=3).invoke("Hello")
    meta = message.response_metadata
    assert set(meta) == {"model_name", "model_provider", "finish_reason", "cacheblend"}
    assert meta["cacheblend"]["mode"] in ("full_prefill", "prefix_cached") and meta["cacheblend"]["prompt_tokens"] > 0
    streamed = None
    for chunk in ChatCacheBlend(engine=engine, max_tokens=3).stream("Hello"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.response_metadata["cacheblend"]["prompt_tokens"] == meta["cacheblend"]["prompt_tokens"]


def test_the_readme_serialization_line_runs(engine) -> None:
    lines = [line.strip() for line in README.read_text().splitlines() if "load(dumpd(llm)" in line]
    assert len(lines) == 1, "the README shows one dumpd/load line"
    from langchain_core.load import dumpd, load  # noqa: F401 (the README's line uses them)

    llm = ChatCacheBlend(engine=engine, recompute_ratio=0.3, max_tokens=5)
    scope: dict[str, Any] = {"dumpd": dumpd, "load": load, "llm": llm, "ChatCacheBlend": ChatCacheBlend}
    exec(lines[0], scope)
    again = next(v for k, v in scope.items() if isinstance(v, ChatCacheBlend) and v is not llm)
    assert (again.recompute_ratio, again.max_tokens, again.model) == (0.3, 5, llm.model)


@pytest.mark.parametrize(("given", "hint"), [
    ("max_new_tokens", "did you mean 'max_tokens'"),
    ("stop_sequences", "did you mean 'stop'"),
    ("trust_remote_code", r"model_kwargs=\{'trust_remote_code': True\}"),
])
def test_other_libraries_names_get_ours(engine, given: str, hint: str) -> None:
    with pytest.raises(ValidationError, match=hint):
        ChatCacheBlend(engine=engine, **{given: 8})


def test_chat_template_kwargs_reach_the_template(qwen3) -> None:
    messages = [HumanMessage("What is the capital of France?")]
    plain = ChatCacheBlend(engine=qwen3, max_tokens=2)
    no_thinking = ChatCacheBlend(engine=qwen3, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    block = len(qwen3.tokenize("<think>\n\n</think>\n\n"))
    assert no_thinking.get_num_tokens_from_messages(messages) == plain.get_num_tokens_from_messages(messages) + block
    assert no_thinking.invoke(messages).usage_metadata["input_tokens"] == plain.get_num_tokens_from_messages(
        messages) + block
    with pytest.raises(ValidationError, match="enable_thinking"):
        ChatCacheBlend(engine=qwen3, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValidationError, match="must be a dict"):
        ChatCacheBlend(engine=qwen3, chat_template_kwargs="enable_thinking=False")


# A thinking model's reasoning kept apart from its answer, streamed or not: test_thinking_stream.py.


def test_readme_documents_the_new_fields() -> None:
    text = README.read_text()
    for name in ("chat_template_kwargs", "reasoning_content", "get_num_tokens_from_messages", "profile"):
        assert re.search(rf"\b{name}\b", text), name


def test_a_conversation_past_the_window_is_langchains_context_overflow(engine) -> None:
    from langchain_core.exceptions import ContextOverflowError

    from cacheblend_rag import ContextWindowError

    llm = ChatCacheBlend(engine=engine, max_tokens=2)
    window = engine.context_window
    history = [HumanMessage("tool result: " + "river delta " * 400), AIMessage("noted")] * 4
    with pytest.raises(ContextOverflowError, match=rf"more than the model's context window of {window}; the "
                                                   r"conversation no longer fits") as raised:
        llm.invoke([*history, HumanMessage("and now?")])
    assert isinstance(raised.value, ContextWindowError) and isinstance(raised.value, ValueError)
    assert raised.value.tokens > raised.value.window == window
