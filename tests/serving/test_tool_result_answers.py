"""An agent's turn after a tool result never answers ``''`` (issue 71): LlamaIndex's FunctionAgent on
Qwen2.5-Coder-1.5B returned an empty final response when the model ended its turn at once after the tool
message, and every framework's loop takes that empty text for the answer. Reproduced on a tiny model whose
every greedy token is the end of the turn: after a tool message the answer holds at least one token (in
process, through both integrations), while after a user message it may still be empty (nothing forced there),
and a caller's own ``min_new_tokens`` is kept."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.serving import CacheBlendSettings, ChatTurn, TextDelta, run_turn
from cacheblend_rag.serving.chat_turn import answers_tool_results
from cacheblend_rag.testing_tools import tiny_tool_engine

CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": {"query": "lighthouse"}}}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the passages.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
AFTER_TOOL = [{"role": "user", "content": "Who built the lighthouse?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "name": "search", "content": "The harbour guild built it."}]


@pytest.fixture(scope="module")
def ends_at_once():
    """A tiny Qwen2 with a hermes template whose lm_head makes an end-of-turn id every greedy token."""
    engine = tiny_tool_engine("qwen2.5")
    eos = sorted(eos_token_ids(engine))[0]
    engine.model.lm_head.register_forward_hook(lambda module, args, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    return CacheBlendSettings(engine=engine, min_blend_tokens=0)


def answer(settings, messages) -> str:
    config = settings.generation_config_with(8, None, {"temperature": 0})
    events = run_turn(settings, ChatTurn(messages=messages, tools=TOOLS, generation=config))
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_after_a_tool_result_the_answer_is_never_empty(ends_at_once):
    assert answer(ends_at_once, AFTER_TOOL[:1]) == ""  # the model's own choice where nothing is forced
    assert answer(ends_at_once, AFTER_TOOL) != ""


def test_a_callers_min_new_tokens_is_kept_and_a_user_turn_is_left_alone():
    after_tool = ChatTurn(messages=AFTER_TOOL, generation=GenerationConfig(max_new_tokens=8, min_new_tokens=3))
    assert answers_tool_results(after_tool).min_new_tokens == 3
    user = ChatTurn(messages=AFTER_TOOL[:1], generation=GenerationConfig(max_new_tokens=8))
    assert answers_tool_results(user).min_new_tokens == 0


def test_llamaindex_and_langchain_answer_a_tool_result_with_text(ends_at_once):
    from langchain_cacheblend import ChatCacheBlend
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from llama_index.core.llms import ChatMessage, MessageRole
    from llama_index.llms.cacheblend import CacheBlendLLM

    engine = ends_at_once.service.engine
    llama = CacheBlendLLM(engine=engine, temperature=0, max_new_tokens=8)
    messages = [ChatMessage(role=MessageRole.USER, content="Who built the lighthouse?"),
                ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [
                    {"id": "call_1", "name": "search", "arguments": {"query": "lighthouse"}}]}),
                ChatMessage(role=MessageRole.TOOL, content="The harbour guild built it.",
                            additional_kwargs={"tool_call_id": "call_1", "name": "search"})]
    assert llama.chat(messages).message.content
    chat = ChatCacheBlend(engine=engine, temperature=0, max_tokens=8)
    reply = chat.invoke([HumanMessage("Who built the lighthouse?"),
                         AIMessage("", tool_calls=[{"name": "search", "args": {"query": "lighthouse"}, "id": "call_1"}]),
                         ToolMessage("The harbour guild built it.", tool_call_id="call_1")])
    assert reply.content
