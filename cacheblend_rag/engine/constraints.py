"""Constrained decoding: answers that must be JSON of a schema (structured output, tool calls).

outlines-core does the work: it turns a JSON schema into a regular expression (properties in
the schema's order, every required one present, at most one space between tokens of JSON) and
that into an index over the vocabulary, which tells after each token which tokens may follow
(end-of-sequence only once the JSON is complete). What it needs here is the vocabulary as the
bytes each token stands for, built once per tokenizer by :func:`token_bytes`. What this module adds:
the JSON closes before the token budget runs out (a small model otherwise can repeat itself inside
a string until it is cut, and a cut answer does not parse), an optional mode for answers that
may be text or a call, and a disk cache of compiled indexes: compiling one is per process and can
take seconds (any JSON object on SmolLM2's 49k tokens: 13.9 s, 26 MB), reading it back 0.08 s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

_VOCABULARIES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Allowed-id tensors kept per index (each up to the vocabulary's size: 49k ids, 400 kB, for SmolLM2).
ALLOWED_KEPT = 64
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
        # Names this vocabulary in the compiled-index cache: the same tokenizer gives the same digest anywhere.
        digest = hashlib.sha256(str(eos_id).encode())
        for raw in sorted(tokens):
            digest.update(len(raw).to_bytes(4, "little") + raw + repr(sorted(tokens[raw])).encode())
        self.digest = digest.hexdigest()
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

    def __init__(self, regex: str, vocabulary: _Vocabulary) -> None:
        self.index, self.remaining, self.worst = compiled_index(regex, vocabulary)
        # state, output rows, device -> the allowed ids as a tensor: inside a JSON string nearly every token of
        # the vocabulary is allowed, and making that list a tensor each step cost ~7 ms of a ~110 ms SmolLM2 step.
        self._allowed: OrderedDict[tuple[int, int, str], torch.Tensor] = OrderedDict()
        self._allowed_lock = threading.Lock()

    def allowed_ids(self, state: int, allowed: Callable[[], Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """The ids ``allowed()`` gives in ``state`` (a function of the state alone), below ``logits``' rows."""
        key = (state, logits.shape[-1], str(logits.device))
        with self._allowed_lock:
            found = self._allowed.get(key)
            if found is not None:
                self._allowed.move_to_end(key)
                return found
        ids = _ids_below(allowed(), logits)
        with self._allowed_lock:
            self._allowed[key] = ids
            while len(self._allowed) > ALLOWED_KEPT:
                self._allowed.popitem(last=False)
        return ids

    @functools.cached_property
    def transitions(self) -> dict[int, dict[int, int]]:
        # Read only when the budget is short (``within``): half a second for a large index.
        return self.index.get_transitions()

    def within(self, state: int, tokens_left: int) -> list[int]:
        """The tokens allowed in ``state`` after which the JSON can still be completed in ``tokens_left``."""
        return [token for token, following in self.transitions.get(state, {}).items()
                if self.remaining.get(following, tokens_left + 1) <= tokens_left]


def completion_tables(index: Any) -> tuple[dict[int, int], dict[int, float]]:
    """``remaining`` and ``worst`` of :class:`_Index` (``worst`` is infinite where a token leads nowhere complete)."""
    transitions: dict[int, dict[int, int]] = index.get_transitions()
    before: dict[int, list[int]] = {}
    for state, moves in transitions.items():
        for following in set(moves.values()):
            before.setdefault(following, []).append(state)
    finals = index.get_final_states()
    remaining = {state: 0 for state in finals}
    frontier = list(finals)
    while frontier:  # breadth first, backwards from the complete states
        following_frontier = []
        for state in frontier:
            for previous in before.get(state, ()):
                if previous not in remaining:
                    remaining[previous] = remaining[state] + 1
                    following_frontier.append(previous)
        frontier = following_frontier
    unreachable = float("inf")
    worst = {state: max((remaining.get(n, unreachable) for n in set(moves.values())), default=0)
             for state, moves in transitions.items()}
    return remaining, worst


# The compiled-index cache: <cache root>/json-indexes, or this variable's folder; "off" turns it off.
INDEX_CACHE_ENV = "CACHEBLEND_JSON_INDEX_CACHE"
_INDEX_MAGIC = b"CBJIDX2\n"


def index_cache_dir() -> Path | None:
    """Where compiled indexes are kept (``None``: not kept)."""
    explicit = os.environ.get(INDEX_CACHE_ENV)
    if explicit == "off":
        return None
    if explicit:
        return Path(explicit)
    from cacheblend_rag.models.loader import cache_root

    return cache_root() / "json-indexes"


def compiled_index(regex: str, vocabulary: _Vocabulary) -> tuple[Any, dict[int, int], dict[int, float]]:
    """outlines-core's index of ``regex`` over ``vocabulary`` and its :func:`completion_tables`, read from the
    cache when an earlier process compiled them. An entry holds the tables as JSON and the index in the
    library's own serialized form (``Index.from_binary`` reads it: nothing is unpickled), behind a digest of
    both; a damaged one is reported, removed and compiled again."""
    import xxhash
    from outlines_core import Index

    folder = index_cache_dir()
    key = hashlib.sha256(f"{_outlines_version()}\0{vocabulary.digest}\0{regex}".encode()).hexdigest()
    path = folder / f"{key[:32]}.idx" if folder is not None else None
    if path is not None and path.is_file():
        try:
            return _read_entry(path, Index)
        except (OSError, ValueError) as exc:
            logger.warning("A compiled JSON index in the cache is damaged (%s: %s); removed, compiling it again.",
                           path, exc)
            _remove(path)
    index = Index(regex, vocabulary.vocabulary)
    remaining, worst = completion_tables(index)
    if path is not None:
        tables = json.dumps({"remaining": list(remaining.items()), "worst": list(worst.items())}).encode()
        payload = index.__reduce__()[1][0]  # the bytes Index.from_binary reads back (what a pickle of it holds)
        body = len(tables).to_bytes(8, "little") + tables + payload
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(_INDEX_MAGIC + xxhash.xxh3_128_digest(body) + body)
            os.replace(temporary, path)  # whole or not at all, whoever else writes it at the same time
        except OSError as exc:  # a read-only or full cache: the index still serves this process
            logger.info("Could not keep the compiled JSON index in %s (%s); it is compiled per process.", folder, exc)
            _remove(temporary)
    return index, remaining, worst


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # not ours to remove (a read-only cache): the next process finds it damaged again
        pass


def _read_entry(path: Path, index_type: Any) -> tuple[Any, dict[int, int], dict[int, float]]:
    import xxhash

    data = path.read_bytes()
    head, digest, body = data[:8], data[8:24], data[24:]
    if head != _INDEX_MAGIC or xxhash.xxh3_128_digest(body) != digest:
        raise ValueError("its digest does not match its contents")
    size = int.from_bytes(body[:8], "little")
    tables = json.loads(body[8:8 + size])
    index = index_type.from_binary(body[8 + size:])
    return index, {int(s): int(n) for s, n in tables["remaining"]}, {int(s): float(n) for s, n in tables["worst"]}


@functools.lru_cache(maxsize=1)
def _outlines_version() -> str:
    from importlib.metadata import version

    return version("outlines_core")


def _index(tokenizer: Any, eos_id: int, regex: str) -> tuple[_Vocabulary, _Index]:
    vocabulary = _vocabulary(tokenizer, eos_id)
    with _LOCK:
        if regex not in vocabulary.indexes:
            vocabulary.indexes[regex] = _Index(regex, vocabulary)
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
        state = self._guide.get_state()
        tokens_left = None if self._budget is None else self._budget - len(generated) - 1
        if tokens_left is not None and self._index.worst.get(state, 0) > tokens_left:
            # none fits: the JSON stays cut
            index = _ids_below(self._index.within(state, tokens_left) or self._guide.get_tokens(), logits)
        else:
            index = self._index.allowed_ids(state, self._guide.get_tokens, logits)
        keep = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
        if self._optional and not generated:
            keep.fill_(0)
            keep[_ids_below(self._vocabulary.not_free_first, logits)] = float("-inf")
        keep[index] = 0
        return logits + keep


def _ids_below(ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    # Tokenizers may list ids past the model's output rows (added tokens); those can never be picked.
    index = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
    return index[index < logits.shape[-1]]
