"""Tool calls and structured output, the same way in both integrations.

Tools come in the OpenAI function format both frameworks produce (LangChain's
``convert_to_openai_tool``, LlamaIndex's ``ToolMetadata.to_openai_tool``). Where the chat template
lists tools itself, the model is told about them there and calls in its own format
(:mod:`cacheblend_rag.serving.tool_formats`); otherwise it is told about them in a system turn
(:func:`tools_instruction`) and answers a call as one JSON object,
``{"name": ..., "arguments": {...}}``. When a call is required (``tool_choice`` "any", "required"
or a tool's name), decoding is constrained to exactly such an object of a bound tool's schema
(:class:`~cacheblend_rag.engine.constraints.JsonConstraint`), so even a small model's call
parses; otherwise (``tool_choice`` "auto") the model may answer in text, and if its first token
starts a call, the call is held to the same schema. Structured output is constrained the same
way, to the schema it asks for. Either way the JSON is closed before ``max_new_tokens`` runs out.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any, Sequence

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.errors import ConfigError

NAME, ARGUMENTS = "name", "arguments"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model answers it, and as earlier calls are written back into a conversation."""
    return json.dumps({NAME: name, ARGUMENTS: arguments})


def tool_functions(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``function`` parts of OpenAI-format tools, each with a ``parameters`` object schema."""
    functions = []
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConfigError(f"cannot use tool {tool!r}: pass tools as the frameworks make them (OpenAI format, "
                              '{"type": "function", "function": {"name", "description", "parameters"}})')
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        try:
            json.dumps(parameters)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"the parameters schema of tool {function['name']!r} is not JSON ({error}); give it a "
                              "JSON schema of plain dicts, lists, strings, numbers and booleans") from None
        functions.append({**function, "parameters": parameters})
    return functions


def chosen_tools(functions: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], bool]:
    """The tools a call may use and whether it must use one, from a ``tool_choice``: ``None``/"auto"
    (may call any), "none" (none), "any"/"required"/``True`` (must call one), a tool's name or
    ``{"type": "function", "function": {"name": ...}}`` (must call that one)."""
    if tool_choice in (None, "auto", False):
        return functions, False
    if tool_choice == "none":
        return [], False
    if tool_choice in ("any", "required", True):
        return functions, True
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else tool_choice
    picked = [f for f in functions if f["name"] == name]
    if not picked:
        raise ConfigError(f"tool_choice={tool_choice!r} names no bound tool; bound: {[f['name'] for f in functions]}")
    return picked, True


def call_schema(functions: list[dict[str, Any]], arguments_key: str = ARGUMENTS) -> dict[str, Any]:
    """JSON schema of one call of one of ``functions``, its arguments under ``arguments_key`` (Llama 3's
    native format says "parameters")."""
    options = [{"type": "object", "properties": {NAME: {"const": f["name"]}, arguments_key: f["parameters"]},
                "required": [NAME, arguments_key]} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_instruction(functions: list[dict[str, Any]], required: bool) -> str:
    """The system turn that tells the model about ``functions`` and how to call one."""
    listing = "\n".join(json.dumps({NAME: f["name"], "description": f.get("description", ""),
                                    "parameters": f["parameters"]}) for f in functions)
    how = "Answer with a call of one of them" if required else "To call one, answer with only"
    return (f"You can use these tools:\n{listing}\n{how}: a JSON object "
            f'{{"{NAME}": <tool name>, "{ARGUMENTS}": {{<its parameters>}}}}.')


def read_tool_call(text: str, functions: list[dict[str, Any]]) -> ToolCall | None:
    """The call ``text`` is (a JSON object naming a bound tool), or ``None`` if it is an ordinary answer."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get(NAME) not in {f["name"] for f in functions}:
        return None
    arguments = value.get(ARGUMENTS, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value[NAME], arguments, f"call_{uuid.uuid4().hex[:24]}")


def response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for: ``{"type": "json_object"}`` (any object), a JSON
    schema, or OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConfigError(f"response_format={response_format!r} must be a dict: a JSON schema, "
                          '{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}')
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    if response_format.get("type") == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        return response_format["json_schema"].get("schema", {"type": "object"})
    return response_format


def constrained(generation: GenerationConfig, tools: list[dict[str, Any]], required: bool,
                response_format: Any = None, arguments_key: str = ARGUMENTS) -> GenerationConfig:
    """``generation`` held to what a call asks for: a call of one of ``tools`` when one is
    ``required``, else JSON of ``response_format`` when given, else a call or text when tools are
    bound (a call's arguments under ``arguments_key``, the model's format's). Stop strings are
    dropped where the answer must be JSON (they could cut it)."""
    if tools and required:
        schema = json.dumps(call_schema(tools, arguments_key))
        return replace(generation, json_schema=schema, json_only=True, stop=())
    schema = response_schema(response_format)
    if schema is not None:
        return replace(generation, json_schema=json.dumps(schema), json_only=True, stop=())
    if tools:
        return replace(generation, json_schema=json.dumps(call_schema(tools, arguments_key)), json_only=False)
    return generation
