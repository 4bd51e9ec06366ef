"""Issue 71's endless loop, on the tiny model: LangGraph's ``create_react_agent`` with the tool call forced calls
the tool every turn, and the conversation grows until it no longer fits. It must end in langchain-core's
``ContextOverflowError`` naming the prompt's tokens and the window, raised before the model runs on a prompt
past its window (the issue saw a ``BlendInputError`` on SmolLM2 at 8,469 tokens of 8,192)."""

from __future__ import annotations

import pytest
from langchain_core.exceptions import ContextOverflowError
from langchain_core.tools import tool

from langchain_cacheblend import ChatCacheBlend

prebuilt = pytest.importorskip("langgraph.prebuilt")


@tool
def search_docs(query: str) -> str:
    """Search the documents for the query."""
    return "The filter is changed every 200 litres of water, or every three months. " * 4


def test_a_forced_tool_loop_ends_in_a_context_overflow_that_names_tokens_and_window():
    llm = ChatCacheBlend(model="tiny-llama", max_tokens=96, temperature=0)
    agent = prebuilt.create_react_agent(llm.bind_tools([search_docs], tool_choice="search_docs"), [search_docs])
    with pytest.raises(ContextOverflowError) as raised:
        agent.invoke({"messages": [("user", "How often is the filter changed?")]}, {"recursion_limit": 500})
    window = llm.engine.context_window
    message = str(raised.value)
    assert f"context window of {window}" in message and "the conversation no longer fits" in message
    assert raised.value.tokens > window
