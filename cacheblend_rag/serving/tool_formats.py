"""The ways models write tool calls, and which one a tokenizer's chat template was trained on.

A :class:`ToolFormat` says how tools reach the model, how its calls read and how earlier calls go back into
the prompt. :func:`tool_format` picks one from the chat template:

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): the template lists the tools (``tools=``) and the model answers
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, so one answer can
  hold several calls (parallel calls), after some text or none. Calls in ```` ```json ```` blocks are read
  too (Qwen2.5-Coder writes them so).
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the template lists the tools and the model answers
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;`` or
  newlines. Its templates take one call per assistant message, so earlier parallel calls are written back
  as consecutive assistant messages.
- ``cacheblend`` (the fallback, for templates that cannot list tools, e.g. SmolLM2's): a system turn we
  write lists the tools, and a call is ``{"name": ..., "arguments": {...}}``, several on separate lines.

A native format is picked only when the template names its call syntax and a probe rendering with a tool
really shows that tool; anything else falls back to ``cacheblend``.

Constrained calls (``tool_choice`` "required" or a tool's name): decoding is held to one call's JSON object
in the format's own keys (:func:`~cacheblend_rag.serving.tools.call_schema`), and the text a call opens
with (``forced_opening``, ``<tool_call>\\n`` for hermes) is written into the prompt after the assistant's
opening, so the model continues its own format and the JSON constraint stays the one the engine knows. A
required answer is therefore one call. In "auto" mode the model is free, except that an answer that
begins as a bare JSON object is held to the call schema (as in the fallback).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cacheblend_rag.serving.tools import ToolCall

PROBE_TOOL = "cacheblend_probe_tool"


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer read for calls: the text before the first call, the calls, and why text that looked
    like a call is none (``malformed``: ``None`` when the answer is an ordinary text or parsed)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    call_start: int | None = None  # where the first call begins in the answer's text
    malformed: str | None = None


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing tool calls (see the module docstring for the ones known)."""

    name: str
    native: bool  # tools are listed by the chat template (``tools=``), not by a system turn of ours
    template_marker: str  # text of the chat template that tells this format apart
    arguments_key: str  # "arguments" or "parameters"
    openings: tuple[str, ...]  # text a call may start with (besides a bare JSON object first)
    calls_after_text: bool  # a call may follow some text (else an answer is a call from its start or none)
    forced_opening: str  # written after the assistant's opening when a call is required
    one_call_per_message: bool
    parse_calls: Callable[[str, Sequence[dict[str, Any]], "ToolFormat"], ParsedAnswer]

    def parse(self, text: str, functions: Sequence[dict[str, Any]]) -> ParsedAnswer:
        """``text`` read as an answer in this format: the calls of bound ``functions`` it holds."""
        return self.parse_calls(text, functions, self)


class _Malformed(ValueError):
    pass


def _call_of(value: Any, functions: Sequence[dict[str, Any]]) -> ToolCall:
    """One parsed JSON value as a call of a bound tool (its arguments under "arguments" or "parameters",
    an object or JSON text of one), or ``_Malformed`` saying why it is none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _Malformed(f"{json.dumps(value)[:200]} is not a call: a call is an object with a 'name'")
    names = [f["name"] for f in functions]
    if value["name"] not in names:
        raise _Malformed(f"the call names {value['name']!r}, which is no bound tool; bound: {names}")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Malformed(f"the arguments of {value['name']!r} are not JSON: {arguments[:200]!r}") from None
    if not isinstance(arguments, dict):
        raise _Malformed(f"the arguments of {value['name']!r} are {arguments!r}, not an object")
    return ToolCall(value["name"], arguments, f"call_{uuid.uuid4().hex[:24]}")


def _json_objects(text: str) -> list[Any]:
    """The JSON values ``text`` holds one after another, separated by whitespace or ``;``."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as error:  # raw_decode's one error; a plain ValueError has no .msg
            raise _Malformed(f"not JSON from {text[at:at + 200]!r} ({error.msg})") from None
        values.append(value)


def _parse_json_calls(text: str, functions: Sequence[dict[str, Any]], fmt: ToolFormat) -> ParsedAnswer:
    """Calls written as bare JSON objects at the answer's start (after an opening such as ``<|python_tag|>``)."""
    body = text.lstrip()
    for opening in fmt.openings:
        if body.startswith(opening):
            body = body[len(opening):]
    if not body.lstrip().startswith("{"):
        return ParsedAnswer(text)
    try:
        return ParsedAnswer("", [_call_of(v, functions) for v in _json_objects(body)], call_start=0)
    except _Malformed as error:
        looks_like_call = re.match(r'\s*\{\s*"name"\s*:', body) is not None
        return ParsedAnswer(text, malformed=str(error) if looks_like_call else None)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCED_JSON = re.compile(r"```json(.*?)(?:```|$)", re.DOTALL)


def _parse_fenced_calls(text: str, start: int, functions: Sequence[dict[str, Any]]) -> ParsedAnswer:
    """Calls in ```` ```json ```` blocks from ``start`` (Qwen2.5-Coder writes its calls so, as llama.cpp's
    Hermes parser also reads them). Blocks of JSON that is no call (an answer in JSON) are plain text."""
    try:
        values = [v for block in _FENCED_JSON.findall(text[start:]) for v in _json_objects(block)]
    except _Malformed as error:
        return ParsedAnswer(text, malformed=str(error) if '"name"' in text[start:] else None)
    if not values or not all(isinstance(v, dict) and "name" in v for v in values):
        return ParsedAnswer(text)
    try:
        return ParsedAnswer(text[:start], [_call_of(v, functions) for v in values], call_start=start)
    except _Malformed as error:
        return ParsedAnswer(text, malformed=str(error))


def _parse_hermes_calls(text: str, functions: Sequence[dict[str, Any]], fmt: ToolFormat) -> ParsedAnswer:
    """``<tool_call>`` blocks (the last may be left unclosed), ```` ```json ```` blocks of calls, or a bare JSON
    call as the whole answer."""
    start = text.find("<tool_call>")
    if start < 0:
        fenced = text.find("```json")
        return _parse_fenced_calls(text, fenced, functions) if fenced >= 0 else _parse_json_calls(text, functions, fmt)
    try:
        calls = [_call_of(v, functions) for block in _HERMES_BLOCK.findall(text[start:]) for v in _json_objects(block)]
    except _Malformed as error:
        return ParsedAnswer(text, malformed=str(error))
    if not calls:
        return ParsedAnswer(text, malformed="a <tool_call> block holds no call")
    return ParsedAnswer(text[:start], calls, call_start=start)


HERMES = ToolFormat("hermes", native=True, template_marker="<tool_call>", arguments_key="arguments",
                    openings=("<tool_call>", "```json"), calls_after_text=True, forced_opening="<tool_call>\n",
                    one_call_per_message=False, parse_calls=_parse_hermes_calls)
LLAMA3_JSON = ToolFormat("llama3_json", native=True, template_marker='"parameters"', arguments_key="parameters",
                         openings=("<|python_tag|>",), calls_after_text=False, forced_opening="",
                         one_call_per_message=True, parse_calls=_parse_json_calls)
CACHEBLEND = ToolFormat("cacheblend", native=False, template_marker="", arguments_key="arguments", openings=(),
                        calls_after_text=False, forced_opening="", one_call_per_message=False,
                        parse_calls=_parse_json_calls)
NATIVE_FORMATS: tuple[ToolFormat, ...] = (HERMES, LLAMA3_JSON)  # tried in this order


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template source ("" when it has none; a dict of named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def openai_tools(functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``functions`` as the OpenAI tools chat templates take (``tools=`` of ``apply_chat_template``)."""
    return [{"type": "function", "function": f} for f in functions]


_PROBE = {"name": PROBE_TOOL, "description": "probe", "parameters": {"type": "object", "properties": {}}}
_DETECTED: dict[tuple[int, str], ToolFormat] = {}


def _lists_tools(tokenizer: Any) -> bool:
    """Whether the chat template really renders a tool it is given (some name tools yet drop them)."""
    try:
        shown = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tools=openai_tools([_PROBE]),
                                              tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot take tools gets the fallback
        return False
    return isinstance(shown, str) and PROBE_TOOL in shown


def tool_format(tokenizer: Any) -> ToolFormat:
    """The call format ``tokenizer``'s chat template was trained on, or the fallback (:data:`CACHEBLEND`)."""
    template = template_text(tokenizer)
    if not template:
        return CACHEBLEND
    key = (id(tokenizer), template)  # the template may be reassigned: detect again then
    if key not in _DETECTED:
        native = [f for f in NATIVE_FORMATS if f.template_marker in template]
        _DETECTED[key] = native[0] if native and _lists_tools(tokenizer) else CACHEBLEND
    return _DETECTED[key]


__all__ = ["CACHEBLEND", "HERMES", "LLAMA3_JSON", "NATIVE_FORMATS", "ParsedAnswer", "ToolFormat", "openai_tools",
           "template_text", "tool_format"]
