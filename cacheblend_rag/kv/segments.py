"""The pieces a blended prompt is made of: fresh token runs, cached chunks and a cached prefix."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from cacheblend_rag.errors import BlendInputError


def as_token_ids(values: Sequence[int], what: str = "token ids") -> tuple[int, ...]:
    """``values`` as a tuple of ints; a float, bool or anything else that is not an integer is an error
    (``int(2.7)`` would quietly make it token 2)."""
    ids = tuple(values)
    if set(map(type, ids)) <= {int}:  # the common case, checked in C: a chat's prompt holds thousands
        return ids
    out: list[int] = []
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise BlendInputError(f"{what}[{i}] is {value!r} ({type(value).__name__}); token ids are integers, "
                                  "e.g. from engine.tokenize(text)")
        out.append(int(value))
    return tuple(out)


@dataclass
class ChunkKV:
    """KV of one chunk computed on its own (optionally behind a conditioning prefix).

    ``keys[l]`` and ``values[l]`` are ``[kv_heads, n, head_dim]``. Keys are stored
    *before* RoPE, so the chunk can be placed at any position by rotating once.
    The prefix, if any, shaped the values but is not stored.
    """

    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_ids: tuple[int, ...] = ()
    model_fingerprint: str | None = None
    # KV taken out of another request (a blend's, say) rather than computed behind exactly
    # ``prefix_ids``: never an exact prefix, whatever text precedes it.
    approximate: bool = False
    # The approximate part of a prefix segment (an earlier blend's K/V from the prefix cache), which the
    # engine turns into a chunk at its own positions so a blend may recompute a share of it
    # (``BlendConfig.approximate_prefix_recompute_ratio``); approximate too.
    from_prefix: bool = False

    def __post_init__(self) -> None:
        self.token_ids = as_token_ids(self.token_ids)
        self.prefix_ids = as_token_ids(self.prefix_ids, "prefix ids")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ChunkKV":
        return ChunkKV(
            self.token_ids,
            [k.to(device=device, dtype=dtype) for k in self.keys],
            [v.to(device=device, dtype=dtype) for v in self.values],
            self.prefix_ids,
            self.model_fingerprint,
            self.approximate,
            self.from_prefix,
        )


@dataclass(frozen=True)
class FreshSegment:
    """Token ids computed from scratch: template text, glue, the question."""

    token_ids: tuple[int, ...]

    def __init__(self, token_ids: Sequence[int]) -> None:
        object.__setattr__(self, "token_ids", as_token_ids(token_ids))


@dataclass(frozen=True)
class CachedSegment:
    """A chunk whose KV is already computed."""

    chunk: ChunkKV

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.chunk.token_ids


@dataclass(frozen=True)
class StoredSegment:
    """A chunk to fetch from a KV store by its token ids; computed and written back when missing."""

    token_ids: tuple[int, ...]
    prefix_ids: tuple[int, ...] = field(default=())

    def __init__(self, token_ids: Sequence[int], prefix_ids: Sequence[int] = ()) -> None:
        object.__setattr__(self, "token_ids", as_token_ids(token_ids))
        object.__setattr__(self, "prefix_ids", as_token_ids(prefix_ids, "prefix ids"))


@dataclass(frozen=True, eq=False)
class PrefixSegment:
    """The opening tokens of a prompt with the K/V full prefill computes for them, from a prefix cache
    (:mod:`~cacheblend_rag.reuse.prefix_cache`). Always the first segment; its exact tokens are
    reused as is, never recomputed, outside the budget.

    ``kv`` is ``[layers, 2, kv_heads, n, head_dim]``: keys (index 0) *rotated* at positions
    0..n-1 and values (index 1). Unlike a chunk, a prefix never moves, so its keys are kept as the
    decoding cache holds them, and a prefix taken from a finished request is used bit for bit.

    ``approximate_tokens``: how many of its last tokens hold an earlier blend's K/V rather than full
    prefill's (the prefix cache's approximate blocks). They are counted apart
    (``BlendStats.approximate_prefix_tokens``), never as exact. A blend recomputes a share of them
    (``BlendConfig.approximate_prefix_recompute_ratio``, chosen by its selection strategy for this
    prompt's question), or, at that share 0 or ``recompute_ratio`` 0, reuses them as is outside the
    budget.
    """

    token_ids: tuple[int, ...]
    kv: torch.Tensor
    model_fingerprint: str | None = None
    approximate_tokens: int = 0

    def __init__(self, token_ids: Sequence[int], kv: torch.Tensor, model_fingerprint: str | None = None,
                 approximate_tokens: int = 0) -> None:
        object.__setattr__(self, "token_ids", as_token_ids(token_ids, "prefix token ids"))
        object.__setattr__(self, "kv", kv)
        object.__setattr__(self, "model_fingerprint", model_fingerprint)
        if isinstance(approximate_tokens, bool) or not isinstance(approximate_tokens, int) or not (
                0 <= approximate_tokens <= len(self.token_ids)):
            raise BlendInputError(f"approximate_tokens={approximate_tokens!r} must be an integer in "
                                  f"[0, {len(self.token_ids)}] (the prefix's tokens)")
        object.__setattr__(self, "approximate_tokens", approximate_tokens)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def exact_tokens(self) -> int:
        """Its leading tokens whose K/V is full prefill's."""
        return len(self.token_ids) - self.approximate_tokens

    def cut(self, n: int) -> "PrefixSegment":
        """Its first ``n`` tokens (itself if that is all of them)."""
        if n >= len(self.token_ids):
            return self
        return PrefixSegment(self.token_ids[:n], self.kv[:, :, :, :n], self.model_fingerprint,
                             approximate_tokens=max(0, n - self.exact_tokens))


Segment = Union[FreshSegment, CachedSegment, StoredSegment, PrefixSegment]
SegmentLike = Union[Segment, ChunkKV, Sequence[int]]


def as_segment(item: SegmentLike) -> Segment:
    """Accept plain token lists (fresh) and bare ChunkKVs (cached) for convenience."""
    if isinstance(item, (FreshSegment, CachedSegment, StoredSegment, PrefixSegment)):
        return item
    if isinstance(item, ChunkKV):
        return CachedSegment(item)
    if isinstance(item, torch.Tensor):
        return FreshSegment(item.flatten().tolist())
    if isinstance(item, (list, tuple)):
        return FreshSegment(item)
    raise TypeError(
        f"cannot use {type(item).__name__} as a segment; pass FreshSegment(token_ids), "
        "CachedSegment(chunk_kv), StoredSegment(token_ids), PrefixSegment(token_ids, kv) or a list of token ids"
    )
