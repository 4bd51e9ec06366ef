"""An answer's text deltas as both integrations stream them: a thinking model's thinking apart from its
answer, and with tools bound, the answer held only while it may still be a call.

The thinking comes first (``<think>...</think>``, :class:`~cacheblend_rag.serving.thinking.ThinkingStream`),
and a call, if any, is what the model writes after it (:class:`~cacheblend_rag.serving.tool_stream.ToolCallStream`
sees the answer text alone), so a call made after thinking parses as one made straight away.
"""

from __future__ import annotations

from typing import Any

from cacheblend_rag.serving.thinking import OPEN, ThinkingStream, Thought, thinks
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.tools import ToolCall


class AnswerStream:
    """Decides, delta by delta, which thinking and which answer text can be shown now.

    >>> stream = AnswerStream.for_prompt(tokenizer, prompt, ToolCallStream(functions) if functions else None)
    >>> parts = [stream.feed(delta) for delta in deltas]   # Thought(reasoning, answer) per delta
    >>> last, call = stream.finish()                      # what is still held, and the call the answer was

    ``calls``: the tool-call stream the answer after the thinking goes through (``None``: no tools bound);
    ``thinking``: the thinking stream (``None``: the model does not think, its text is all answer).
    """

    def __init__(self, calls: ToolCallStream | None = None, thinking: ThinkingStream | None = None) -> None:
        self._calls = calls
        self._thinking = thinking

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt: str, calls: ToolCallStream | None = None) -> "AnswerStream":
        """The stream of an answer to ``prompt``: thinking told apart where the model thinks (its tokenizer
        knows the tags), starting inside the thinking when the prompt opens it (DeepSeek-R1's template)."""
        thinking = ThinkingStream(opened=prompt.rstrip().endswith(OPEN)) if thinks(tokenizer) else None
        return cls(calls, thinking)

    def _answer(self, text: str) -> str:
        return self._calls.feed(text) if self._calls is not None and text else text

    def feed(self, delta: str) -> Thought:
        """The thinking and the answer text ``delta`` lets through (either may be "")."""
        thought = self._thinking.feed(delta) if self._thinking is not None else Thought("", delta)
        return Thought(thought.reasoning, self._answer(thought.answer))

    def finish(self) -> tuple[Thought, ToolCall | None]:
        """At the answer's end: the thinking and answer text still held, and the call the answer (after its
        thinking) is, ``None`` for an ordinary answer."""
        thought = self._thinking.finish() if self._thinking is not None else Thought("", "")
        answer = self._answer(thought.answer)
        if self._calls is None:
            return Thought(thought.reasoning, answer), None
        rest, call = self._calls.finish()
        return Thought(thought.reasoning, answer + rest), call

    def read(self, text: str) -> tuple[Thought, ToolCall | None]:
        """A whole answer's thinking, its text and its call, as its stream would give them."""
        shown = self.feed(text)
        rest, call = self.finish()
        return Thought(shown.reasoning + rest.reasoning, shown.answer + rest.answer), call


__all__ = ["AnswerStream"]
