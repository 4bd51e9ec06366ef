"""The response bodies, in OpenAI's shapes: a whole completion, a stream's chunks, usage and our stats.

Built as plain dicts (the exact keys OpenAI's clients read), from the events
:func:`~cacheblend_rag.serving.chat_turn.run_turn` yields. ``usage.prompt_tokens_details.cached_tokens`` is
always present (0 included): clients that read it need not test for it. ``cacheblend`` carries the turn's
stats (:attr:`~cacheblend_rag.serving.chat_turn.TurnEnd.stats`), made JSON-safe, with ``replica`` where the
server has a ``replica_id``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cacheblend_rag.serving.chat_turn import TurnEnd
from cacheblend_rag.serving.tools import ToolCall

# The engine's finish reasons in OpenAI's words; any tool call makes it "tool_calls".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def json_safe(value: Any) -> Any:
    """``value`` as JSON can carry it: NaN and infinities as null, tuples as lists, anything else as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def cacheblend_stats(end: TurnEnd, replica: Optional[str] = None) -> dict[str, Any]:
    """The body's ``cacheblend``: the turn's stats, JSON-safe, naming the replica that answered when it has a name."""
    stats = json_safe(end.stats)
    if replica is not None:
        stats["replica"] = replica
    return stats


def finish_reason(end: TurnEnd, calls: Sequence[ToolCall]) -> str:
    return "tool_calls" if calls else FINISH_REASONS.get(end.finish_reason, "stop")


def usage(end: TurnEnd) -> dict[str, Any]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}


def tool_calls(calls: Sequence[ToolCall], *, indexed: bool = False) -> list[dict[str, Any]]:
    """Calls as OpenAI writes them, arguments as JSON text (``index`` in a stream's delta)."""
    return [{**({"index": i} if indexed else {}), "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for i, call in enumerate(calls)]


@dataclass
class Answer:
    """What a turn's events add up to."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    end: Optional[TurnEnd] = None


def completion(answer: Answer, *, id: str, created: int, model: str, replica: Optional[str] = None
               ) -> dict[str, Any]:
    """A ``chat.completion`` body (``content`` null when the answer is only tool calls); ``replica``: the
    server's ``replica_id``."""
    assert answer.end is not None
    text = "".join(answer.text)
    message: dict[str, Any] = {"role": "assistant", "content": None if answer.calls and not text else text}
    if answer.reasoning:
        message["reasoning_content"] = "".join(answer.reasoning)
    if answer.calls:
        message["tool_calls"] = tool_calls(answer.calls)
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(answer.end, answer.calls),
                         "logprobs": None}],
            "usage": usage(answer.end), "cacheblend": cacheblend_stats(answer.end, replica)}


@dataclass
class ChunkWriter:
    """The chunks of one stream, sharing its id, creation time and model; ``usage`` is null on each but the
    last when the client asked for usage (``stream_options.include_usage``), as OpenAI writes them; ``replica``:
    the server's ``replica_id``, in the last chunk's stats."""

    model: str
    include_usage: bool = False
    replica: Optional[str] = None
    id: str = field(default_factory=completion_id)
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict[str, Any], finish: Optional[str] = None) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, end: TurnEnd) -> dict[str, Any]:
        """The last chunk (with ``include_usage``): no choices, the usage and our stats."""
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage(end), "cacheblend": cacheblend_stats(end, self.replica)}


def sse(body: Any) -> str:
    """One Server-Sent Event carrying ``body`` (a dict as JSON, or ``[DONE]``)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


__all__ = ["Answer", "ChunkWriter", "FINISH_REASONS", "cacheblend_stats", "completion", "completion_id",
           "finish_reason", "json_safe", "sse", "tool_calls", "usage"]
