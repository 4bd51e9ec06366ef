"""Streaming an answer while tools are bound, the same way in both integrations.

A call is one JSON object (:mod:`cacheblend_rag.serving.tools`), so an answer can only be a call
while its text, leading whitespace aside, is empty or starts a JSON object (``{`` then, past any
whitespace, a key's opening quote). :class:`ToolCallStream` holds text back only while that is so:
an ordinary answer streams from its first token that rules a call out, and a call is read whole at
the end, as the non-streaming path reads it. Held text that turns out to be no call is released then.
"""

from __future__ import annotations

from typing import Any

from cacheblend_rag.serving.tools import ToolCall, read_tool_call


def could_start_call(text: str) -> bool:
    """Whether ``text`` can still be the start of a call (a JSON object) as the model answers one."""
    stripped = text.lstrip()
    if not stripped:
        return True
    if stripped[0] != "{":
        return False
    after_brace = stripped[1:].lstrip()
    return not after_brace or after_brace[0] == '"'


class ToolCallStream:
    """Decides, delta by delta, which text of an answer with tools bound can be shown now.

    >>> stream = ToolCallStream(functions)
    >>> shown = [stream.feed(delta) for delta in deltas]   # "" while the answer may be a call
    >>> rest, call = stream.finish()                        # held text to show, or the call it was
    """

    def __init__(self, functions: list[dict[str, Any]]) -> None:
        self._functions = functions
        self._held = ""
        self._streaming = False  # the answer is known to be text: deltas pass straight through

    def feed(self, delta: str) -> str:
        """The text to show for ``delta``: ``""`` while the answer may still be a call."""
        if self._streaming:
            return delta
        self._held += delta
        if could_start_call(self._held):
            return ""
        self._streaming = True
        released, self._held = self._held, ""
        return released

    def finish(self) -> tuple[str, ToolCall | None]:
        """At the answer's end: the text still held that is to be shown, and the call the answer is
        (``None`` for an ordinary answer)."""
        held, self._held = self._held, ""
        call = read_tool_call(held, self._functions) if held and not self._streaming else None
        return ("", call) if call is not None else (held, None)


__all__ = ["ToolCallStream", "could_start_call"]
