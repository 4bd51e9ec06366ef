"""A conversation with tools rendered into one prompt, the same way in both integrations.

Both integrations turn their messages into the dicts Hugging Face chat templates take: ``{"role",
"content"}``, an assistant's calls as ``tool_calls=[{"id", "type": "function", "function": {"name",
"arguments"}}]`` (:func:`assistant_turn`) and a tool's result with the ``tool_call_id`` it answers and the
tool's ``name`` (:func:`tool_turn`). :func:`render_chat` renders them with the model's own format where its
template has one (the tools passed as ``tools=``, :mod:`cacheblend_rag.serving.tool_formats`), and
otherwise with the fallback: a system turn listing the tools and earlier calls written as the JSON the
model answers with.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.serving.tool_formats import openai_tools, template_text, tool_format
from cacheblend_rag.serving.tools import call_text, tools_instruction


def assistant_turn(content: str, calls: Sequence[tuple[str | None, str, Any]]) -> dict[str, Any]:
    """An assistant's message with its ``calls`` (id, tool name, arguments as a dict or JSON text)."""
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        turn["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": _as_dict(args)}}
                              for call_id, name, args in calls]
    return turn


def tool_turn(content: str, tool_call_id: str | None, name: str | None = None) -> dict[str, Any]:
    """A tool's result, answering the call ``tool_call_id`` (``name``: the tool's, found from that call when unset)."""
    turn: dict[str, Any] = {"role": "tool", "content": content}
    if tool_call_id is not None:
        turn["tool_call_id"] = tool_call_id
    if name is not None:
        turn["name"] = name
    return turn


def _as_dict(arguments: Any) -> Any:
    # Templates write arguments with `tojson`: JSON text would come out quoted twice.
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _named_results(chat: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``chat`` with each tool result's ``name`` taken from the call its ``tool_call_id`` answers, where unset."""
    names: dict[str, str] = {}
    out = []
    for turn in chat:
        for call in turn.get("tool_calls") or ():
            names[call.get("id")] = call["function"]["name"]
        if turn.get("role") == "tool" and "name" not in turn and turn.get("tool_call_id") in names:
            turn = {**turn, "name": names[turn["tool_call_id"]]}
        out.append(dict(turn))
    return out


def _one_call_each(chat: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages of several calls as consecutive messages of one call each (Llama 3's templates
    take one call per message)."""
    out = []
    for turn in chat:
        calls = turn.get("tool_calls") or []
        if len(calls) < 2:
            out.append(turn)
            continue
        out.extend({**turn, "content": turn["content"] if i == 0 else "", "tool_calls": [call]}
                   for i, call in enumerate(calls))
    return out


def _fallback_turns(chat: Sequence[dict[str, Any]], functions: Sequence[dict[str, Any]],
                    required: bool) -> list[dict[str, str]]:
    """``chat`` for a template that cannot list tools: our system turn first, calls as JSON in the content."""
    turns = [{"role": "system", "content": tools_instruction(list(functions), required)}] if functions else []
    for turn in chat:
        content = turn.get("content") or ""
        calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in turn.get("tool_calls") or ())
        turns.append({"role": turn["role"], "content": "\n".join(part for part in (content, calls) if part)})
    return turns


def render_chat(tokenizer: Any, chat: Sequence[Mapping[str, Any]], functions: Sequence[dict[str, Any]] = (), *,
                required: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of ``chat``, ending where the assistant's answer begins, with ``functions`` (the bound
    tools, :func:`~cacheblend_rag.serving.tools.tool_functions`) listed the way the model knows; when a call is
    ``required``, the prompt ends with the text the format's calls open with."""
    if not chat:
        raise BlendInputError("no messages to answer; pass at least one message")
    fmt = tool_format(tokenizer)
    turns = _named_results(chat)
    if not template_text(tokenizer):
        # Base models have no template: a plain transcript that ends where the answer begins.
        lines = [f"{t['role']}: {t['content']}" for t in _fallback_turns(turns, functions, required)]
        return "\n".join(lines) + "\nassistant:"
    tools = openai_tools(functions) if fmt.native and functions else None
    if fmt.native and fmt.one_call_per_message:
        turns = _one_call_each(turns)
    elif not fmt.native:
        turns = _fallback_turns(turns, functions, required)
    try:
        prompt = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True,
                                               **dict(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - jinja's and the template's own errors, named for the user
        if tools is None:
            raise
        names = [f["name"] for f in functions]
        raise ConfigError(f"the chat template ({fmt.name} tool format) cannot render tools {names} with these "
                          f"messages: {type(error).__name__}: {error}. Give each tool a JSON-schema 'parameters' "
                          "object, and start the conversation the way the model's template expects (Llama 3's "
                          "needs a user message)") from error
    return prompt + fmt.forced_opening if required and functions else prompt


__all__ = ["assistant_turn", "render_chat", "tool_turn"]
