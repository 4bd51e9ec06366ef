"""Tiny, randomly initialised models and an offline tokenizer, for fast exact tests.

They are part of the package so that users' own tests (and the integration
tests) can exercise a full pipeline in well under a second, with no download.
The models, the tokenizer and the engine over them live in
:mod:`cacheblend_rag.models.tiny` and :mod:`cacheblend_rag.engine.tiny` (what
``tiny-*`` names load, so no production module imports this one); the
scripted answers below are for tests only.
"""

from __future__ import annotations

from typing import Any, Iterator

from cacheblend_rag.engine.tiny import tiny_engine
from cacheblend_rag.models.tiny import CHAT_TEMPLATE, save_tiny_model, tiny_config, tiny_model, tiny_tokenizer

# ChatML, with Qwen3's switch: enable_thinking=False writes an empty thinking block after the opening.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)


def tiny_thinking_engine():
    """A tiny Qwen3 whose chat template honours ``enable_thinking``, as Qwen3's does: for the integrations'
    thinking tests (``chat_template_kwargs``, reasoning kept apart from the answer)."""
    engine = tiny_engine("qwen3")
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    return engine


class ScriptedStream:
    """A served stream whose text deltas are ``pieces`` instead of the model's (a tiny model's text is
    random): the request itself still runs, so ``result()`` and the stats are its own."""

    def __init__(self, stream: Any, pieces: list[str]) -> None:
        self._stream = stream
        self._pieces = list(pieces)

    def __iter__(self) -> Iterator[str]:
        for _ in self._stream:  # the model's own deltas, decoded and dropped
            pass
        yield from self._pieces

    def result(self) -> Any:
        return self._stream.result()

    def close(self) -> None:
        self._stream.close()


def script_answers(llm: Any, monkeypatch: Any, *answers: list[str]) -> None:
    """Make ``llm`` (either integration's) answer its next calls with ``answers``, in order, delta by delta,
    through :class:`ScriptedStream`: for tests of what the integrations make of an answer's text as it
    streams (thinking, tool calls). ``monkeypatch``: pytest's, which undoes it after the test."""
    real_stream, queue = llm.service.stream, list(answers)
    monkeypatch.setattr(llm.service, "stream", lambda *a, **k: ScriptedStream(real_stream(*a, **k), queue.pop(0)))


__all__ = ["CHAT_TEMPLATE", "THINKING_TEMPLATE", "ScriptedStream", "save_tiny_model", "script_answers", "tiny_config",
           "tiny_engine", "tiny_model", "tiny_thinking_engine", "tiny_tokenizer"]
