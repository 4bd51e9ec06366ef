"""LangChain messages to the one prompt string the model's chat template renders."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from langchain_core.documents import Document
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage, SystemMessage,
                                     ToolMessage)
from langchain_core.outputs import ChatGenerationChunk

from cacheblend_rag.serving import BlendInputError, assistant_turn, render_chat, tool_turn


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


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """``[{"role", "content"}]`` as Hugging Face chat templates take them: an AI message's tool calls as
    ``tool_calls`` (with their ids), a tool message with the ``tool_call_id`` it answers and its tool's
    ``name`` (:mod:`cacheblend_rag.serving.tool_chat`); other message names are dropped."""
    out = []
    for i, m in enumerate(messages):
        content = _text(m, i)
        if isinstance(m, AIMessage) and m.tool_calls:
            out.append(assistant_turn(content, [(c.get("id"), c["name"], c["args"]) for c in m.tool_calls]))
        elif isinstance(m, ToolMessage):
            out.append(tool_turn(content, m.tool_call_id, m.name))
        else:
            out.append({"role": _role(m), "content": content})
    return out


def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage], template_kwargs: Mapping[str, Any] | None = None,
                  functions: Sequence[dict[str, Any]] = (), required: bool = False) -> str:
    """The prompt text, ending with the assistant's opening, from the tokenizer's chat template
    (``template_kwargs``: its own variables, e.g. ``enable_thinking``), with the bound tools' ``functions``
    listed in the model's own format where the template has one, else in our system turn
    (:func:`cacheblend_rag.serving.tool_chat.render_chat`)."""
    if not messages:
        raise BlendInputError("no messages to answer; pass at least one message")
    return render_chat(tokenizer, to_chat_dicts(messages), functions, required=required,
                       template_kwargs=template_kwargs)


def text_chunk(text: str = "", reasoning: str = "") -> ChatGenerationChunk:
    """A chunk of answer ``text``, or of thinking, in ``additional_kwargs["reasoning_content"]`` (as
    langchain-ollama streams it; the chunks' sum holds the whole reasoning there)."""
    extra = {"reasoning_content": reasoning} if reasoning else {}
    return ChatGenerationChunk(message=AIMessageChunk(content=text, additional_kwargs=extra))


def texts_of(items: Iterable[str | Document]) -> list[str]:
    texts: list[str] = []
    for item in items:
        if isinstance(item, Document):
            texts.append(item.page_content)
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise TypeError(f"expected chunk texts or Documents, got {type(item).__name__}")
    return texts
