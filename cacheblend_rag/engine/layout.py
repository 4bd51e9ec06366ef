"""Where every token of a blended prompt comes from, and a layer's K/V assembled from the chunks.

A prompt is a run of segments. :class:`PromptLayout` turns them into positions: which
are fresh (computed from scratch), which are cached, and which cached ones form an exact
prefix (cached K/V that full prefill would compute too: a :class:`PrefixSegment` from the
prefix cache, then chunks computed behind exactly what precedes them). :class:`MergedLayers`
assembles one layer's K/V for all positions from the prefix and the cached chunks, the
chunks' keys rotated into their places.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from cacheblend_rag.kv.source import CachedKVSource
from cacheblend_rag.kv.segments import CachedSegment, ChunkKV, FreshSegment, PrefixSegment, Segment
from cacheblend_rag.models.adapters import DecoderAdapter


def unrotated_keys(a: DecoderAdapter, keys: Sequence[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Each layer's keys of positions [start, end) back to before RoPE, a chunk's form (a rotation by the
    negative angle): ``keys[l]`` is ``[1, kv_heads, n, head_dim]``, rotated at positions 0..n-1; each
    result ``[kv_heads, end - start, head_dim]``."""
    positions = torch.arange(start, end, device=keys[0].device).unsqueeze(0)
    cos, sin = a.rope_cos_sin(keys[0][:, :, start:end], positions)
    return [a.apply_rope(k[:, :, start:end], cos, -sin)[0] for k in keys]


def split_approximate_prefix(a: DecoderAdapter, prefix: PrefixSegment) -> list[Segment]:
    """A prefix segment with approximate tokens as its exact part (a prefix segment, if it has one) and a
    cached segment of the approximate rest (``ChunkKV.from_prefix``), blended like a chunk at the
    positions it holds: a blend may then recompute a share of it for this prompt's question."""
    exact = prefix.exact_tokens
    keys = [prefix.kv[layer, 0].unsqueeze(0) for layer in range(prefix.kv.shape[0])]
    rest = ChunkKV(prefix.token_ids[exact:], unrotated_keys(a, keys, exact, len(prefix)),
                   [prefix.kv[layer, 1, :, exact:] for layer in range(prefix.kv.shape[0])],
                   model_fingerprint=prefix.model_fingerprint, approximate=True, from_prefix=True)
    head = [prefix.cut(exact)] if exact else []
    return [*head, CachedSegment(rest)]


def fresh_after_exact(segs: Sequence[Segment], exact: int) -> list[Segment]:
    """``segs`` with every cached segment after the first ``exact`` tokens made fresh."""
    out: list[Segment] = []
    offset = 0
    for s in segs:
        out.append(s if offset < exact or isinstance(s, FreshSegment) else FreshSegment(s.token_ids))
        offset += len(s.token_ids)
    return out


def exact_prefix_length(segs: Sequence[Segment], lossless: Sequence[bool] | None = None) -> int:
    """Tokens at the start of the prompt whose cached K/V is exactly what full prefill computes:
    the leading cached chunks each computed behind exactly the prompt text before it (the
    first behind nothing, as a cached system prompt is) and held without loss (``lossless``, per
    cached segment: not rounded to fewer bits or quantized by a store). A :class:`PrefixSegment` from
    the prefix cache opens it. Prefix caching, in blend terms.

    A prefix segment with approximate tokens (an earlier blend's K/V) that the engine reuses as is
    (:func:`split_approximate_prefix` not applied) counts here all the same (this is the K/V no blend
    recomputes), but nothing extends it: what follows is blended. ``PromptLayout.approximate_tokens``
    says how much of it is not exact."""
    before: list[int] = []
    # ``lossless`` counts the chunks of the source, which the prefix segment is not one of.
    offset = 1 if segs and isinstance(segs[0], PrefixSegment) else 0
    if offset:
        before.extend(segs[0].token_ids)
        if segs[0].approximate_tokens:
            return len(before)
    for index in range(offset, len(segs)):
        s = segs[index]
        if isinstance(s, (FreshSegment, PrefixSegment)) or (lossless is not None and not lossless[index - offset]):
            break
        if isinstance(s, CachedSegment) and s.chunk.approximate:
            break
        prefix = s.chunk.prefix_ids if isinstance(s, CachedSegment) else s.prefix_ids
        if tuple(prefix) != tuple(before):
            break
        before.extend(s.token_ids)
    return len(before)


@dataclass
class PromptLayout:
    """Positions of a prompt by origin. Cached positions after the exact prefix are the ones a
    blend may recompute; the budget is counted among them."""

    input_ids: list[int]
    ids: torch.Tensor  # [n] token ids
    positions: torch.Tensor  # [n] 0..n-1
    fresh_pos: torch.Tensor  # positions with no cached K/V, sorted
    all_cached_pos: torch.Tensor  # every cached position, sorted
    cached_pos: torch.Tensor  # cached positions after the exact prefix: the blendable ones
    exact_end: int  # length of the prefix reused as is (the exact prefix, an approximate prefix segment's too)
    prefix: PrefixSegment | None  # the prefix cache's K/V of positions [0, prefix_len)
    prompt_spans: list[tuple[int, int]]  # every cached chunk (not the prefix), [start, end) in prompt positions
    chunk_spans: list[tuple[int, int]]  # blendable chunks, [start, end) among the blendable cached tokens
    question_len: int  # tokens of the last fresh segment
    # Those of ``chunk_spans`` that are cached segments (``ChunkKV.approximate``: a span after the chunks
    # from the segment cache), which ``BlendConfig.segment_recompute_ratio`` budgets apart.
    segment_spans: list[tuple[int, int]] = field(default_factory=list)
    # Those of ``chunk_spans`` that are a prefix segment's approximate part (``ChunkKV.from_prefix``), which
    # ``BlendConfig.approximate_prefix_recompute_ratio`` budgets apart.
    approximate_prefix_spans: list[tuple[int, int]] = field(default_factory=list)
    fresh_list: list[int] = field(default_factory=list)  # ``fresh_pos`` on the host
    cached_list: list[int] = field(default_factory=list)  # ``cached_pos`` on the host

    @classmethod
    def of(cls, segs: Sequence[Segment], device: torch.device, lossless: Sequence[bool] | None = None
           ) -> "PromptLayout":
        """``lossless``: per cached segment, in order (:meth:`CachedKVSource.lossless`)."""
        input_ids = [t for s in segs for t in s.token_ids]
        n = len(input_ids)
        exact_end = exact_prefix_length(segs, lossless)
        # Positions are worked out here on the host and uploaded once: the blend then reads none back.
        fresh: list[int] = []
        cached: list[int] = []
        chunk_spans: list[tuple[int, int]] = []
        segment_spans: list[tuple[int, int]] = []
        approximate_prefix_spans: list[tuple[int, int]] = []
        prompt_spans: list[tuple[int, int]] = []
        offset = cached_offset = 0
        for s in segs:
            length = len(s.token_ids)
            if isinstance(s, FreshSegment):
                fresh.extend(range(offset, offset + length))
            else:
                cached.extend(range(offset, offset + length))
                if offset >= exact_end:
                    chunk_spans.append((cached_offset, cached_offset + length))
                    if isinstance(s, CachedSegment) and s.chunk.approximate:
                        spans = approximate_prefix_spans if s.chunk.from_prefix else segment_spans
                        spans.append((cached_offset, cached_offset + length))
                    cached_offset += length
                if not isinstance(s, PrefixSegment):
                    prompt_spans.append((offset, offset + length))
            offset += length
        all_cached_pos = torch.tensor(cached, dtype=torch.long, device=device)
        return cls(
            input_ids=input_ids, ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.arange(n, device=device), fresh_pos=torch.tensor(fresh, dtype=torch.long, device=device),
            all_cached_pos=all_cached_pos, cached_pos=all_cached_pos[exact_end:], exact_end=exact_end,
            prefix=segs[0] if isinstance(segs[0], PrefixSegment) else None, prompt_spans=prompt_spans,
            chunk_spans=chunk_spans, question_len=len(segs[-1].token_ids), segment_spans=segment_spans,
            approximate_prefix_spans=approximate_prefix_spans, fresh_list=fresh, cached_list=cached[exact_end:],
        )

    @property
    def n(self) -> int:
        return len(self.input_ids)

    @property
    def n_cached(self) -> int:
        """Blendable cached tokens (the exact prefix is not counted)."""
        return len(self.cached_list)

    @property
    def n_segment(self) -> int:
        """Blendable cached tokens of cached segments (:attr:`segment_spans`)."""
        return sum(end - start for start, end in self.segment_spans)

    @property
    def n_approximate_prefix(self) -> int:
        """Blendable cached tokens of a prefix segment's approximate part (:attr:`approximate_prefix_spans`)."""
        return sum(end - start for start, end in self.approximate_prefix_spans)

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose K/V came from the prefix cache: the prefix segment's and its approximate part's,
        blendable when split off."""
        return self.prefix_len + self.n_approximate_prefix

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else len(self.prefix)

    @property
    def reused_approximate_tokens(self) -> int:
        """Tokens of the prefix segment holding an earlier blend's K/V and reused as is (not split off)."""
        return 0 if self.prefix is None else self.prefix.approximate_tokens

    @property
    def approximate_tokens(self) -> int:
        """Tokens from the prefix cache holding an earlier blend's K/V: reused as is or blendable."""
        return self.reused_approximate_tokens + self.n_approximate_prefix

    @property
    def chunk_lengths(self) -> list[int]:
        return [end - start for start, end in self.prompt_spans]



def contiguous_runs(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``spans`` (sorted ``[start, end)``) merged where one ends as the next starts: ``(start, end, first,
    last)``, the run's positions and the indices ``[first, last)`` of the spans it joins."""
    runs: list[tuple[int, int, int, int]] = []
    for index, (start, end) in enumerate(spans):
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, runs[-1][2], index + 1)
        else:
            runs.append((start, end, index, index + 1))
    return runs


class MergedLayers:
    """One layer's K/V for all positions: the prefix segment's as cached (its keys already rotated),
    then the cached chunks, read from ``source``, with their keys rotated to the positions they hold
    in this prompt. The fresh positions, which no chunk covers, hold zeros until the caller writes
    them (a pass that leaves some unwritten masks them, and 0 * NaN would still be NaN)."""

    def __init__(
        self, a: DecoderAdapter, layout: PromptLayout, source: CachedKVSource,
        cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, room: int = 0,
    ) -> None:
        """``room``: positions left free after the prompt in each layer's buffer (:meth:`read`)."""
        self.a = a
        self.layout = layout
        self.source = source
        self.cos, self.sin = cos, sin
        self.shape = (1, a.num_kv_heads, layout.n, a.head_dim)
        self.room = room
        self.dtype = dtype
        # One buffer for every layer's stored keys before RoPE, from the end of the prefix segment on
        # (written whole by each read: zeros where no chunk lies).
        m = layout.prefix_len
        self._raw_keys = torch.empty((1, a.num_kv_heads, layout.n - m, a.head_dim), dtype=dtype, device=cos.device)
        self._runs = contiguous_runs(layout.prompt_spans)
        self._gaps: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # zero blocks between chunks (_pieces)
        self._rope = a.rope_tables(cos[:, m:], sin[:, m:])

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout, m = self.layout, self.layout.prefix_len
        parts = self.source.layer_parts(layer, layout.chunk_lengths) if layout.prompt_spans else []
        # K and V of the layer are the two halves of one buffer with ``room`` free positions after the
        # prompt: decoding writes its tokens there in place instead of copying the layer (DecodingKV).
        kv_heads, n = self.shape[1], self.shape[2]
        shape, device = (1, 2 * kv_heads, n + self.room, self.shape[3]), self.cos.device
        if not self._runs:  # no chunk: past the prefix every key and value stays zero, nothing to rotate
            buffer = torch.zeros(shape, dtype=self.dtype, device=device)
            key_layer, value_layer = buffer[:, :kv_heads, :n], buffer[:, kv_heads:, :n]
            self._copy_prefix(layer, key_layer, value_layer)
            return key_layer, value_layer
        # Every position is written below (the prefix copied, the rest by one concatenation each for K and V
        # with zeros where no chunk lies); only the room is zeroed, not the whole layer.
        buffer = torch.empty(shape, dtype=self.dtype, device=device)
        buffer[:, :, n:].zero_()
        key_layer, value_layer = buffer[:, :kv_heads, :n], buffer[:, kv_heads:, :n]
        # One concatenation of the layer's chunks and the zero gaps between them for K, one for V, straight
        # into place: one per run of chunks was 20 a layer for ten passages apart, and per-chunk copies made a
        # GPU blend wait on thousands of small launches (performance.md, GPU). On a CPU the copy is bound by
        # memory either way (30 layers of 3,000 tokens: 80 ms before and after, SmolLM2 bfloat16).
        keys, values = self._pieces(parts, 0), self._pieces(parts, 1)
        torch.cat(keys, dim=1, out=self._raw_keys[0])
        torch.cat(values, dim=1, out=value_layer[0, :, m:])
        self._copy_prefix(layer, key_layer, value_layer)
        # One rotation of the rest of the layer: per-chunk rotations cost about twice as much on a CPU,
        # where each of their many small operations pays its own dispatch.
        self.a.apply_rope(self._raw_keys, *self._rope, out=key_layer[:, :, m:] if m else key_layer)
        return key_layer, value_layer

    def _copy_prefix(self, layer: int, key_layer: torch.Tensor, value_layer: torch.Tensor) -> None:
        prefix, m = self.layout.prefix, self.layout.prefix_len
        if prefix is not None:
            key_layer[0, :, :m].copy_(prefix.kv[layer, 0])
            value_layer[0, :, :m].copy_(prefix.kv[layer, 1])

    def _pieces(self, parts: list[tuple[torch.Tensor, torch.Tensor]], which: int) -> list[torch.Tensor]:
        """K (``which`` 0) or V of every chunk in prompt order, from the prefix's end to the prompt's, with a
        zero block (in the parts' dtype, made once a blend) wherever fresh tokens lie between them."""
        pieces: list[torch.Tensor] = []
        at = self.layout.prefix_len
        for start, end, first, last in self._runs:
            if start > at:
                pieces.append(self._zeros(start - at, parts[first][which]))
            pieces.extend(part[which] for part in parts[first:last])
            at = end
        if self.layout.n > at:
            pieces.append(self._zeros(self.layout.n - at, parts[-1][which]))
        return pieces

    def _zeros(self, length: int, like: torch.Tensor) -> torch.Tensor:
        key = (length, like.dtype)
        if key not in self._gaps:
            self._gaps[key] = like.new_zeros((like.shape[0], length, like.shape[2]))
        return self._gaps[key]

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blendable cached tokens' K (before RoPE) and V at ``layer``, ``[kv_heads, n_cached, head_dim]``."""
        k, v = self.source.layer(layer)  # the chunks only: the prefix segment is not the source's
        start = self.layout.exact_end - self.layout.prefix_len
        return k[:, start:], v[:, start:]
