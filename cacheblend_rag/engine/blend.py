"""The blending engine: precompute chunk KV, then blend cached chunks with selective recompute.

The story of one :meth:`CacheBlendEngine.blend` call, for a prompt of N tokens of
which some come from cached chunks:

1. Token ids of all segments are concatenated (never re-tokenized), positions are 0..N-1.
2. Layers before ``check_layer`` run on every token, exactly as full prefill does.
3. At ``check_layer`` the fresh K/V of every cached token is compared with its cached
   K/V; a selection strategy picks ``round(ratio * n_cached)`` cached tokens. Those,
   plus every uncached token, are the *active* tokens from then on.
4. Later layers compute Q/K/V, attention and MLP for active tokens only. Their fresh
   K/V overwrite the cached K/V (rotated to its new positions) in the merged cache,
   and their queries attend over all N keys.
5. The last token is always fresh, so its hidden state gives the next-token logits,
   and the merged per-layer K/V becomes a transformers ``DynamicCache`` for decoding.

Ratio 0 is full KV reuse: cached tokens are never recomputed at any layer. Ratio 1
recomputes everything and reproduces full prefill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine.kv_source import CachedKVSource, InMemoryKVSource
from cacheblend_rag.engine.segments import (
    CachedSegment,
    ChunkKV,
    FreshSegment,
    Segment,
    SegmentLike,
    StoredSegment,
    as_segment,
)
from cacheblend_rag.engine.selection import SelectionContext, get_strategy, selection_budget
from cacheblend_rag.errors import (
    BlendInputError,
    ChunkMismatchError,
    CorrectnessGateError,
    UnsupportedArchitectureError,
)
from cacheblend_rag.models.adapters import DecoderAdapter, get_adapter
from cacheblend_rag.models.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from cacheblend_rag.engine.generate import GenerationResult, GenerationStream

logger = logging.getLogger(__name__)

# Per-process memo of the correctness gate: fingerprint/device -> (passed, max abs error).
_GATE_RESULTS: dict[tuple[str, str], tuple[bool, float]] = {}


@dataclass
class BlendStats:
    mode: str  # "blend", "full_reuse" or "full_prefill"
    total_tokens: int
    cached_tokens: int  # tokens that came with cached KV
    reused_tokens: int  # cached tokens whose KV was kept as is
    recomputed_tokens: int  # cached tokens recomputed from the check layer on
    fresh_tokens: int  # tokens with no cached KV (template, glue, question, missed chunks)
    exact_tokens: int = 0  # cached tokens that form an exact prefix (reused as is, outside the budget)
    selected_positions: list[int] = field(default_factory=list)
    cache_hits: int = 0
    cache_misses: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    fallback_reason: str | None = None

    @property
    def reuse_fraction(self) -> float:
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "total_tokens": self.total_tokens,
            "cached_tokens": self.cached_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "fresh_tokens": self.fresh_tokens,
            "exact_tokens": self.exact_tokens,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "timings": dict(self.timings),
            "fallback_reason": self.fallback_reason,
        }


@dataclass
class _Profile:
    """What a profiling pass leaves: the merged per-layer K/V of full reuse and the attention
    the question paid each cached token, summed over layers and heads."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    question_attention: torch.Tensor  # [n_cached]


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab], for the token after the prompt
    cache: DynamicCache  # ready for decoding at position len(input_ids)
    input_ids: list[int]
    stats: BlendStats


class KVSourceProvider(Protocol):
    """What ``blend(store=...)`` needs from a store: a layer-wise source for stored chunks."""

    def open_source(
        self, engine: "CacheBlendEngine", segments: Sequence[StoredSegment], *, first_layer: int = 0
    ) -> tuple[CachedKVSource, int, int]:
        """Returns the source (stored chunks concatenated in order), hits and misses.
        ``first_layer`` is the first layer the blend will read, so a loader can fetch it first."""
        ...


class _InterleavedSource(CachedKVSource):
    """Cached tokens of several sources, interleaved back into prompt order."""

    def __init__(self, parts: list[tuple[CachedKVSource, list[int]]], order: list[tuple[int, int]]) -> None:
        # parts: (source, lengths of its chunks in its own order); order: (part index, chunk index) per chunk
        self.parts = parts
        self.order = order

    @property
    def wait_seconds(self) -> float:  # type: ignore[override]
        return sum(p.wait_seconds for p, _ in self.parts)

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        split = [source.layer_parts(index, part_lengths) for source, part_lengths in self.parts]
        return [split[p][c] for p, c in self.order]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.layer_parts(index, [])
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def close(self) -> None:
        for source, _ in self.parts:
            source.close()


def _exact_prefix_length(segs: Sequence[Segment]) -> int:
    """Tokens at the start of the prompt whose cached K/V is exactly what full prefill computes:
    the leading cached chunks each computed behind exactly the prompt text before it (the
    first behind nothing, as a cached system prompt is). Prefix caching, in blend terms."""
    before: list[int] = []
    for s in segs:
        if isinstance(s, FreshSegment):
            break
        prefix = s.chunk.prefix_ids if isinstance(s, CachedSegment) else s.prefix_ids
        if tuple(prefix) != tuple(before):
            break
        before.extend(s.token_ids)
    return len(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CacheBlendEngine:
    """Runs full prefill, chunk precompute and blends for one model.

    >>> engine = CacheBlendEngine.from_pretrained()          # SmolLM2-135M-Instruct, offline
    >>> chunk = engine.prefill_chunk(engine.tokenize("Paris is the capital of France.\\n"))
    >>> out = engine.generate([engine.tokenize("Context:\\n"), chunk, engine.tokenize("Q: capital?\\nA:")])
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        config: BlendConfig | None = None,
        adapter: DecoderAdapter | None = None,
        model_name: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or BlendConfig()
        self.model_name = model_name or getattr(model.config, "_name_or_path", None) or model.config.model_type
        self.unsupported_reason: str | None = None
        if adapter is None:
            try:
                adapter = get_adapter(model)
            except UnsupportedArchitectureError as exc:
                if not self.config.fallback_to_full_prefill:
                    raise
                self.unsupported_reason = str(exc)
        self.adapter = adapter
        if adapter is not None:
            self.config.validate_for_model(adapter.num_layers)
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ setup
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        *,
        config: BlendConfig | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> "CacheBlendEngine":
        """Load a model (default: the embedded SmolLM2-135M-Instruct) and wrap it."""
        from cacheblend_rag.models.loader import load_model

        loaded = load_model(name_or_path, device=device, dtype=dtype, require_adapter=False)
        return cls(loaded.model, loaded.tokenizer, config=config, model_name=loaded.name)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, self.tokenizer, self.dtype)
        return self._fingerprint

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config(decoder=True).num_hidden_layers

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", 2048))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (segments are tokenized on their own)."""
        if self.tokenizer is None:
            raise BlendInputError("this engine has no tokenizer; pass token ids, or build it with a tokenizer")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------- chunk precompute
    @torch.inference_mode()
    def prefill_chunk(self, token_ids: Sequence[int], *, prefix_ids: Sequence[int] = ()) -> ChunkKV:
        """KV of one chunk at positions 0..n-1 (or behind ``prefix_ids``, which is not stored)."""
        return self.prefill_chunks([token_ids], prefix_ids=prefix_ids)[0]

    @torch.inference_mode()
    def prefill_chunks(
        self, chunks: Sequence[Sequence[int]], *, prefix_ids: Sequence[int] = (), batch_size: int = 8
    ) -> list[ChunkKV]:
        """Batched :meth:`prefill_chunk`. Chunks of similar length share a right-padded batch;
        with a causal mask, padding after a chunk can never be attended by it."""
        adapter = self._require_adapter("precompute chunk KV")
        prefix = [int(t) for t in prefix_ids]
        chunk_lists = [[int(t) for t in c] for c in chunks]
        for i, c in enumerate(chunk_lists):
            if not c:
                raise BlendInputError(f"chunk {i} is empty; a cached chunk needs at least one token")
            if len(prefix) + len(c) > adapter.max_positions:
                raise BlendInputError(
                    f"chunk {i} has {len(c)} tokens (+{len(prefix)} prefix), more than the model's "
                    f"context of {adapter.max_positions}; split it into smaller chunks"
                )
        results: list[ChunkKV | None] = [None] * len(chunk_lists)
        order = sorted(range(len(chunk_lists)), key=lambda i: len(chunk_lists[i]))
        pad_id = 0
        for start in range(0, len(order), max(1, batch_size)):
            batch = order[start : start + batch_size]
            longest = max(len(chunk_lists[i]) for i in batch)
            rows = [prefix + chunk_lists[i] + [pad_id] * (longest - len(chunk_lists[i])) for i in batch]
            ids = torch.tensor(rows, dtype=torch.long, device=self.device)
            keys, values = self._forward_all(ids, adapter)
            for row, i in enumerate(batch):
                n = len(chunk_lists[i])
                sl = slice(len(prefix), len(prefix) + n)
                results[i] = ChunkKV(
                    token_ids=tuple(chunk_lists[i]),
                    keys=[k[row, :, sl].clone() for k in keys],
                    values=[v[row, :, sl].clone() for v in values],
                    prefix_ids=tuple(prefix),
                    model_fingerprint=self.fingerprint,
                )
        return [r for r in results if r is not None]

    def _forward_all(self, ids: torch.Tensor, adapter: DecoderAdapter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Causal forward of every token; returns per-layer K (before RoPE) and V."""
        b, t = ids.shape
        positions = torch.arange(t, device=self.device).unsqueeze(0).expand(b, t)
        hidden = adapter.embed(ids)
        cos, sin = adapter.rope_cos_sin(hidden, positions)
        keys, values = [], []
        last = adapter.num_layers - 1
        for layer in range(adapter.num_layers):
            q, k, v = adapter.qkv(layer, adapter.input_norm(layer, hidden))
            keys.append(k)
            values.append(v)
            if layer == last:
                break  # the last layer's K/V do not depend on its own output
            attn = self._causal_attention(
                adapter, layer, adapter.apply_rope(q, cos, sin), adapter.apply_rope(k, cos, sin), v
            )
            hidden = adapter.mlp_block(layer, hidden + adapter.attention_output(layer, attn))
        return keys, values

    # ------------------------------------------------------------------ blend
    @torch.inference_mode()
    def blend(
        self,
        segments: Iterable[SegmentLike],
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
    ) -> BlendResult:
        """Blend ``segments`` into next-token logits and a decoding cache. See the module docstring."""
        t0 = time.perf_counter()
        cfg = config or self.config
        segs = self._validate_segments(segments, store)
        input_ids = [t for s in segs for t in s.token_ids]
        has_cached = any(not isinstance(s, FreshSegment) for s in segs)

        if not has_cached:
            return self.full_prefill(input_ids, _start=t0)
        if self.adapter is None:
            result = self.full_prefill(input_ids, _start=t0)
            result.stats.fallback_reason = self.unsupported_reason
            return result
        if cfg.gate and not self._gate_passed(cfg):
            result = self.full_prefill(input_ids, _start=t0)
            result.stats.fallback_reason = "correctness gate failed for this model"
            return result
        cfg.validate_for_model(self.adapter.num_layers)

        exact_end = _exact_prefix_length(segs)
        reads_from_start = cfg.recompute_ratio == 0 or get_strategy(cfg.selection).needs_profile
        first_layer = 0 if reads_from_start else cfg.resolved_check_layer
        source, hits, misses = self._open_source(segs, store, first_layer)
        try:
            result = self._blend_layers(input_ids, segs, exact_end, source, cfg, t0)
        finally:
            source.close()
        result.stats.cache_hits, result.stats.cache_misses = hits, misses
        return result

    def _validate_segments(self, segments: Iterable[SegmentLike], store: Any) -> list[Segment]:
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
        if total > self.context_window:
            raise BlendInputError(
                f"the prompt has {total} tokens, more than the model's context window of "
                f"{self.context_window}; pass fewer or shorter chunks"
            )
        adapter = self.adapter
        for i, s in enumerate(segs):
            if isinstance(s, StoredSegment) and store is None:
                raise BlendInputError(f"segment {i} is a StoredSegment but no store was given; pass store=...")
            if isinstance(s, CachedSegment) and adapter is not None:
                self._check_chunk(i, s.chunk, adapter)
        return segs

    def _check_chunk(self, index: int, chunk: ChunkKV, adapter: DecoderAdapter) -> None:
        expected = (adapter.num_layers, adapter.num_kv_heads, len(chunk), adapter.head_dim)
        got_layers = chunk.num_layers
        shape = tuple(chunk.keys[0].shape) if got_layers else ()
        if got_layers != expected[0] or shape != expected[1:] or len(chunk.values) != got_layers:
            raise ChunkMismatchError(
                f"cached chunk {index} does not fit this model: it has {got_layers} layers of K shaped {shape}, "
                f"the model needs {expected[0]} layers of [kv_heads={expected[1]}, tokens={expected[2]}, "
                f"head_dim={expected[3]}]. It was computed by another model; recompute it with this engine"
            )
        if chunk.model_fingerprint is not None and chunk.model_fingerprint != self.fingerprint:
            raise ChunkMismatchError(
                f"cached chunk {index} was computed by another model (fingerprint "
                f"{chunk.model_fingerprint[:12]}, this model is {self.fingerprint[:12]}); recompute it with this engine"
            )

    def _open_source(
        self, segs: list[Segment], store: KVSourceProvider | None, first_layer: int
    ) -> tuple[CachedKVSource, int, int]:
        cached = [s for s in segs if isinstance(s, CachedSegment)]
        stored = [s for s in segs if isinstance(s, StoredSegment)]
        memory = InMemoryKVSource([s.chunk for s in cached], self.device, self.dtype) if cached else None
        if not stored:
            assert memory is not None
            return memory, len(cached), 0
        assert store is not None
        from_store, hits, misses = store.open_source(self, stored, first_layer=first_layer)
        if memory is None:
            return from_store, hits, misses
        parts = [(memory, [len(s.token_ids) for s in cached]), (from_store, [len(s.token_ids) for s in stored])]
        order, counters = [], [0, 0]
        for s in segs:
            if isinstance(s, FreshSegment):
                continue
            part = 0 if isinstance(s, CachedSegment) else 1
            order.append((part, counters[part]))
            counters[part] += 1
        return _InterleavedSource(parts, order), hits + len(cached), misses

    def _blend_layers(
        self, input_ids: list[int], segs: list[Segment], exact_end: int, source: CachedKVSource,
        cfg: BlendConfig, t0: float,
    ) -> BlendResult:
        """``exact_end``: :func:`_exact_prefix_length` of ``segs``."""
        a = self.adapter
        assert a is not None
        dev = self.device
        n = len(input_ids)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        positions = torch.arange(n, device=dev)
        cached_mask = torch.zeros(n, dtype=torch.bool, device=dev)
        chunk_spans: list[tuple[int, int]] = []  # in cached-token index space
        prompt_spans: list[tuple[int, int]] = []  # the same chunks in prompt positions
        offset = cached_offset = 0
        for s in segs:
            length = len(s.token_ids)
            if not isinstance(s, FreshSegment):
                cached_mask[offset : offset + length] = True
                if offset >= exact_end:
                    chunk_spans.append((cached_offset, cached_offset + length))
                    cached_offset += length
                prompt_spans.append((offset, offset + length))
            offset += length
        chunk_lengths = [end - start for start, end in prompt_spans]
        all_cached_pos = positions[cached_mask]
        # Cached chunks that open the prompt with no conditioning prefix hold exactly the K/V full
        # prefill computes (nothing precedes them): they are never chosen, never recomputed after the
        # check layer, and outside the budget. That is prefix caching of, say, the system prompt.
        cached_pos = all_cached_pos[exact_end:]  # the cached tokens that blending may recompute
        fresh_pos = positions[~cached_mask]
        n_cached = int(cached_pos.numel())
        budget = selection_budget(cfg.recompute_ratio, n_cached)
        # With nothing to blend (every cached token is an exact prefix), reuse is already exact.
        full_reuse = cfg.recompute_ratio == 0.0 or n_cached == 0
        strategy = get_strategy(cfg.selection)
        if strategy.needs_profile and 0 < n_cached <= budget:
            # Every cached token is recomputed, so there is nothing to choose and no profile to
            # run: any strategy picks them all, and deviation does so without a pass of its own.
            strategy = get_strategy("kv_deviation")
        check_layer = cfg.resolved_check_layer
        question_len = len(segs[-1].token_ids)
        timings = {"profile": 0.0, "early_layers": 0.0, "check_layer": 0.0, "late_layers": 0.0}
        cos_all, sin_all = a.rope_cos_sin(a.embed(ids[:1].unsqueeze(0)), positions.unsqueeze(0))

        # One buffer for every layer's stored keys before RoPE; the positions no chunk covers stay zero.
        raw_keys = torch.zeros((1, a.num_kv_heads, n, a.head_dim), dtype=self.dtype, device=dev)

        def merged_from_source(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Layer ``layer``'s K/V for all n positions, cached chunks rotated into their new places.
            The fresh positions, which no chunk covers, hold zeros until the caller writes them (a
            pass that leaves some unwritten masks them, and 0 * NaN would still be NaN)."""
            parts = source.layer_parts(layer, chunk_lengths)
            value_layer = torch.empty_like(raw_keys).index_fill_(2, fresh_pos, 0)
            for (start, end), (chunk_k, chunk_v) in zip(prompt_spans, parts):
                raw_keys[0, :, start:end].copy_(chunk_k)
                value_layer[0, :, start:end].copy_(chunk_v)
            # One rotation of the whole layer: per-chunk rotations cost about twice as much on a CPU,
            # where each of their many small operations pays its own dispatch.
            return a.apply_rope(raw_keys, cos_all, sin_all), value_layer

        # A profiling strategy first runs full KV reuse (only the fresh tokens compute) through the
        # first profile_layers layers and records how much attention the question pays every
        # cached token there. That pass also builds those layers' merged cache, which the blend
        # below then patches in place; later layers are read from the source as usual.
        profile: _Profile | None = None
        if strategy.needs_profile and not full_reuse:
            tick = time.perf_counter()
            profile = self._profile_pass(ids, fresh_pos, cached_pos, question_len, cos_all, sin_all,
                                         merged_from_source, cfg.resolved_profile_layers(a.num_layers),
                                         cfg.profile_tokens)
            timings["profile"] = time.perf_counter() - tick

        # Positions whose hidden states we carry. Before the check layer that is every position, the
        # exact prefix too: its few tokens cost little, and a query set that starts at position 0 runs
        # as one causal attention instead of masked groups (about 1.4x faster per useful FLOP on CPU).
        active = fresh_pos if full_reuse else positions
        hidden = a.embed(ids[active].unsqueeze(0))
        selected: torch.Tensor | None = None  # indices into cached tokens being recomputed
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        plans: dict[int | None, list[tuple[slice, int, torch.Tensor | None]]] = {}
        last_layer = a.num_layers - 1
        tick = time.perf_counter()

        def restrict(new_active: torch.Tensor) -> None:
            nonlocal q, hidden, active
            rel = torch.searchsorted(active, new_active)
            q, hidden, active = q[:, :, rel], hidden[:, rel], new_active
            plans.clear()

        def profiled(layer: int) -> bool:
            return profile is not None and layer < len(profile.keys)

        def patched_layer(
            layer: int, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
            """The merged cache of ``layer`` (the profile's, or read from the source) with the active
            tokens' fresh K (rotated) and V written into it; plus, when ``keep`` names positions, their
            cached K (rotated) and V from before the write, for a selection to compare against."""
            if profiled(layer):
                assert profile is not None
                key_layer, value_layer = profile.keys[layer], profile.values[layer]
            else:
                key_layer, value_layer = merged_from_source(layer)
            cached = None if keep is None else (key_layer[0, :, keep].clone(), value_layer[0, :, keep].clone())
            key_layer.index_copy_(2, active, a.apply_rope(k, cos_all[:, active], sin_all[:, active]))
            value_layer.index_copy_(2, active, v)
            return key_layer, value_layer, cached

        def selection_context(layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                              cached: tuple[torch.Tensor, torch.Tensor] | None = None) -> SelectionContext:
            """Fresh and cached K/V of the blendable cached tokens at ``layer``. ``cached`` (taken from
            a merged layer before the fresh K/V were written into it) and the profile's merged layers
            hold rotated keys, so the fresh K is rotated too there; deviations are norms, which a
            rotation does not change. Otherwise both are read before RoPE."""
            if cached is not None:
                cached_k, cached_v = cached
            elif profiled(layer):
                assert profile is not None
                cached_k, cached_v = profile.keys[layer][0, :, cached_pos], profile.values[layer][0, :, cached_pos]
            else:
                cached_k, cached_v = source.layer(layer)
                cached_k, cached_v = cached_k[:, exact_end:], cached_v[:, exact_end:]
            return SelectionContext(
                layer=layer, budget=budget, fresh_k=fresh_k, fresh_v=fresh_v,
                cached_k=cached_k, cached_v=cached_v, chunk_spans=chunk_spans,
                deviation=cfg.deviation, sink_tokens=cfg.sink_tokens,
                query_weight=cfg.query_weight, gradual_expand=cfg.gradual_expand,
                layers_left=last_layer - layer,
            )

        carried = fresh_pos  # the uncached positions computed in the layers after the choice
        chosen_up_front = profile is not None and check_layer == 0
        if chosen_up_front:
            assert profile is not None
            # Layer 0's K/V of a token depend on the token alone, so the profile's merged layer 0
            # already holds every cached token's fresh K/V: choose now, and never compute the rest.
            ctx = selection_context(0, profile.keys[0][0, :, cached_pos], profile.values[0][0, :, cached_pos])
            ctx.query_attention = lambda: profile.question_attention
            selected = strategy.select(ctx)
            if len(profile.keys) == a.num_layers:
                # Fresh tokens before the first cached one (the template's lead) see only each
                # other, so the profile computed their K/V exactly in every layer: skip them.
                carried = fresh_pos[fresh_pos > cached_pos[0]]
            active = torch.sort(torch.cat([cached_pos[selected], carried])).values
            hidden = a.embed(ids[active].unsqueeze(0))

        for layer in range(a.num_layers):
            q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
            all_active = active.numel() == n
            choosing = layer == check_layer and not full_reuse and not chosen_up_front
            phase = "check_layer" if choosing else "early_layers" if all_active or full_reuse else "late_layers"
            if choosing:
                key_layer = a.apply_rope(k, cos_all, sin_all)
                value_layer = v
                fresh_k = key_layer[0, :, cached_pos] if profiled(layer) else k[0, :, cached_pos]
                ctx = selection_context(layer, fresh_k, v[0, :, cached_pos])
                if profile is not None:
                    ctx.query_attention = lambda: profile.question_attention
                elif strategy.needs_query_attention:
                    ctx.query_attention = self._query_attention_fn(a, layer, q, key_layer, cos_all, sin_all,
                                                                   cached_pos, question_len)
                selected = strategy.select(ctx)
                # The check layer's fresh K/V is already computed for every token: keep all of it.
                restrict(torch.sort(torch.cat([cached_pos[selected], carried])).values)
            elif all_active and (selected is None or selected.numel() <= budget):
                key_layer = a.apply_rope(k, cos_all, sin_all)
                value_layer = v
            else:
                refining = selected is not None and selected.numel() > budget
                sel_pos = cached_pos[selected] if refining else None
                key_layer, value_layer, cached = patched_layer(layer, k, v, keep=sel_pos)
                if refining:
                    # Gradual filtering: compare the still-selected tokens' fresh K/V with the cache.
                    ctx = selection_context(layer, key_layer[0, :, sel_pos], value_layer[0, :, sel_pos], cached)
                    narrowed = strategy.refine(ctx, selected)
                    if narrowed is not None:
                        selected = narrowed
                        restrict(torch.sort(torch.cat([cached_pos[selected], carried])).values)
            keys.append(key_layer)
            values.append(value_layer)

            if layer == last_layer:
                # Only the last token's output is needed from the final layer.
                restrict(active[-1:])
            q_rot = a.apply_rope(q, cos_all[:, active], sin_all[:, active])
            if active.numel() == n:
                attn = self._causal_attention(a, layer, q_rot, key_layer, value_layer)
            else:
                attn = self._partial_attention(a, layer, q_rot, key_layer, value_layer, active, plans, cfg.mask)
            hidden = a.mlp_block(layer, hidden + a.attention_output(layer, attn))
            now = time.perf_counter()
            timings[phase] += now - tick
            tick = now

        logits = a.final_logits(hidden[:, -1:])[0, -1]
        cache = self._make_cache(keys, values)
        _sync(dev)
        timings["load_wait"] = getattr(source, "wait_seconds", 0.0)
        timings["total"] = time.perf_counter() - t0
        recomputed = 0 if selected is None else int(selected.numel())
        stats = BlendStats(
            mode="full_reuse" if full_reuse else "blend",
            total_tokens=n,
            cached_tokens=int(all_cached_pos.numel()),
            reused_tokens=int(all_cached_pos.numel()) - recomputed,
            recomputed_tokens=recomputed,
            fresh_tokens=n - int(all_cached_pos.numel()),
            exact_tokens=exact_end,
            selected_positions=[] if selected is None else cached_pos[selected].tolist(),
            timings=timings,
        )
        return BlendResult(logits=logits, cache=cache, input_ids=input_ids, stats=stats)

    def _profile_pass(
        self, ids, fresh_pos, cached_pos, question_len, cos_all, sin_all, merged_from_source, profile_layers: int,
        profile_tokens: int | None = None,
    ) -> "_Profile":
        """Full KV reuse over the first ``profile_layers`` layers (only fresh tokens compute),
        recording the attention the question pays each cached token. Per layer and head the mass
        is normalised over the cached tokens, so heads that mostly attend the fresh lead or the
        question itself still count.

        With ``profile_tokens``, only the question's last ``profile_tokens`` tokens run: the earlier
        ones (on a RAG prompt, mostly the fixed instruction before the question) are left out of
        the pass altogether, and the kept ones do not see them. The pass is an estimate that only
        ranks tokens; the blend then computes the whole question exactly."""
        a = self.adapter
        assert a is not None
        dropped = (0, 0)  # positions [start, end) of the question left out of the pass
        if profile_tokens is not None and profile_tokens < question_len:
            n_fresh = fresh_pos.numel()
            dropped = (int(fresh_pos[n_fresh - question_len]), int(fresh_pos[n_fresh - profile_tokens - 1]) + 1)
            active = torch.cat([fresh_pos[: n_fresh - question_len], fresh_pos[n_fresh - profile_tokens :]])
            question_len = profile_tokens
        else:
            active = fresh_pos
        hidden = a.embed(ids[active].unsqueeze(0))
        q_cos, q_sin = cos_all[:, active], sin_all[:, active]
        question_rows = slice(active.numel() - question_len, None)
        lead_rows = slice(0, active.numel() - question_len)
        plans: dict[int | None, list[tuple[slice, int, torch.Tensor | None]]] = {}
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        scores = torch.zeros(cached_pos.numel(), dtype=torch.float32, device=self.device)
        for layer in range(profile_layers):
            q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
            key_layer, value_layer = merged_from_source(layer)
            key_layer.index_copy_(2, active, a.apply_rope(k, q_cos, q_sin))
            value_layer.index_copy_(2, active, v)
            keys.append(key_layer)
            values.append(value_layer)
            q_rot = a.apply_rope(q, q_cos, q_sin)
            # The question's rows are computed by hand, so their attention weights serve both the
            # profile and the layer's output; the other fresh rows (the lead) go through SDPA.
            q_out, probs = self._attention_with_weights(a, layer, q_rot[:, :, question_rows],
                                                        active[question_rows], key_layer, value_layer,
                                                        hidden_keys=dropped)
            assert q_out is not None
            mass = probs.sum(dim=2)[0][:, cached_pos]  # [heads, n_cached]
            scores += (mass / mass.sum(dim=1, keepdim=True).clamp(min=1e-12)).sum(dim=0)
            if layer == profile_layers - 1:
                break  # the last profiled layer's output is not needed
            if lead_rows.stop > 0:
                lead_out = self._partial_attention(a, layer, q_rot[:, :, lead_rows], key_layer, value_layer,
                                                   active[lead_rows], plans, "exact")
                q_out = torch.cat([lead_out, q_out], dim=2)
            hidden = a.mlp_block(layer, hidden + a.attention_output(layer, q_out))
        return _Profile(keys=keys, values=values, question_attention=scores)

    def _partial_attention(self, a, layer, q_rot, key_layer, value_layer, active, plans, mask) -> torch.Tensor:
        """Attention of the ``active`` positions' queries over every key, in position groups."""
        window = a.sliding_window(layer)
        if window not in plans:
            plans[window] = self._attention_plan(active, key_layer.shape[2], mask, window, q_rot.dtype)
        return torch.cat([
            F.scaled_dot_product_attention(
                q_rot[:, :, rows], key_layer[:, :, :key_end], value_layer[:, :, :key_end],
                attn_mask=additive, scale=a.attention_scale(layer), enable_gqa=a.num_heads != a.num_kv_heads,
            )
            for rows, key_end, additive in plans[window]
        ], dim=2)

    @staticmethod
    def _attention_with_weights(
        a, layer, q_rot, q_positions, key_layer, value_layer, hidden_keys: tuple[int, int] = (0, 0)
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Causal attention of the queries ``q_rot`` (at ``q_positions``) over every key, by hand:
        the output ``[1, heads, rows, head_dim]`` (``None`` without ``value_layer``) and the
        weights ``[1, heads, rows, n]``. Keys at positions ``[hidden_keys[0], hidden_keys[1])``
        are masked out for every query."""
        _, heads, rows, dim = q_rot.shape
        kv_heads, n = key_layer.shape[1], key_layer.shape[2]
        group = heads // kv_heads
        # Query heads that share a K/V head are stacked as rows, so no K/V copy is made for GQA.
        stacked = q_rot.float().reshape(1, kv_heads, group * rows, dim) * a.attention_scale(layer)
        scores = (stacked @ key_layer.float().transpose(-1, -2)).view(1, heads, rows, n)
        window = a.sliding_window(layer)
        # Without a window every query sees all keys before the first query, so only the columns
        # from there on need a mask (for the question, its own few tokens, not all n).
        first = 0 if window is not None else int(q_positions.min())
        key_pos = torch.arange(first, n, device=q_rot.device)[None, :]
        blocked = key_pos > q_positions[:, None]
        if window is not None:
            blocked |= key_pos <= q_positions[:, None] - window
        scores[..., first:].masked_fill_(blocked, float("-inf"))
        scores[..., hidden_keys[0] : hidden_keys[1]] = float("-inf")
        probs = scores.softmax(-1)
        if value_layer is None:
            return None, probs
        out = (probs.view(1, kv_heads, group * rows, n) @ value_layer.float()).view(1, heads, rows, dim)
        return out.to(q_rot.dtype), probs

    @classmethod
    def _question_attention(cls, a, layer, q_rot, q_positions, key_layer) -> torch.Tensor:
        """Attention mass ``[heads, n]`` that the queries ``q_rot`` (at ``q_positions``) pay each key,
        summed over the queries."""
        _, probs = cls._attention_with_weights(a, layer, q_rot, q_positions, key_layer, None)
        return probs.sum(dim=2)[0]

    def _query_attention_fn(self, a, layer, q, key_layer, cos_all, sin_all, cached_pos, question_len):
        """Attention mass from the question (the last fresh segment) to each cached token at ``layer``."""

        def compute() -> torch.Tensor:
            n = cos_all.shape[1]
            q_pos = torch.arange(n - question_len, n, device=q.device)
            # The question is the last fresh segment, so its rows are the last rows of ``q``.
            q_rot = a.apply_rope(q[:, :, -question_len:], cos_all[:, q_pos], sin_all[:, q_pos])
            return self._question_attention(a, layer, q_rot, q_pos, key_layer).sum(dim=0)[cached_pos]

        return compute

    @staticmethod
    def _attention_plan(
        query_positions: torch.Tensor, total: int, mask: str, window: int | None, dtype: torch.dtype
    ) -> list[tuple[slice, int, torch.Tensor | None]]:
        """Split sorted query positions into groups; each group attends only the keys up to its
        last position. A masked attention cannot skip the causal upper triangle, so grouping
        saves close to half of the attention work of the selected tokens."""
        m = query_positions.numel()
        groups = max(1, min(8, m // 32))
        device = query_positions.device
        effective = torch.arange(total - m, total, device=device) if mask == "bottom_right" else query_positions
        bounds = sorted({0, m, *(round(m * g / groups) for g in range(1, groups))})
        plan = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            pos = effective[lo:hi]
            key_end = int(pos[-1]) + 1
            key_pos = torch.arange(key_end, device=device)
            allowed = key_pos[None, :] <= pos[:, None]
            if window is not None and total > window:
                allowed &= key_pos[None, :] > pos[:, None] - window
            # An additive float mask, built once: SDPA would convert a boolean mask on every call.
            additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            plan.append((slice(lo, hi), key_end, additive))
        return plan

    @staticmethod
    def _causal_attention(
        a: DecoderAdapter, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of every position over every position (full prefill of a layer)."""
        total = q.shape[2]
        window = a.sliding_window(layer)
        scale = a.attention_scale(layer)
        gqa = a.num_heads != a.num_kv_heads
        if window is None or total <= window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        positions = torch.arange(total, device=q.device)
        offset = positions[None, :] - positions[:, None]  # key position minus query position
        allowed = (offset <= 0) & (offset > -window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)

    def _make_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(zip(keys, values)):
            slot = cache.layers[layer] if layer < len(getattr(cache, "layers", ())) else None
            if type(slot) is DynamicLayer and not slot.is_initialized:
                # A plain layer's first update concatenates onto an empty tensor, which copies the
                # whole merged layer (about 0.05 s of a 2,100-token CPU blend). An empty update
                # sets the layer up through its public method; the merged tensors are ours to hand over.
                cache.update(k[:, :, :0], v[:, :, :0], layer)
                slot.keys, slot.values = k, v
            else:  # sliding-window and other layer kinds keep their own bookkeeping
                cache.update(k, v, layer)
        return cache

    # ----------------------------------------------------------- full prefill
    @torch.inference_mode()
    def full_prefill(self, token_ids: Sequence[int], *, _start: float | None = None) -> BlendResult:
        """The baseline: the model's own forward over every token."""
        t0 = _start if _start is not None else time.perf_counter()
        input_ids = [int(t) for t in token_ids]
        if not input_ids:
            raise BlendInputError("the prompt is empty; pass at least one token")
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        _sync(self.device)
        n = len(input_ids)
        stats = BlendStats(
            mode="full_prefill", total_tokens=n, cached_tokens=0, reused_tokens=0,
            recomputed_tokens=0, fresh_tokens=n, timings={"total": time.perf_counter() - t0},
        )
        return BlendResult(logits=logits, cache=cache, input_ids=input_ids, stats=stats)

    # ---------------------------------------------------------------- gate
    def _gate_passed(self, cfg: BlendConfig) -> bool:
        key = (self.fingerprint, f"{self.device}")
        if key not in _GATE_RESULTS:
            _GATE_RESULTS[key] = self._run_gate(cfg)
        passed, err = _GATE_RESULTS[key]
        if passed:
            return True
        message = (
            f"correctness gate failed for {self.model_name}: blending at ratio 1.0 differs from full "
            f"prefill by {err:.3g} (tolerance {self._gate_tolerance(cfg):.3g}). Blending would give wrong "
            "answers; use BlendConfig(fallback_to_full_prefill=True) to serve with full prefill"
        )
        if cfg.fallback_to_full_prefill:
            logger.warning(message)
            return False
        raise CorrectnessGateError(message)

    def _gate_tolerance(self, cfg: BlendConfig) -> float:
        if cfg.gate_tolerance is not None:
            return cfg.gate_tolerance
        return 1e-3 if self.dtype == torch.float32 else 5e-2

    def _run_gate(self, cfg: BlendConfig) -> tuple[bool, float]:
        """Blend a short synthetic prompt at ratio 1.0 and compare with the model's own prefill."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        ids = [(17 + 7919 * i) % vocab for i in range(48)]
        prefix, chunk_a, chunk_b, suffix = ids[:6], ids[6:22], ids[22:40], ids[40:]
        chunks = self.prefill_chunks([chunk_a, chunk_b])
        exact = BlendConfig(recompute_ratio=1.0, check_layer=min(cfg.resolved_check_layer, self.adapter.num_layers - 1),
                            gate=False)
        blended = self.blend([prefix, chunks[0], chunks[1], suffix], config=exact).logits.float()
        reference = self.full_prefill(ids).logits.float()
        err = float((blended - reference).abs().max() / reference.abs().max().clamp(min=1.0))
        passed = err <= self._gate_tolerance(cfg)
        logger.info("correctness gate for %s: relative error %.3g, passed=%s", self.model_name, err, passed)
        return passed, err

    def _require_adapter(self, what: str) -> DecoderAdapter:
        if self.adapter is None:
            raise UnsupportedArchitectureError(f"cannot {what}: {self.unsupported_reason}")
        return self.adapter

    # ------------------------------------------------------------ generation
    def generate(
        self,
        segments: Iterable[SegmentLike],
        generation: GenerationConfig | None = None,
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
        **generation_overrides: Any,
    ) -> "GenerationResult":
        """Blend, then decode. ``generation_overrides`` are :class:`GenerationConfig` fields."""
        from cacheblend_rag.engine.generate import run_generation

        return run_generation(self, segments, generation, config, store, generation_overrides).result()

    def stream(
        self,
        segments: Iterable[SegmentLike],
        generation: GenerationConfig | None = None,
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
        **generation_overrides: Any,
    ) -> "GenerationStream":
        """Like :meth:`generate`, but iterate over text deltas; ``.result()`` afterwards gives the totals."""
        from cacheblend_rag.engine.generate import run_generation

        return run_generation(self, segments, generation, config, store, generation_overrides)
