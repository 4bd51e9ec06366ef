"""An OpenAI chat-completion request as a :class:`~cacheblend_rag.serving.chat_turn.ChatTurn`, or a 400 naming
the field it cannot honour.

Nothing a client asks for is dropped: a field this server cannot apply (``n > 1``, ``logprobs``,
``frequency_penalty``...) is refused unless it holds its neutral value, and every value is checked here, in
the request's own thread, before the request reaches the scheduler: the prompt is rendered as
:func:`~cacheblend_rag.serving.chat_turn.run_turn` will render it and counted on the server's tokenizer
copy, so that a prompt beyond the window is a 400 with both numbers and an absent ``max_tokens`` becomes
:data:`~cacheblend_rag.server.options.DEFAULT_MAX_TOKENS` or the room left, the smaller (a ``max_tokens``
beyond that room is capped to it, as in process: the answer then ends at the window, ``finish_reason``
"length").
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Mapping, Optional

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.reuse.prompt import chunk_texts
from cacheblend_rag.server.errors import APIError, api_error, context_length_error
from cacheblend_rag.server.protocol import ChatCompletionRequest, ChatMessage, ContentPart
from cacheblend_rag.server.state import ServerState
from cacheblend_rag.serving.arguments import BLEND_FIELDS, unknown_names_error
from cacheblend_rag.serving.chat_turn import ChatTurn, render_turn
from cacheblend_rag.serving.thinking import checked_template_kwargs
from cacheblend_rag.serving.tools import chosen_tools, constrained, tool_functions

ROLES = ("system", "user", "assistant", "tool")
# Keys of the request's "cacheblend" object besides the BlendConfig fields.
CACHEBLEND_KEYS = ("reuse", "timeout")
_PENALTY = ("is not applied here: decoding applies repetition_penalty (vLLM's; 1.0 is none, 1.1-1.3 "
            "discourages repeats), which you can send instead")
# OpenAI's fields this server cannot honour: each with the values that ask for nothing, and why not.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((None, False), "log probabilities are not returned by this server; leave logprobs out or false"),
    "top_logprobs": ((None, 0), "log probabilities are not returned by this server; leave top_logprobs out"),
    "frequency_penalty": ((None, 0, 0.0), _PENALTY),
    "presence_penalty": ((None, 0, 0.0), _PENALTY),
    "logit_bias": ((None, {}), "logit_bias is not applied by this server; leave it out"),
    "functions": ((None, []), "the legacy functions field is not supported; send tools"),
    "function_call": ((None,), "the legacy function_call field is not supported; send tool_choice"),
    "modalities": ((None, ["text"]), "this server answers in text only"),
    "audio": ((None,), "this server answers in text only"),
    "prediction": ((None,), "predicted outputs are not supported; leave prediction out"),
}
# GenerationConfig's names for the request's fields, in its error messages.
_GENERATION_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_NAMED = re.compile(r"^(\w+)=")
# Template variables the server fills in from the request's own fields.
_TEMPLATE_ARGUMENTS = frozenset({"tools", "documents"})


def refuse_unhonoured(request: ChatCompletionRequest) -> None:
    """A 400 for each field set to something this server cannot do (the first one found)."""
    if request.n is not None and request.n != 1:
        raise APIError.bad(f"n={request.n}: this server answers with one choice; leave n out or 1, and send "
                           "several requests (they are decoded as one batch) for several answers", param="n")
    for name, (neutral, why) in _REFUSED.items():
        value = getattr(request, name)
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            raise APIError.bad(f"{name}={value!r} cannot be honoured: {why}", param=name)


def requested_max_tokens(request: ChatCompletionRequest) -> Optional[int]:
    """The answer length asked for: ``max_completion_tokens``, or the older ``max_tokens``."""
    given = [(name, value) for name in ("max_completion_tokens", "max_tokens")
             if (value := getattr(request, name)) is not None]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise APIError.bad(f"max_completion_tokens={given[0][1]} and max_tokens={given[1][1]} disagree; send one",
                           param="max_tokens")
    for name, value in given:
        if value < 1:
            raise APIError.bad(f"{name}={value} must be at least 1 (the answer's tokens)", param=name)
    return given[0][1] if given else None


def _text(content: Any, where: str) -> Optional[str]:
    """A message's content as text: a string, or a list of text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        assert isinstance(part, ContentPart)
        if part.type != "text":
            raise APIError.bad(f"content parts of type {part.type!r} are not supported: this server's model reads "
                               "text; send a string or {'type': 'text', 'text': ...} parts",
                               param=f"{where}.content[{j}].type")
        if part.text is None:
            raise APIError.bad("a text part needs its text", param=f"{where}.content[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as the chat template takes it (``developer`` read as ``system``)."""
    where = f"messages[{index}]"
    role = "system" if message.role == "developer" else message.role
    if role not in ROLES:
        raise APIError.bad(f"role {message.role!r} is not one of system, developer, user, assistant, tool",
                           param=f"{where}.role")
    content = _text(message.content, where)
    if message.tool_calls and role != "assistant":
        raise APIError.bad(f"only assistant messages carry tool_calls, not {role} ones", param=f"{where}.tool_calls")
    if content is None and role != "assistant":
        raise APIError.bad(f"a {role} message needs its content", param=f"{where}.content")
    turn: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": call.id or f"call_{index}_{j}", "type": "function",
                               "function": {"name": call.function.name, "arguments": call.function.arguments}}
                              for j, call in enumerate(message.tool_calls)]
    if role == "tool":
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            turn["name"] = message.name
    return turn


def cacheblend_options(settings: Any, options: Optional[Mapping[str, Any]]
                       ) -> tuple[dict[str, Any], Optional[bool], Optional[float]]:
    """The request's ``cacheblend`` object: its BlendConfig overrides (checked on this server's setting),
    ``reuse`` (``False``: full prefill for this request) and ``timeout`` (seconds)."""
    if not options:
        return {}, None, None
    allowed = {*BLEND_FIELDS, *CACHEBLEND_KEYS}
    unknown = sorted(set(options) - allowed)
    if unknown:
        error = unknown_names_error("cacheblend", unknown, allowed, "key")
        raise APIError.bad(str(error), param=f"cacheblend.{unknown[0]}")
    reuse, timeout = options.get("reuse"), options.get("timeout")
    if reuse is not None and not isinstance(reuse, bool):
        raise APIError.bad(f"cacheblend.reuse={reuse!r} must be true, false or null", param="cacheblend.reuse")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise APIError.bad(f"cacheblend.timeout={timeout!r} must be a positive number of seconds",
                           param="cacheblend.timeout")
    overrides = {name: options[name] for name in BLEND_FIELDS if name in options}
    try:
        settings.blend_config_with(overrides)
    except ValueError as exc:
        named = _NAMED.match(str(exc))
        param = named.group(1) if named and named.group(1) in overrides else next(iter(overrides), "")
        raise APIError.bad(str(exc), param=f"cacheblend.{param}".rstrip(".")) from None
    return overrides, reuse, float(timeout) if timeout is not None else None


def response_format_of(value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``response_format`` as ChatTurn takes it: ``{"type": "text"}`` is none; json_object and json_schema pass."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return value
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError.bad("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                               param="response_format.json_schema")
        return value
    raise APIError.bad(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                       param="response_format.type")


def _tools(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], bool]:
    tools = request.tools or []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise APIError.bad(f"tool type {tool.get('type')!r} is not supported; tools are functions",
                               param=f"tools[{i}].type")
    try:
        functions = tool_functions(tools)
    except ConfigError as exc:
        raise APIError.bad(str(exc), param="tools") from None
    if not tools and request.tool_choice not in (None, "none", "auto"):
        raise APIError.bad(f"tool_choice={request.tool_choice!r} needs tools", param="tool_choice")
    try:
        return chosen_tools(functions, request.tool_choice)
    except (ConfigError, AttributeError) as exc:
        raise APIError.bad(str(exc), param="tool_choice") from None


def _answer_room(state: ServerState, tokens: int, asked: Optional[int], min_tokens: Optional[int]) -> int:
    """The answer's ``max_new_tokens``: what was asked (or the default), at most the room the window leaves,
    as the in-process path caps it (an answer cut there ends with ``finish_reason`` "length"); a 400 with the
    numbers when the prompt leaves no room, or ``min_tokens`` cannot fit."""
    window = state.context_window
    if tokens >= window:
        how = "more than" if tokens > window else "as many as"
        raise context_length_error(
            f"the prompt (messages, documents and tools as the chat template renders them) has {tokens} tokens, "
            f"{how} the model's context window of {window}, which leaves no room for the answer; send fewer or "
            "shorter documents or messages")
    room = window - tokens
    if min_tokens is not None and min_tokens > room:
        raise context_length_error(
            f"min_tokens={min_tokens} with a prompt of {tokens} tokens needs {tokens + min_tokens}, more than the "
            f"model's context window of {window}: at most {room} answer tokens fit", param="min_tokens")
    if asked is None:
        return min(max(state.config.default_max_tokens, min_tokens or 0), room)
    return min(asked, room)


def _generation(settings: Any, request: ChatCompletionRequest, max_new_tokens: int) -> GenerationConfig:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    top_k = 0 if request.top_k == -1 else request.top_k  # vLLM's -1 is off, as our 0
    sampling = {"temperature": request.temperature, "top_p": request.top_p, "top_k": top_k, "min_p": request.min_p,
                "repetition_penalty": request.repetition_penalty, "seed": request.seed,
                "min_new_tokens": request.min_tokens}
    try:
        return settings.generation_config_with(max_new_tokens, stop, sampling)
    except ValueError as exc:
        named = _NAMED.match(str(exc))
        name = named.group(1) if named else None
        raise APIError.bad(str(exc), param=_GENERATION_PARAMS.get(name, name) if name else None) from None


def prepare_turn(state: ServerState, request: ChatCompletionRequest) -> ChatTurn:
    """The turn ``request`` asks for, every field checked (blocking: run it off the event loop)."""
    settings = state.settings
    assert settings is not None
    refuse_unhonoured(request)
    asked = requested_max_tokens(request)
    if not request.messages:
        raise APIError.bad("messages is empty; send at least one message", param="messages")
    messages = [chat_message(m, i) for i, m in enumerate(request.messages)]
    overrides, reuse, timeout = cacheblend_options(settings, request.cacheblend)
    template_kwargs = None
    if request.chat_template_kwargs is not None:
        try:
            given = checked_template_kwargs("chat_template_kwargs", request.chat_template_kwargs)
        except ValueError as exc:
            raise APIError.bad(str(exc), param="chat_template_kwargs") from None
        passed = sorted(set(given) & _TEMPLATE_ARGUMENTS)
        if passed:
            raise APIError.bad(f"chat_template_kwargs sets {passed}, which the server passes itself (send tools and "
                               "documents as the request's own fields)", param="chat_template_kwargs")
        template_kwargs = {**settings.chat_template_kwargs, **given}
    response_format = response_format_of(request.response_format)
    functions, required = _tools(request)
    documents = [d if isinstance(d, str) else {"text": d.text, "title": d.title} for d in request.documents or ()]
    turn = ChatTurn(generation=GenerationConfig(), messages=messages, documents=documents,
                    tools=request.tools or [], tool_choice=request.tool_choice,
                    parallel_tool_calls=request.parallel_tool_calls is not False, response_format=response_format,
                    timeout=timeout, cache_salt=request.cache_salt or None, blend_options=overrides, reuse=reuse,
                    template_kwargs=template_kwargs, look_for_announced=False)
    try:
        prompt = render_turn(settings.service.engine.tokenizer, turn, functions, required,
                             settings.chat_template_kwargs if template_kwargs is None else template_kwargs)
        # A document's special-token strings are tokenized as text (document_special_tokens): counted so too.
        given = turn.document_list()
        tokens = state.count_tokens(prompt, chunk_texts(d.text for d in given), [d.title for d in given if d.title])
    except (BlendInputError, ConfigError) as exc:
        raise APIError.bad(str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - the chat template's own errors are the request's (400)
        raise api_error(exc, param="messages") from None
    generation = _generation(settings, request, _answer_room(state, tokens, asked, request.min_tokens))
    try:
        constrained(generation, functions, required, response_format)
    except ValueError as exc:
        raise APIError.bad(str(exc), param="response_format") from None
    # The prompt rendered here for the window check is the one run_turn would render: it is handed on as is.
    return replace(turn, generation=generation, prompt=prompt, messages=None)


__all__ = ["CACHEBLEND_KEYS", "cacheblend_options", "chat_message", "prepare_turn", "refuse_unhonoured",
           "requested_max_tokens", "response_format_of"]
