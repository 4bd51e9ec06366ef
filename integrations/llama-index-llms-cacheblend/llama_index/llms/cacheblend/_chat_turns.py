"""LlamaIndex chat messages as the dicts Hugging Face chat templates take, tool calls and their ids kept.

An assistant's calls are read from ``additional_kwargs["tool_calls"]`` (this LLM's own
``{"id", "name", "arguments"}``, or OpenAI's ``{"id", "function": {"name", "arguments"}}`` from another
LLM's history) and from ``ToolCallBlock`` blocks; a tool message's ``tool_call_id`` from its
``additional_kwargs``, where ``FunctionAgent`` puts it (:mod:`cacheblend_rag.serving.tool_chat` adds the
tool's name from the call it answers).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock

from cacheblend_rag.serving import assistant_turn, tool_turn

_Call = Tuple[Optional[str], str, Any]


def _role_name(role: Any) -> str:
    return role.value if isinstance(role, MessageRole) else str(role)


def message_calls(message: ChatMessage) -> List[_Call]:
    """The calls an assistant ``message`` made: (id, tool name, arguments)."""
    calls: List[_Call] = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        if isinstance(call, dict) and "name" in call:
            calls.append((call.get("id"), call["name"], call.get("arguments", {})))
        elif isinstance(call, dict) and isinstance(call.get("function"), dict):
            calls.append((call.get("id"), call["function"]["name"], call["function"].get("arguments", {})))
        elif getattr(call, "function", None) is not None:  # an OpenAI client's ChatCompletionMessageToolCall
            calls.append((getattr(call, "id", None), call.function.name, call.function.arguments))
    if not calls:
        calls = [(b.tool_call_id, b.tool_name, b.tool_kwargs) for b in message.blocks if isinstance(b, ToolCallBlock)]
    return calls


def chat_dicts(messages: Sequence[ChatMessage]) -> List[Dict[str, Any]]:
    """``messages`` as chat-template dicts: ``{"role", "content"}``, an assistant's calls as ``tool_calls``
    with their ids, a tool result with the ``tool_call_id`` (and ``name``, where given) it answers."""
    out = []
    for message in messages:
        role, content = _role_name(message.role), message.content or ""
        calls = message_calls(message) if role == "assistant" else []
        if calls:
            out.append(assistant_turn(content, calls))
        elif role == "tool":
            kwargs = message.additional_kwargs
            out.append(tool_turn(content, kwargs.get("tool_call_id"), kwargs.get("name") or kwargs.get("tool_name")))
        else:
            out.append({"role": role, "content": content})
    return out


__all__ = ["chat_dicts", "message_calls"]
