"""A running ``cacheblend-rag serve`` as the integrations' engine: the same turns, over HTTP.

:class:`RemoteChat` sends a :class:`~cacheblend_rag.serving.chat_turn.ChatTurn` to the server's
``/v1/chat/completions`` (always streaming, usage included) and yields the events
:func:`~cacheblend_rag.serving.chat_turn.run_turn` yields in process, so an integration reads a turn the same
way whether its model is loaded here or there (``base_url=...``). The server renders the messages with its
model's chat template, constrains tool calls and structured output, and reports the stats in its
``cacheblend`` object, which become the :class:`~cacheblend_rag.serving.chat_turn.TurnEnd`'s.

The server's errors come back as the exceptions the in-process path raises: a prompt beyond the window
as :class:`~cacheblend_rag.errors.BlendInputError`, a bad value as :class:`~cacheblend_rag.errors.ConfigError`,
a full queue as :class:`~cacheblend_rag.serving.scheduler.SchedulerFullError`, a timeout as ``TimeoutError``;
a refused key as ``PermissionError``; an unreachable server as ``ConnectionError``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import fields
from typing import Any, Iterator, Mapping, Sequence

import httpx

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.errors import BlendInputError, CacheBlendError, ConfigError
from cacheblend_rag.serving.scheduler import SchedulerFullError
from cacheblend_rag.serving.chat_turn import ChatTurn, Document, ReasoningDelta, TextDelta, ToolCalls, TurnEnd, TurnEvent
from cacheblend_rag.serving.tools import ToolCall

# GenerationConfig fields sent as the OpenAI / vLLM request fields of the same meaning.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "seed": "seed", "min_new_tokens": "min_tokens"}
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop"}
# The server's error codes (docs/serving.md) as the status it answers them with before a stream begins.
_STATUS_OF_CODE = {"context_length_exceeded": 400, "kv_budget_exceeded": 400, "chat_template_error": 400,
                   "invalid_api_key": 401, "model_not_found": 404, "queue_full": 429, "model_loading": 503,
                   "cancelled": 503, "timeout": 504}


class RemoteServerError(CacheBlendError, RuntimeError):
    """The server failed a request in a way no in-process exception stands for (a 5xx)."""


def _error(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Exception:
    """The exception the in-process path would raise for the server's error ``body``."""
    error = body.get("error", body) if isinstance(body, dict) else {"message": str(body)}
    message = str(error.get("message") or error)
    code, param = error.get("code"), error.get("param")
    text = f"the server answered {status}: {message}"
    if code == "context_length_exceeded" or (status == 400 and param in ("messages", "documents")):
        return BlendInputError(text)
    if status == 400 or status == 404 or status == 422:
        return ConfigError(text)
    if status == 401 or status == 403:
        return PermissionError(f"{text} (pass api_key=..., or set $CACHEBLEND_API_KEY, to the server's key)")
    if status == 429:
        retry = (headers or {}).get("retry-after")
        return SchedulerFullError(f"{text}" + (f" (retry after {retry} s)" if retry else ""))
    if status in (408, 504) or code == "timeout":
        return TimeoutError(text)
    return RemoteServerError(text)


def request_body(turn: ChatTurn, model: str | None, blend_options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body of ``turn`` (streamed, with usage)."""
    if turn.messages is None:
        if turn.prompt is None:
            raise BlendInputError("no messages to answer; pass at least one message")
        messages: list[dict[str, Any]] = [{"role": "user", "content": turn.prompt}]
    else:
        messages = [_wire_message(m) for m in turn.messages]
    generation = turn.generation
    body: dict[str, Any] = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                            "max_tokens": generation.max_new_tokens}
    if model:
        body["model"] = model
    for name, wire in _SAMPLING.items():
        value = getattr(generation, name)
        if value is not None and not (name == "min_new_tokens" and value == 0):
            body[wire] = value
    if generation.stop:
        body["stop"] = list(generation.stop)
    _refuse_local_only(generation)
    if turn.documents:
        body["documents"] = [{"text": d.text, **({"title": d.title} if d.title else {})} for d in turn.document_list()]
    if turn.tools:
        body["tools"] = [dict(t) for t in turn.tools]
        if turn.tool_choice is not None:
            body["tool_choice"] = _wire_tool_choice(turn.tool_choice)
        if not turn.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if turn.response_format is not None:
        body["response_format"] = _wire_response_format(turn.response_format)
    if turn.cache_salt:
        body["cache_salt"] = turn.cache_salt
    if turn.template_kwargs:
        body["chat_template_kwargs"] = dict(turn.template_kwargs)
    extension = {**dict(blend_options), **dict(turn.blend_options)}
    if turn.reuse is not None:
        extension["reuse"] = turn.reuse
    if turn.timeout is not None:
        extension["timeout"] = turn.timeout
    if extension:
        body["cacheblend"] = extension
    return body


def _refuse_local_only(generation: GenerationConfig) -> None:
    """Settings a server request cannot carry: an error naming them, never silently dropped."""
    defaults = GenerationConfig()
    local = [f.name for f in fields(GenerationConfig)
             if f.name not in _SAMPLING and f.name not in ("max_new_tokens", "stop", "json_schema", "json_only")
             and getattr(generation, f.name) != getattr(defaults, f.name)]
    if local:
        raise ConfigError(f"{local} cannot be sent to a server (base_url=...): it takes max_tokens, stop, "
                          f"{sorted(_SAMPLING)} only; drop them, or load the model in process (no base_url)")


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-template dict as an OpenAI message: a call's arguments as JSON text."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_call_id")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": _json_text(c["function"].get("arguments"))}}
                             for c in message["tool_calls"]]
    if out.get("content") is None:
        out["content"] = ""
    return out


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})


def _wire_tool_choice(choice: Any) -> Any:
    if choice in ("any", True):
        return "required"
    if choice is False:
        return "auto"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _wire_response_format(response_format: Any) -> Any:
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema", "text"):
        return response_format
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": response_format}}


class RemoteChat:
    """A client of one ``cacheblend-rag serve``: turns, warms and the model's description.

    ``timeout``: seconds to wait for the server to connect and for each streamed chunk (``None``: no bound;
    a turn's own ``timeout`` is the server's to enforce)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout: float | None = None) -> None:
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else f"{base}/v1"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers,
                                    timeout=httpx.Timeout(timeout, connect=timeout if timeout else 30.0))
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RemoteChat({self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ requests
    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TimeoutException as error:
            raise TimeoutError(f"{self.base_url}{path} did not answer in time: {error}") from error
        except httpx.TransportError as error:
            raise ConnectionError(f"cannot reach the cacheblend-rag server at {self.base_url} ({error}); start it "
                                  "with `cacheblend-rag serve`, or drop base_url to load the model in process") from error
        if response.status_code >= 400:
            raise _error(response.status_code, _json_or_text(response), response.headers)
        return response

    def model_info(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it (``id``, ``max_model_len``), read once."""
        if self._info is None:
            listed = self._send("GET", "/models").json().get("data") or []
            if not listed:
                raise RemoteServerError(f"{self.base_url}/models lists no model")
            named = [m for m in listed if self.model is None or m.get("id") == self.model]
            if not named:
                raise ConfigError(f"the server at {self.base_url} serves {[m.get('id') for m in listed]}, not "
                                  f"model={self.model!r}; pass one of those names or leave model unset")
            self._info = named[0]
        return self._info

    @property
    def context_window(self) -> int:
        return int(self.model_info().get("max_model_len") or 0)

    def warm(self, documents: Sequence[Document | Mapping[str, Any] | str], *, cache_salt: str | None = None
             ) -> dict[str, Any]:
        """Precompute ``documents`` into the server's store: ``{"computed", "already_stored", ...}``."""
        docs = [Document.of(d, i) for i, d in enumerate(documents)]
        body: dict[str, Any] = {"documents": [{"text": d.text, **({"title": d.title} if d.title else {})} for d in docs]}
        if cache_salt:
            body["cache_salt"] = cache_salt
        return self._send("POST", "/documents/warm", json=body).json()

    def run_turn(self, turn: ChatTurn, blend_options: Mapping[str, Any] | None = None) -> Iterator[TurnEvent]:
        """``turn`` answered by the server, as the events :func:`run_turn` yields in process; closing the
        generator early closes the connection, which cancels the request there."""
        body = request_body(turn, self.model, blend_options or {})
        try:
            with self._client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response.status_code, _json_or_text(response), response.headers)
                yield from _events(response.iter_lines())
        except httpx.TimeoutException as error:
            raise TimeoutError(f"the server at {self.base_url} sent nothing in time: {error}") from error
        except httpx.TransportError as error:
            raise ConnectionError(f"lost the cacheblend-rag server at {self.base_url}: {error}") from error


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def sse_chunks(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a chat completion's Server-Sent Events (``data: {...}`` lines), up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _events(lines: Iterator[str]) -> Iterator[TurnEvent]:
    """Server-sent chunks as turn events; the usage chunk (choices empty) becomes the TurnEnd."""
    finish, calls = "stop", {}
    for chunk in sse_chunks(lines):
        if "error" in chunk:  # after the stream began: the error body alone, its code says what it was
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            raise _error(_STATUS_OF_CODE.get(error.get("code"), 500), chunk)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield ReasoningDelta(delta["reasoning_content"])
            if delta.get("content"):
                yield TextDelta(delta["content"])
            for call in delta.get("tool_calls") or ():
                _merge_call(calls, call)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage and not chunk.get("choices"):
            if calls:
                yield ToolCalls([_tool_call(c) for _, c in sorted(calls.items())])
            stats = dict(chunk.get("cacheblend") or {})
            details = usage.get("prompt_tokens_details") or {}
            yield TurnEnd(stats.get("finish_reason") or _FINISH.get(finish, finish), int(usage["prompt_tokens"]),
                          int(usage["completion_tokens"]), int(details.get("cached_tokens") or 0), stats)
            return
    raise RemoteServerError("the server's stream ended without its usage chunk (a server of another kind, or "
                            "one that failed mid-answer)")


def _merge_call(calls: dict[int, dict[str, Any]], part: Mapping[str, Any]) -> None:
    """OpenAI streams a call in pieces keyed by ``index``: name and id once, arguments appended."""
    index = int(part.get("index") or 0)
    held = calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
    function = part.get("function") or {}
    held["id"] = part.get("id") or held["id"]
    held["name"] += function.get("name") or ""
    held["arguments"] += function.get("arguments") or ""


def _tool_call(held: Mapping[str, Any]) -> ToolCall:
    try:
        arguments = json.loads(held["arguments"] or "{}")
    except ValueError as error:
        raise RemoteServerError(f"the server sent a call of {held['name']!r} whose arguments are no JSON: "
                                f"{held['arguments']!r:.200}") from error
    return ToolCall(held["name"], arguments, held["id"] or f"call_{uuid.uuid4().hex[:24]}")


__all__ = ["RemoteChat", "RemoteServerError", "request_body", "sse_chunks"]
