"""Constrained decoding: answers that must be JSON of a schema (structured output, tool calls).

outlines-core does the work: it turns a JSON schema into a regular expression (properties in
the schema's order, every required one present, at most one space between tokens of JSON) and
that into an index over the vocabulary, which tells after each token which tokens may follow
(end-of-sequence only once the JSON is complete). What it needs here is the vocabulary as the
bytes each token stands for, built once per tokenizer by :func:`token_bytes`. What this module adds:
the JSON closes before the token budget runs out (a small model otherwise can repeat itself inside
a string until it is cut, and a cut answer does not parse), and an optional mode for answers that
may be text or a call.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from typing import Any, Sequence

import torch

_VOCABULARIES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Between JSON tokens: nothing or one space. A small model left free wanders into endless whitespace.
WHITESPACE = r"[ ]?"


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2 and its descendants) -> the bytes they stand for: printable
    bytes stand for themselves, the others were shifted to the characters from U+0100 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each regular token's bytes -> its ids: byte-level tokens through their table, SentencePiece
    tokens with ``▁`` as a space and ``<0xNN>`` as that byte, added tokens as their UTF-8 text."""
    byte_level = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__ == "ByteLevel"
    table = _byte_level_table()
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = set(getattr(tokenizer, "get_added_vocab", dict)())
    out: dict[bytes, list[int]] = {}
    for text, token in tokenizer.get_vocab().items():
        if token in special:
            continue
        if text in added:
            raw = text.encode()
        elif byte_level and all(c in table for c in text):
            raw = bytes(table[c] for c in text)
        elif (match := _BYTE_TOKEN.fullmatch(text)) is not None:
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = text.replace("\u2581", " ").encode()
        out.setdefault(raw, []).append(token)
    return out


def _vocabulary(tokenizer: Any, eos_id: int) -> "_Vocabulary":
    with _LOCK:
        cached = _VOCABULARIES.get(tokenizer)
        if cached is None or cached.eos_id != eos_id:
            cached = _VOCABULARIES[tokenizer] = _Vocabulary(eos_id, token_bytes(tokenizer))
        return cached


class _Vocabulary:
    """One tokenizer's outlines-core vocabulary, the indexes built over it, and the tokens an
    optional constraint keeps from a free answer's first place."""

    def __init__(self, eos_id: int, tokens: dict[bytes, list[int]]) -> None:
        from outlines_core import Vocabulary

        self.eos_id = eos_id
        self.vocabulary = Vocabulary(eos_id, tokens)
        self.indexes: dict[str, _Index] = {}
        # A free answer may not begin with JSON it was not held to, nor with bare whitespace
        # (after which a call would begin unconstrained).
        self.not_free_first = sorted(
            token for raw, ids in tokens.items() if not raw.strip() or raw.lstrip()[:1] in (b"{", b"[") for token in ids
        )


class _Index:
    """An outlines-core index with, per state, the fewest tokens that complete the JSON from it
    (``remaining``) and the most that any allowed token can leave (``worst``): where ``worst``
    fits the tokens left, every allowed token may be taken without checking each."""

    def __init__(self, regex: str, vocabulary: Any) -> None:
        from outlines_core import Index

        self.index = Index(regex, vocabulary)
        self.transitions: dict[int, dict[int, int]] = self.index.get_transitions()
        before: dict[int, list[int]] = {}
        for state, moves in self.transitions.items():
            for following in set(moves.values()):
                before.setdefault(following, []).append(state)
        finals = self.index.get_final_states()
        self.remaining = {state: 0 for state in finals}
        frontier = list(finals)
        while frontier:  # breadth first, backwards from the complete states
            following_frontier = []
            for state in frontier:
                for previous in before.get(state, ()):
                    if previous not in self.remaining:
                        self.remaining[previous] = self.remaining[state] + 1
                        following_frontier.append(previous)
            frontier = following_frontier
        unreachable = float("inf")
        self.worst = {state: max((self.remaining.get(n, unreachable) for n in moves.values()), default=0)
                      for state, moves in self.transitions.items()}

    def within(self, state: int, tokens_left: int) -> list[int]:
        """The tokens allowed in ``state`` after which the JSON can still be completed in ``tokens_left``."""
        return [token for token, following in self.transitions.get(state, {}).items()
                if self.remaining.get(following, tokens_left + 1) <= tokens_left]


def _index(tokenizer: Any, eos_id: int, regex: str) -> tuple[_Vocabulary, _Index]:
    vocabulary = _vocabulary(tokenizer, eos_id)
    with _LOCK:
        if regex not in vocabulary.indexes:
            vocabulary.indexes[regex] = _Index(regex, vocabulary.vocabulary)
        return vocabulary, vocabulary.indexes[regex]


class JsonConstraint:
    """Which tokens may come next so that the answer stays JSON of ``schema`` (``{}``: any JSON
    object) and, given a ``budget`` of tokens, is complete before it runs out. ``optional``: the
    answer may be text instead, decided by its first token (:class:`~cacheblend_rag.config.GenerationConfig`'s
    ``json_only``)."""

    def __init__(self, tokenizer: Any, eos_id: int, schema: dict[str, Any], *, budget: int | None = None,
                 optional: bool = False) -> None:
        from outlines_core import Guide
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}), WHITESPACE)
        self._vocabulary, self._index = _index(tokenizer, eos_id, regex)
        self._guide = Guide(self._index.index)
        self._budget = budget
        self._optional = optional
        self._free = False
        self._fed = 0

    @classmethod
    def from_text(cls, engine: Any, schema_text: str, eos_ids: Sequence[int], *, budget: int | None = None,
                  optional: bool = False) -> "JsonConstraint":
        tokenizer = engine.tokenizer
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else min(eos_ids)
        return cls(tokenizer, eos, json.loads(schema_text), budget=budget, optional=optional)

    @property
    def free(self) -> bool:
        """Whether the answer turned out to be text (``optional`` only)."""
        return self._free

    def mask(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """``logits`` with every token that would break the JSON (or not finish it in time) set to minus infinity."""
        for token in generated[self._fed :]:
            if self._fed == 0 and self._optional and token not in self._guide.get_tokens():
                self._free = True
            if not self._free:
                self._guide.advance(token)
            self._fed += 1
        if self._free:
            return logits
        allowed = self._guide.get_tokens()
        if self._budget is not None:
            state, tokens_left = self._guide.get_state(), self._budget - len(generated) - 1
            if self._index.worst.get(state, 0) > tokens_left:
                allowed = self._index.within(state, tokens_left) or allowed  # none fits: the JSON stays cut
        keep = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
        if self._optional and not generated:
            keep.fill_(0)
            keep[self._ids(self._vocabulary.not_free_first, logits)] = float("-inf")
        keep[self._ids(allowed, logits)] = 0
        return logits + keep

    @staticmethod
    def _ids(ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # Tokenizers may list ids past the model's output rows (added tokens); those can never be picked.
        index = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
        return index[index < logits.shape[-1]]
