"""LangChain messages to the one prompt string the model's chat template renders, and the model's
thinking taken out of its answer."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from cacheblend_rag.errors import BlendInputError
from cacheblend_rag.serving.thinking import split_thinking, thinks
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


def render_prompt(tokenizer: Any, messages: Sequence[BaseMessage],
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text, ending with the assistant's opening, from the tokenizer's chat template
    (``template_kwargs``: its own variables, e.g. ``enable_thinking``)."""
    if not messages:
        raise BlendInputError("no messages to answer; pass at least one message")
    chat = to_chat_dicts(messages)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    # Base models have no template: a plain transcript that ends where the answer begins.
    lines = [f"{m['role']}: {m['content']}" for m in chat]
    return "\n".join(lines) + "\nassistant:"


def reasoning_apart(result: ChatResult, tokenizer: Any) -> ChatResult:
    """``result`` with a thinking model's ``<think>...</think>`` moved out of the answer into
    ``additional_kwargs["reasoning_content"]``, where langchain-ollama and langchain-deepseek put it."""
    if not thinks(tokenizer):
        return result
    generations = []
    for generation in result.generations:
        message = generation.message
        if isinstance(message.content, str):
            thought = split_thinking(message.content)
            if thought.answer != message.content:
                kwargs = {**message.additional_kwargs, "reasoning_content": thought.reasoning}
                message = message.model_copy(update={"content": thought.answer, "additional_kwargs": kwargs})
        generations.append(ChatGeneration(message=message, generation_info=generation.generation_info))
    return ChatResult(generations=generations, llm_output=result.llm_output)
