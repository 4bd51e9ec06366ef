"""Recent prompt spans that repeat but open no prompt, kept as cached segments.

The text after the retrieved chunks comes back request after request: the app's system prompt
that LlamaIndex's ``CondensePlusContextChatEngine`` puts after the context, the instructions after
``{context}`` in a LangChain prompt, and in a chat every earlier turn, which both frameworks place
after the chunks. Those tokens sit behind this request's chunks, so they are no prefix and the
prefix cache cannot hold them; but their K/V from the request that last computed them is a fair
stand-in, computed behind another request's context, exactly as a chunk's K/V is computed behind a
conditioning prefix. :class:`SegmentCache` keeps it and a later prompt's span that opens with the
same tokens becomes a :class:`~cacheblend_rag.kv.segments.CachedSegment` (marked
``approximate``, so it is never taken for an exact prefix), blended with the chunks.

Spans are kept per cache salt (a request's ``cache_salt``, ``""`` for none): a span's K/V attended to
its request's documents, which may be private, so a request is served only spans of its own salt.

What is kept: each fresh span of a finished request that follows its first chunk and is at least
``min_tokens`` long, the last one with the answer's tokens after it (the next turn shows the answer
as history). Its keys are rotated back to before RoPE (a chunk's form; the rounding that adds is
far below a blend's own error). A lookup finds the remembered span sharing the longest opening
with a span of the new prompt, anchored at the span's start (where the chunks end). Bounded by
bytes, least recently used first.

A *partial* match, one that stops inside the kept span where the new prompt goes on differently,
is served only from ``min_partial_tokens`` (64) on. Such a match is fixed text before varying text,
an instruction before a new question (a conversation's history, by contrast, is matched whole: the
new span goes on past the kept one). Served short, it is the worst trade the cache can make: a few
dozen tokens saved, and the K/V right before the question, which the answer reads most, is K/V
computed behind other passages. Measured with ``benchmarks/bench_chat.py``'s conversations on
SmolLM2, where the 28-token MuSiQue instruction after each turn's passages was the one span served:
not serving it lowered KL against full prefill at turns 2, 3 and 4 from 0.068, 0.079 and 0.191 to
0.042, 0.043 and 0.153 on one conversation, for 28 more fresh tokens a turn
(research/quality_notebook.md, "Conversations: the new passages' share").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from cacheblend_rag.kv.segments import ChunkKV
from cacheblend_rag.errors import ConfigError

DEFAULT_MIN_TOKENS = 16
DEFAULT_MIN_PARTIAL_TOKENS = 64


@dataclass
class SegmentCacheStats:
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SegmentCache:
    """Spans of recent prompts with the K/V (keys before RoPE) their request computed; see the module."""

    def __init__(self, max_bytes: int, *, fingerprint: str, min_tokens: int = DEFAULT_MIN_TOKENS,
                 min_partial_tokens: int = DEFAULT_MIN_PARTIAL_TOKENS) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes={max_bytes!r} must be a number of bytes >= 0 (0 disables the segment cache)")
        for name, value in (("min_tokens", min_tokens), ("min_partial_tokens", min_partial_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.min_partial_tokens = max(min_tokens, min_partial_tokens)
        self.fingerprint = fingerprint
        # (salt, token ids) -> K/V, least recently used first: one bound for every salt
        self._spans: OrderedDict[tuple[str, tuple[int, ...]], ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = SegmentCacheStats(max_bytes=max_bytes)

    def match(self, token_ids: Sequence[int], fingerprint: str, *, max_tokens: int | None = None,
              salt: str = "") -> ChunkKV | None:
        """The remembered K/V of the longest opening of ``token_ids`` (at most ``max_tokens``) that a span
        kept under ``salt`` shares, if it is at least ``min_tokens`` long (``min_partial_tokens`` where it
        stops inside the kept span and the prompt goes on differently); ``None`` otherwise."""
        ids = self._query(token_ids, fingerprint, max_tokens)
        with self._lock:
            best, length = self._best_locked(ids, salt)
            if best is None:
                return None
            self._spans.move_to_end(best)
            chunk = self._spans[best]
            self._counts.hits += 1
            self._counts.hit_tokens += length
        return ChunkKV(ids[:length], [k[:, :length] for k in chunk.keys], [v[:, :length] for v in chunk.values],
                       model_fingerprint=chunk.model_fingerprint, approximate=True)

    def reach(self, token_ids: Sequence[int], fingerprint: str, *, max_tokens: int | None = None,
              salt: str = "") -> int:
        """How many tokens :meth:`match` would reuse (0 for none), touching nothing and counting nothing."""
        ids = self._query(token_ids, fingerprint, max_tokens)
        with self._lock:
            return self._best_locked(ids, salt)[1]

    def _query(self, token_ids: Sequence[int], fingerprint: str, max_tokens: int | None) -> tuple[int, ...]:
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        return tuple(token_ids[:limit]) if fingerprint == self.fingerprint and limit >= self.min_tokens else ()

    def _best_locked(self, ids: tuple[int, ...], salt: str) -> tuple[tuple[str, tuple[int, ...]] | None, int]:
        """The span kept under ``salt`` sharing the longest servable opening with ``ids`` and its length;
        ``(None, 0)`` if none shares ``min_tokens`` (``min_partial_tokens`` for one that stops inside both)."""
        best, length = None, 0
        for key in self._spans if ids else ():
            if key[0] != salt:
                continue
            n = _common_length(key[1], ids)
            partial = n < len(key[1]) and n < len(ids)
            if n > length and n >= (self.min_partial_tokens if partial else self.min_tokens):
                best, length = key, n
        return best, length

    def remember(self, token_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 fingerprint: str, *, salt: str = "") -> bool:
        """Keep ``token_ids`` under ``salt`` with per-layer keys (before RoPE) and values ``[kv_heads, n,
        head_dim]`` (copied). False when it is too short, of another model or larger than the bound."""
        ids = tuple(int(t) for t in token_ids)
        if fingerprint != self.fingerprint or len(ids) < self.min_tokens or not keys:
            return False
        chunk = ChunkKV(ids, [k.clone() for k in keys], [v.clone() for v in values], model_fingerprint=fingerprint,
                        approximate=True)
        size = chunk.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._spans.pop((salt, ids), None)
            if old is not None:
                self._bytes -= old.nbytes
            # A span of this salt the new one opens with says nothing the new one does not: drop it.
            for key in [(s, k) for s, k in self._spans if s == salt and len(k) <= len(ids) and ids[: len(k)] == k]:
                self._bytes -= self._spans.pop(key).nbytes
            while self._spans and self._bytes + size > self.max_bytes:
                _, evicted = self._spans.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._counts.evictions += 1
            self._spans[(salt, ids)] = chunk
            self._bytes += size
        return True

    def stats(self) -> SegmentCacheStats:
        with self._lock:
            out = SegmentCacheStats(**asdict(self._counts))
            out.entries, out.bytes = len(self._spans), self._bytes
        return out

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._bytes = 0
