"""Streaming an answer while tools are bound, the same way in both integrations.

An answer can be a call while its text, leading whitespace aside, is empty, starts a JSON object (``{``
then, past any whitespace, a key's opening quote) or starts, even in part, the text a call of the model's
format opens with (:mod:`cacheblend_rag.serving.tool_formats`: ``<tool_call>``, ``<|python_tag|>``). In a
format whose calls may follow some text (Qwen's ``<tool_call>``), the text is shown up to where a call
opens or may be opening, and trailing whitespace is held until text follows it. :class:`ToolCallStream` holds text back only while that is so: an ordinary answer
streams from its first token that rules a call out, and the calls are read whole at the end, as the
non-streaming path reads them. Held text that turns out to be no call is released then.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from cacheblend_rag.errors import BlendInputError
from cacheblend_rag.serving.tool_formats import CACHEBLEND, ParsedAnswer, ToolFormat, tool_format
from cacheblend_rag.serving.tools import ToolCall

logger = logging.getLogger(__name__)


def could_start_call(text: str, openings: Sequence[str] = ()) -> bool:
    """Whether ``text`` can still be the start of a call: a JSON object as the model answers one, or text
    that begins, in part or whole, with one of ``openings``."""
    stripped = text.lstrip()
    if not stripped:
        return True
    if any(opening.startswith(stripped) or stripped.startswith(opening) for opening in openings):
        return True
    if stripped[0] != "{":
        return False
    after_brace = stripped[1:].lstrip()
    return not after_brace or after_brace[0] == '"'


def _opening_from(text: str, opening: str, start: int) -> int:
    """Where in ``text`` (from ``start``) ``opening`` begins, whole or cut off by the text's end; else its length."""
    found = text.find(opening, start)
    if found >= 0:
        return found
    for begin in range(max(start, len(text) - len(opening) + 1), len(text)):
        if opening.startswith(text[begin:]):
            return begin
    return len(text)


class ToolCallStream:
    """Decides, delta by delta, which text of an answer with tools bound can be shown now.

    >>> stream = ToolCallStream.for_tokenizer(tokenizer, functions)
    >>> shown = [stream.feed(delta) for delta in deltas]   # "" while the answer may be a call
    >>> rest, call = stream.finish()                        # held text to show, or the (first) call it was
    >>> stream.calls                                        # every call the answer made (parallel calls)

    ``opened``: the prompt ends with the format's call opening (a required call), so the answer is the
    rest of a call. ``parallel=False`` keeps only the first of several calls (``dropped`` counts the others).
    ``required``: an answer that is no call raises :class:`~cacheblend_rag.errors.BlendInputError` naming it.
    After :meth:`finish`, ``malformed`` says why an answer that looked like a call is none.
    """

    def __init__(self, functions: list[dict[str, Any]], tool_format: ToolFormat = CACHEBLEND, *, opened: bool = False,
                 parallel: bool = True, required: bool = False) -> None:
        self._functions = functions
        self._format = tool_format
        self._opening = tool_format.forced_opening if opened else ""
        self._parallel, self._required = parallel, required
        self._text = ""  # the answer so far (after any opening the prompt ends with)
        self._shown = 0  # how much of it was let through
        self._text_first = False  # the answer is known not to open with a call
        self.calls: list[ToolCall] = []
        self.malformed: str | None = None
        self.dropped = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, functions: list[dict[str, Any]], *, required: bool = False,
                      parallel: bool = True) -> "ToolCallStream":
        """The stream of an answer to a prompt :func:`~cacheblend_rag.serving.tool_chat.render_chat` rendered
        for ``tokenizer`` with ``functions`` bound (``required``: it ends with the format's call opening)."""
        fmt = tool_format(tokenizer)
        return cls(functions, fmt, opened=required and bool(fmt.forced_opening), parallel=parallel, required=required)

    def _held_from(self) -> int:
        """Where in the answer so far the text that may be a call begins (its length: none may)."""
        if self._opening:
            return 0
        if not self._text_first:
            if could_start_call(self._text, self._format.openings):
                return 0
            self._text_first = True
        if not self._format.calls_after_text:
            return len(self._text)
        held_from = min(_opening_from(self._text, opening, self._shown) for opening in self._format.openings)
        while held_from > self._shown and self._text[held_from - 1].isspace():
            held_from -= 1  # whitespace before a call is no part of the text either
        return held_from

    def feed(self, delta: str) -> str:
        """The text to show for ``delta``: ``""`` while the answer may still be a call."""
        if self._text_first and not self._format.calls_after_text:
            return delta
        self._text += delta
        held_from = max(self._held_from(), self._shown)
        released, self._shown = self._text[self._shown:held_from], held_from
        return released

    def finish(self) -> tuple[str, ToolCall | None]:
        """At the answer's end: the text still held that is to be shown, and the (first) call the answer
        made (``None`` for an ordinary answer); :attr:`calls` lists them all."""
        could_be_call = not self._text_first or self._format.calls_after_text
        parsed = self._format.parse(self._opening + self._text, self._functions) if could_be_call else ParsedAnswer("")
        if not parsed.calls:
            self.malformed = parsed.malformed
            if self._required:
                names = [f["name"] for f in self._functions]
                raise BlendInputError(f"a call of one of {names} was required, and the model answered "
                                      f"{self._opening + self._text!r}, which is none ({parsed.malformed or 'no call'}); "
                                      "raise max_tokens if the call was cut off, or pass tool_choice='auto'")
            rest, self._shown = self._text[self._shown:], len(self._text)
            return rest, None
        self.calls = parsed.calls
        if not self._parallel and len(parsed.calls) > 1:
            self.dropped, self.calls = len(parsed.calls) - 1, parsed.calls[:1]
            logger.info("kept the first of %d tool calls (%s); parallel tool calls are off", len(parsed.calls),
                        ", ".join(c.name for c in parsed.calls))
        call_start = max((parsed.call_start or 0) - len(self._opening), self._shown)
        rest = self._text[self._shown:call_start].rstrip()
        self._shown = len(self._text)
        return rest, self.calls[0]

    def stats(self) -> dict[str, Any]:
        """What the stats of the answer add, after :meth:`finish`: why a call-like answer is none, and how
        many parallel calls were dropped (nothing when neither happened)."""
        out: dict[str, Any] = {}
        if self.malformed:
            out["malformed_tool_call"] = self.malformed
        if self.dropped:
            out["dropped_tool_calls"] = self.dropped
        return out


__all__ = ["ToolCallStream", "could_start_call"]
