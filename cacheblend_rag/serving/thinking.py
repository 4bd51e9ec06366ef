"""Reasoning models' thinking text (``<think>...</think>``, Qwen3, DeepSeek-R1) told apart from the answer.

Both integrations hand the thinking to their framework apart from the answer (LangChain's
``additional_kwargs["reasoning_content"]``, LlamaIndex's thinking block), as the hosted providers do,
so an agent reads the answer alone. Only models whose tokenizer knows the tags are split: another
model's text is its answer, whatever it holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

OPEN, CLOSE = "<think>", "</think>"

# chat_template_kwargs keys the integrations set themselves.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                       "continue_final_message", "return_dict", "return_assistant_tokens_mask"})


class Thought(NamedTuple):
    reasoning: str  # "" when the answer holds no thinking
    answer: str


def thinks(tokenizer: Any) -> bool:
    """Whether the model writes ``<think>...</think>``: its chat template or vocabulary has the tags."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and CLOSE in template:
        return True
    # One token of the vocabulary (Qwen3, DeepSeek-R1 add it): looked up, not the whole vocabulary built.
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    token_id = convert(CLOSE) if convert is not None else None
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)


def split_thinking(text: str) -> Thought:
    """``text`` as its thinking and its answer. The opening tag may be in the prompt rather than the text
    (templates that open the thinking for the model), so a closing tag alone ends the thinking; an
    opening tag with no close (the answer ran out of tokens) makes all of it thinking."""
    stripped = text.lstrip()
    close = stripped.find(CLOSE)
    if close >= 0:
        thinking = stripped[:close]
        if OPEN in thinking and not thinking.startswith(OPEN):
            return Thought("", text)  # a tag inside the answer, not a thinking block
        return Thought(thinking.removeprefix(OPEN).strip(), stripped[close + len(CLOSE):].lstrip())
    if stripped.startswith(OPEN):
        return Thought(stripped[len(OPEN):].strip(), "")
    return Thought("", text)


class ThinkingStream:
    """A thinking model's text deltas as thinking and answer deltas, told apart as they come (what
    :func:`split_thinking` gives for the whole text, for an answer that opens with ``<think>``). Text
    that could be the start of a tag is held back until the next delta decides it. ``opened``: the prompt
    ends with ``<think>`` (templates that open the thinking for the model), so the text starts inside it."""

    def __init__(self, opened: bool = False) -> None:
        # start: nothing shown yet; thinking_start: after <think>; thinking; answer_start: after </think>; answer
        self._state = "thinking_start" if opened else "start"
        self._held = ""

    def feed(self, delta: str) -> Thought:
        """The thinking and answer text ``delta`` lets through (either may be "")."""
        text = self._held + delta
        self._held = ""
        if self._state == "start":
            opening = text.lstrip()
            if len(opening) < len(OPEN) and OPEN.startswith(opening):
                self._held = text
                return Thought("", "")
            if not opening.startswith(OPEN):
                self._state = "answer"
                return Thought("", text)
            self._state, text = "thinking_start", opening[len(OPEN):]
        if self._state == "thinking_start":
            text = text.lstrip()
            if not text:
                return Thought("", "")
            self._state = "thinking"
        if self._state == "thinking":
            close = text.find(CLOSE)
            if close >= 0:
                self._state = "answer_start"
                return Thought(text[:close].rstrip(), self.feed(text[close + len(CLOSE):]).answer)
            # Shown up to a possible start of </think>, and without trailing whitespace (dropped before it).
            keep = next((n for n in range(min(len(CLOSE) - 1, len(text)), 0, -1) if CLOSE.startswith(text[-n:])), 0)
            shown = text[:len(text) - keep].rstrip()
            self._held = text[len(shown):]
            return Thought(shown, "")
        if self._state == "answer_start":
            text = text.lstrip()
            if text:
                self._state = "answer"
        return Thought("", text)

    def finish(self) -> Thought:
        """What is still held at the end: unclosed thinking is thinking, anything else the answer."""
        held, self._held = self._held, ""
        if self._state in ("thinking_start", "thinking"):
            return Thought(held.rstrip(), "")
        return Thought("", held if self._state in ("start", "answer") else "")


def checked_template_kwargs(owner: str, kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as given, or an error naming what is wrong with it."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{owner}: chat_template_kwargs={kwargs!r} must be a dict of the chat template's "
                         "variables, e.g. {'enable_thinking': False}")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"{owner}: chat_template_kwargs sets {reserved}, which {owner} passes itself; pass "
                         "only the template's own variables, e.g. {'enable_thinking': False}")
    return kwargs


__all__ = ["CLOSE", "OPEN", "ThinkingStream", "Thought", "checked_template_kwargs", "split_thinking", "thinks"]
