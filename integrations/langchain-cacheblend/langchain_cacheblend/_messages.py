"""LangChain messages to the one prompt string the model's chat template renders."""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from cacheblend_rag.errors import BlendInputError
from cacheblend_rag.serving.tools import call_text


def _role(message: BaseMessage) -> str:
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, ChatMessage):
        return message.role
    raise BlendInputError(
        f"ChatCacheBlend cannot render a {type(message).__name__}; pass system, human, AI, tool or chat messages"
    )


def _text(message: BaseMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("reasoning", "thinking"):
            continue  # earlier model reasoning is not part of the prompt
        elif isinstance(block, dict) and block.get("type") in ("tool_call", "tool_use", "function_call"):
            continue  # an AI message's calls are written from its tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BlendInputError(
                f"message {index} holds a {kind!r} content block; ChatCacheBlend reads text only, "
                "so pass the content as text"
            )
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` as chat templates expect. An AI message's tool calls are written as the
    JSON the model answers a call with (``cacheblend_rag.serving.tools``); message names are dropped."""
    out = []
    for i, m in enumerate(messages):
        content = _text(m, i)
        if isinstance(m, AIMessage) and m.tool_calls:
            calls = "\n".join(call_text(c["name"], c["args"]) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": _role(m), "content": content})
    return out


def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage]) -> str:
    """The prompt text, ending with the assistant's opening, from the tokenizer's chat template."""
    if not messages:
        raise BlendInputError("no messages to answer; pass at least one message")
    chat = to_chat_dicts(messages)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # Base models have no template: a plain transcript that ends where the answer begins.
    lines = [f"{m['role']}: {m['content']}" for m in chat]
    return "\n".join(lines) + "\nassistant:"
