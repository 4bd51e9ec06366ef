"""A blend's segments checked against the engine's model before anything is computed.

Bad input is refused with an error that names the segment and how to fix it: no segment, an empty prompt, a
cached last segment, tokens outside the vocabulary, a prompt longer than the context window, a stored segment
without a store, chunk KV of another model or shape, a prefix segment anywhere but first.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

import torch

from cacheblend_rag.kv.segments import (
    CachedSegment,
    ChunkKV,
    FreshSegment,
    PrefixSegment,
    Segment,
    SegmentLike,
    StoredSegment,
    as_segment,
)
from cacheblend_rag.errors import BlendInputError, ChunkMismatchError, ContextWindowError
from cacheblend_rag.models.adapters import DecoderAdapter


class CheckedModel(Protocol):
    """What the checks read of an engine (the engine imports this module, so it is named by its parts)."""

    adapter: DecoderAdapter | None
    device: torch.device
    dtype: torch.dtype

    @property
    def fingerprint(self) -> str: ...

    @property
    def context_window(self) -> int: ...

    def check_vocabulary(self, ids: Sequence[int], what: str) -> Sequence[int]: ...


def validate_segments(engine: "CheckedModel", segments: Iterable[SegmentLike], store: Any) -> list[Segment]:
    """``segments`` as segments, each checked against the engine's model: bad input is a
    :class:`BlendInputError` or :class:`ChunkMismatchError` that names the segment and the fix. Empty segments
    are dropped; a prefix segment in another device or dtype is moved to the engine's."""
    try:
        segs = [as_segment(s) for s in segments]
    except TypeError as exc:
        raise BlendInputError(str(exc)) from None
    if not segs:
        raise BlendInputError("segments is empty; pass at least one segment ending with fresh tokens")
    segs = [s for s in segs if len(s.token_ids) > 0]
    if not segs:
        raise BlendInputError("every segment is empty; pass at least one token")
    if not isinstance(segs[-1], FreshSegment):
        raise BlendInputError(
            "the last segment must be fresh tokens (the question or the assistant opener); "
            "append FreshSegment(token_ids) after the last cached chunk"
        )
    total = sum(len(s.token_ids) for s in segs)
    for i, s in enumerate(segs):
        engine.check_vocabulary(s.token_ids, f"segment {i}")
    if total > engine.context_window:
        # The hint fits the prompt: chunks can be dropped; a conversation (an agent's loop) can only be cut.
        chunked = any(isinstance(s, (CachedSegment, StoredSegment)) for s in segs)
        raise ContextWindowError(
            f"the prompt has {total} tokens, more than the model's context window of {engine.context_window}; "
            + ("pass fewer or shorter chunks" if chunked else
               "the conversation no longer fits: shorten it (drop earlier turns or tool results) or start a new one"),
            tokens=total, window=engine.context_window)
    adapter = engine.adapter
    fingerprint = engine.fingerprint if any(isinstance(s, (CachedSegment, PrefixSegment)) for s in segs) else ""
    for i, s in enumerate(segs):
        if isinstance(s, StoredSegment) and store is None:
            raise BlendInputError(f"segment {i} is a StoredSegment but no store was given; pass store=...")
        if isinstance(s, CachedSegment) and adapter is not None:
            check_chunk(i, s.chunk, adapter, fingerprint)
        if isinstance(s, PrefixSegment):
            if i:
                raise BlendInputError(f"segment {i} is a PrefixSegment; a prefix can only open the prompt "
                                      "(segment 0)")
            if adapter is not None:
                segs[0] = checked_prefix(engine, s, adapter, fingerprint)
    return segs


def checked_prefix(engine: "CheckedModel", s: PrefixSegment, adapter: DecoderAdapter,
                   fingerprint: str) -> PrefixSegment:
    expected = (adapter.num_layers, 2, adapter.num_kv_heads, len(s), adapter.head_dim)
    if tuple(s.kv.shape) != expected:
        raise ChunkMismatchError(f"the prefix segment's K/V is shaped {tuple(s.kv.shape)}, this model needs "
                                 f"[layers, 2, kv_heads, tokens, head_dim] = {list(expected)}")
    if s.model_fingerprint is not None and s.model_fingerprint != fingerprint:
        raise ChunkMismatchError(f"the prefix segment was computed by another model (fingerprint "
                                 f"{s.model_fingerprint[:12]}, this model is {fingerprint[:12]})")
    if s.kv.device != engine.device or s.kv.dtype != engine.dtype:
        return PrefixSegment(s.token_ids, s.kv.to(device=engine.device, dtype=engine.dtype), s.model_fingerprint,
                             s.approximate_tokens)
    return s


def check_chunk(index: int, chunk: ChunkKV, adapter: DecoderAdapter, fingerprint: str) -> None:
    expected = (adapter.num_layers, adapter.num_kv_heads, len(chunk), adapter.head_dim)
    got_layers = chunk.num_layers
    shape = tuple(chunk.keys[0].shape) if got_layers else ()
    if got_layers != expected[0] or shape != expected[1:] or len(chunk.values) != got_layers:
        raise ChunkMismatchError(
            f"cached chunk {index} does not fit this model: it has {got_layers} layers of K shaped {shape}, "
            f"the model needs {expected[0]} layers of [kv_heads={expected[1]}, tokens={expected[2]}, "
            f"head_dim={expected[3]}]. It was computed by another model; recompute it with this engine"
        )
    if chunk.model_fingerprint is not None and chunk.model_fingerprint != fingerprint:
        raise ChunkMismatchError(
            f"cached chunk {index} was computed by another model (fingerprint "
            f"{chunk.model_fingerprint[:12]}, this model is {fingerprint[:12]}); recompute it with this engine"
        )
