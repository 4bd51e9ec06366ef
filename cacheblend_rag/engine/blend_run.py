"""One blend, layer by layer: :class:`BlendRun` holds its state and reads top to bottom.

For a prompt of N tokens of which some come from cached chunks:

1. (``query_profiled``) a profile pass runs full KV reuse through the first layers and records
   which cached tokens the question reads (:mod:`cacheblend_rag.engine.profile`);
2. layers before the check layer run on every token, as full prefill does;
3. at the check layer a strategy chooses ``round(ratio * n_cached)`` cached tokens to
   recompute (with a profile at check layer 0, before layer 0); those, plus every uncached
   token, are the *active* tokens from then on;
4. later layers compute Q/K/V, attention and MLP for the active tokens only; their fresh K/V
   overwrite the cached K/V (rotated to its new positions) in the merged cache, and their
   queries attend over all N keys;
5. the last token is always fresh, so its hidden state gives the next-token logits, and the
   merged per-layer K/V becomes the decoding cache.

Ratio 0 is full KV reuse: cached tokens are never recomputed at any layer. Ratio 1
recomputes everything and reproduces full prefill.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.attention import PartialAttention, causal_attention, question_attention
from cacheblend_rag.engine.decoding_cache import decoding_cache
from cacheblend_rag.kv.source import CachedKVSource
from cacheblend_rag.engine.layout import MergedLayers, PromptLayout
from cacheblend_rag.engine.profile import Profile, profile_question
from cacheblend_rag.engine.results import BlendResult, BlendStats
from cacheblend_rag.engine.selection import SelectionContext, SelectionStrategy, probe_list, selection_budget
from cacheblend_rag.models.adapters import DecoderAdapter

CachedKV = tuple[torch.Tensor, torch.Tensor]

# An exact prefix at least this share of the prompt is left out of the layers before the check layer
# too. Below it, those layers carry every position, since a query set that starts at position 0 runs as
# one causal attention, about 1.4x faster per useful FLOP on a CPU than the masked groups a query set
# that starts later needs (docs/design.md, "Blend"): skipping pays once the prefix's share of the
# projections and MLPs outweighs that, and a chat's cached history is most of its prompt.
SKIP_EXACT_PREFIX_SHARE = 0.25


def chunks_recompute_ratio(cfg: BlendConfig, layout: PromptLayout) -> float:
    """The chunks' share of recompute: ``recompute_ratio``, times ``approximate_prefix_chunk_factor`` (at most
    1.0) behind an approximate prefix reused as is, whose history takes no share of the budget."""
    if layout.reused_approximate_tokens and 0.0 < cfg.recompute_ratio < 1.0:
        return min(1.0, cfg.recompute_ratio * cfg.approximate_prefix_chunk_factor)
    return cfg.recompute_ratio


class BlendRun:
    """The state of one blend: the merged cache being built and the tokens being carried.

    ``active`` are the positions whose hidden states are carried through the layers (sorted),
    ``hidden`` their hidden states and ``selected`` the indices (among the blendable cached
    tokens) chosen for recompute. ``keys``/``values`` collect each layer's merged K/V.
    """

    def __init__(
        self, a: DecoderAdapter, layout: PromptLayout, source: CachedKVSource, cfg: BlendConfig,
        strategy: SelectionStrategy, check_layer: int, model_config: Any, dtype: torch.dtype, room: int = 0,
    ) -> None:
        self.a = a
        self.layout = layout
        self.strategy = strategy
        self.check_layer = check_layer
        self.model_config = model_config
        self.source = source
        # Cached segments (spans after the chunks from the segment cache) and an approximate prefix's part
        # split off get their own shares, each chosen among its tokens; the chunks' share is chosen among
        # the chunks (and the kinds whose ratio is None). At ratio 0 or 1 there is one pool.
        self.pools: list[tuple[torch.Tensor, int]] | None = None
        chunk_ratio = chunks_recompute_ratio(cfg, layout)
        own = [(spans, ratio) for spans, ratio in ((layout.segment_spans, cfg.segment_recompute_ratio),
                                                    (layout.approximate_prefix_spans,
                                                     cfg.approximate_prefix_recompute_ratio))
               if ratio is not None and spans]
        if own and 0.0 < cfg.recompute_ratio < 1.0:
            pool = [0] * layout.n_cached  # each cached token's pool label, worked out on the host
            for label, (spans, _) in enumerate(own, 1):
                for start, end in spans:
                    pool[start:end] = [label] * (end - start)
            ratios = [chunk_ratio, *(ratio for _, ratio in own)]
            members = [[i for i, p in enumerate(pool) if p == label] for label in range(len(ratios))]
            self.pools = [(torch.tensor(index, dtype=torch.long, device=layout.cached_pos.device),
                           selection_budget(ratio, len(index))) for index, ratio in zip(members, ratios)]
            self.budget = sum(budget for _, budget in self.pools)
        else:
            self.budget = selection_budget(chunk_ratio, layout.n_cached)
        # With nothing to blend (every cached token is an exact prefix), reuse is already exact.
        self.full_reuse = cfg.recompute_ratio == 0.0 or layout.n_cached == 0
        # A budget covering every cached token leaves nothing to choose: no strategy, no profile.
        self.recompute_all = 0 < layout.n_cached <= self.budget
        self.timings = {"profile": 0.0, "early_layers": 0.0, "check_layer": 0.0, "late_layers": 0.0}
        self.key_correction = cfg.stale_key_correction
        self.value_correction = cfg.stale_value_correction
        if self.key_correction or self.value_correction:
            # Each blendable cached token's shift group: its chunk, or its window of ``shift_window`` tokens
            # of it (a long chunk's error drifts along it).
            self.chunk_of = torch.zeros(layout.n_cached, dtype=torch.long, device=layout.cached_pos.device)
            self.shift_groups = 0
            for start, end in layout.chunk_spans:
                width = cfg.shift_window or (end - start)
                offsets = torch.arange(end - start, device=self.chunk_of.device)
                self.chunk_of[start:end] = self.shift_groups + offsets // width
                self.shift_groups += -(-(end - start) // width)
        self.probes_host = probe_list(layout.chunk_spans, cfg.shift_probe_stride)
        self.probes = torch.tensor(self.probes_host, dtype=torch.long, device=layout.cached_pos.device)
        self.estimators: torch.Tensor | None = None  # the tokens whose change estimates the stale shifts
        self._estimated: tuple[torch.Tensor, ...] | None = None  # see _estimating_tokens
        self._unrotation_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # the estimators' (_unrotation)
        self._cached_rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 tables of cached_pos
        self.probes_dropped = False  # a budget could not hold the probes: no probes, no corrections
        self.cos, self.sin = a.rope_cos_sin(a.embed(layout.ids[:1].unsqueeze(0)), layout.positions.unsqueeze(0))
        self.selected_positions: list[int] | None = None  # the selection's positions, read back once
        self.merged = MergedLayers(a, layout, source, self.cos, self.sin, dtype, room)
        self.attention = PartialAttention(cfg.mask)
        self.profile: Profile | None = None
        self.selected: torch.Tensor | None = None
        self.carried = layout.fresh_pos  # the uncached positions computed in the layers after the choice
        self.chosen_up_front = False
        # Before the check layer every position is carried, a short exact prefix too: its few tokens cost
        # little, and a query set that starts at position 0 runs as one causal attention instead of
        # masked groups (faster per useful FLOP on a CPU; measured in docs/design.md, "Blend"). A long
        # one (a cached chat history) is never computed.
        skip = layout.exact_end if layout.exact_end >= SKIP_EXACT_PREFIX_SHARE * layout.n else 0
        self.active = layout.fresh_pos if self.full_reuse else layout.positions[skip:]
        # The active positions on the host too: attention groups take their key ranges from there.
        self.active_host: list[int] | range = layout.fresh_list if self.full_reuse else range(skip, layout.n)
        self.hidden = a.embed(layout.ids[self.active].unsqueeze(0))
        self.q: torch.Tensor | None = None  # the active tokens' queries, rotated
        self._rope_active: torch.Tensor | None = None  # the active positions ``_rope`` holds cos/sin of
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    # ------------------------------------------------------------------ the story
    def run(self, started: float) -> BlendResult:
        request = self.strategy.needs.profile
        if request is not None and not self.full_reuse and not self.recompute_all:
            tick = time.perf_counter()
            layers = min(self.a.num_layers, request.layers or self.a.num_layers)
            self.profile = profile_question(self.a, self.layout, self.merged, layers, request.question_tokens)
            self.timings["profile"] = time.perf_counter() - tick
            if self.check_layer == 0:
                self._choose_before_layer_zero()
        tick = time.perf_counter()
        for layer in range(self.a.num_layers):
            phase = self._layer(layer)
            now = time.perf_counter()
            self.timings[phase] += now - tick
            tick = now
        return self._result(started)

    def _layer(self, layer: int) -> str:
        """Run one layer for the active tokens; returns the phase it belongs to, for the timings."""
        a, n = self.a, self.layout.n
        # Q, K and V in one projection, and Q and K rotated together: a layer's fixed cost is its count
        # of operations, on a GPU (launches) as on a CPU (dispatches).
        qkv = a.qkv_heads(layer, a.input_norm(layer, self.hidden))
        rotated = a.apply_rope(qkv[:, : a.qk_heads], *self._active_rope())
        self.q, k, v = rotated[:, : a.num_heads], rotated[:, a.num_heads :], qkv[:, a.qk_heads :]
        all_active = len(self.active_host) == n
        if layer == self.check_layer and not self.full_reuse and not self.chosen_up_front:
            phase = "check_layer"
            key_layer, value_layer = self._choose_at_check_layer(layer, qkv, k, v)
        else:
            phase = "early_layers" if all_active or self.full_reuse else "late_layers"
            if all_active and not self._narrowing():
                key_layer, value_layer = k, v
            else:
                key_layer, value_layer = self._patched_layer(layer, k, v)
        self.keys.append(key_layer)
        self.values.append(value_layer)
        if layer == a.num_layers - 1:
            # Only the last token's output is needed from the final layer.
            self._restrict(self.active[-1:], [self.active_host[-1]])
        if len(self.active_host) == n:
            attn = causal_attention(a, layer, self.q, key_layer, value_layer)
        else:
            attn = self.attention(a, layer, self.q, key_layer, value_layer, self.active, self.active_host)
        self.hidden = a.mlp_block(layer, self.hidden + a.attention_output(layer, attn))
        return phase

    # ------------------------------------------------------------------ choosing
    def _choose_before_layer_zero(self) -> None:
        """Layer 0's K/V of a token depend on the token alone, so the profile's merged layer 0 already
        holds every cached token's fresh K/V: choose now, and never compute the rest."""
        profile, layout = self.profile, self.layout
        assert profile is not None
        fresh_k, fresh_v = profile.keys[0][0, :, layout.cached_pos], profile.values[0][0, :, layout.cached_pos]
        self.selected = self._select(self._context(0, fresh_k, fresh_v))
        if len(profile.keys) == self.a.num_layers:
            # Fresh tokens before the first cached one (the template's lead) see only each other,
            # so the profile computed their K/V exactly in every layer: skip them.
            lead = sum(1 for p in layout.fresh_list if p < layout.cached_list[0])
            self.carried = layout.fresh_pos[lead:]
        self.chosen_up_front = True
        self.active, self.active_host = self._active_for(self.selected)
        self.hidden = self.a.embed(layout.ids[self.active].unsqueeze(0))

    def _choose_at_check_layer(self, layer: int, qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> CachedKV:
        """Every token but a long exact prefix computed this layer: choose, keep every computed token's
        fresh K/V, then narrow to the choice. ``qkv`` holds K before RoPE, ``k`` rotated."""
        cached_pos = self.layout.cached_pos
        if len(self.active_host) == self.layout.n:
            key_layer, value_layer = k, v
        else:  # the exact prefix's K/V comes from the cache, the rest is this layer's
            key_layer, value_layer = self._patched_layer(layer, k, v)
        rows = torch.searchsorted(self.active, cached_pos)  # the cached tokens' rows of ``k``
        if self.recompute_all:
            self.selected = torch.arange(self.layout.n_cached, device=cached_pos.device)
        else:
            profiled = self.profile is not None and self.profile.covers(layer)
            fresh_k = key_layer[0, :, cached_pos] if profiled else qkv[0, self.a.num_heads : self.a.qk_heads, rows]
            ctx = self._context(layer, fresh_k, v[0, :, rows])
            if self.profile is None and self.strategy.needs.query_attention:
                ctx.query_attention = lambda: self._question_attention(layer, key_layer)
            self.selected = self._select(ctx)
        self._restrict(*self._active_for(self.selected))
        return key_layer, value_layer

    def _select(self, ctx: SelectionContext) -> torch.Tensor:
        """The strategy's choice: over every blendable cached token, or pool by pool (chunks, cached
        segments) with each pool's budget."""
        if self.pools is None:
            if not self.probes.numel():
                return self.strategy.select(ctx)
            everything = torch.arange(self.layout.n_cached, device=self.probes.device)
            return self._with_probes(ctx, everything, self.budget)
        picked = []
        for index, budget in self.pools:
            if budget >= index.numel():
                picked.append(index)
            elif budget > 0:
                picked.append(self._with_probes(ctx, index, budget))
        return torch.sort(torch.cat(picked)).values if picked else index[:0]

    def _with_probes(self, ctx: SelectionContext, index: torch.Tensor, budget: int) -> torch.Tensor:
        """Among the cached tokens ``index``: its probes first (``shift_probe_stride``), then the strategy's
        choice of the rest of ``budget`` among the others. A budget smaller than the probes drops them, and
        the stale corrections with them (:meth:`_correct_stale_entries`): the strategy chooses the whole
        budget. Too few probes estimate the shifts worse than none: on the 1.5B model at 0.05 with probes every
        10 tokens, the first probes that fit left the last chunks uncorrected (10 of 13 questions worse than
        full reuse) and an even subset of them still did worse than no correction (-25% against plain
        CacheBlend's 6%)."""
        # Every probe lies among the chunks' tokens: only a pool of cached segments needs them sifted.
        probes = self.probes if self.pools is None else self.probes[torch.isin(self.probes, index)]
        if probes.numel() > budget:
            self.probes_dropped = True
            return index[self.strategy.select(_restricted(ctx, index, budget))]
        others = _without(index, probes)
        if budget - probes.numel() <= 0 or not others.numel():
            return probes
        chosen = others[self.strategy.select(_restricted(ctx, others, budget - probes.numel()))]
        return torch.sort(torch.cat([probes, chosen])).values

    def _refine(self, ctx: SelectionContext, current: torch.Tensor) -> torch.Tensor | None:
        """The strategy's narrowing of ``current`` (``ctx`` holds its tokens), pool by pool when pooled."""
        if self.pools is None:
            return self.strategy.refine(ctx, current)
        kept, changed = [], False
        for index, budget in self.pools:
            local = torch.nonzero(torch.isin(current, index)).flatten()  # rows of ``ctx`` in this pool
            if not local.numel():
                continue
            narrowed = self.strategy.refine(_restricted(ctx, local, budget), current[local])
            changed |= narrowed is not None
            kept.append(current[local] if narrowed is None else narrowed)
        return torch.sort(torch.cat(kept)).values if changed else None

    def _narrowing(self) -> bool:
        """A gradual strategy still holds more tokens than its budget."""
        return self.selected is not None and self.selected.numel() > self.budget

    def _patched_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> CachedKV:
        """The merged cache of ``layer`` (the profile's, or read from the source) with the active tokens'
        fresh K (``k``, rotated) and V written into it; a gradual strategy narrows its choice on the way."""
        if self.profile is not None and self.profile.covers(layer):
            key_layer, value_layer = self.profile.keys[layer], self.profile.values[layer]
        else:
            key_layer, value_layer = self.merged.read(layer)
        narrowing = self._narrowing()
        if narrowing:
            # Compare the still-selected tokens' fresh K/V with their cached K/V, taken before the write.
            sel_pos = self.layout.cached_pos[self.selected]
            cached = (key_layer[0, :, sel_pos].clone(), value_layer[0, :, sel_pos].clone())
        if self.key_correction or self.value_correction:
            self._correct_stale_entries(key_layer, value_layer, k, v)
        key_layer.index_copy_(2, self.active, k)
        value_layer.index_copy_(2, self.active, v)
        if narrowing:
            ctx = self._context(layer, key_layer[0, :, sel_pos], value_layer[0, :, sel_pos], cached)
            narrowed = self._refine(ctx, self.selected)
            if narrowed is not None:
                self.selected = narrowed
                self._restrict(*self._active_for(narrowed))
        return key_layer, value_layer

    def _correct_stale_entries(self, key_layer: torch.Tensor, value_layer: torch.Tensor, fresh_keys: torch.Tensor,
                               fresh_values: torch.Tensor) -> None:
        """Move every key (``stale_key_correction``) and value (``stale_value_correction``) of a chunk by that
        share of the mean change its estimating tokens saw in this layer: the probes (``shift_probe_stride``),
        else every recomputed token. ``fresh_*`` are the active tokens', against the merged ``*_layer``. A key's
        change is averaged before RoPE, since a rotated key's change turns with its position, and rotated to
        each token's own; the recomputed tokens' fresh K/V are written over theirs afterwards."""
        selected, layout = self.selected, self.layout
        if selected is None or not selected.numel() or not layout.chunk_spans or self.probes_dropped:
            return
        pos, rows = self._estimating_tokens()
        if not pos.numel():
            return
        if self.key_correction:
            change = self.a.apply_rope((fresh_keys[:, :, rows] - key_layer[:, :, pos]).float(), *self._unrotation())
            self._shift_cached_keys(key_layer, self._stale_key_shift(key_layer, change))
        if self.value_correction:
            change = fresh_values[:, :, rows].float() - value_layer[:, :, pos].float()
            shift = self.value_correction * self._chunk_means(change)
            value_layer.index_add_(2, layout.cached_pos, shift.to(value_layer.dtype))

    def _stale_key_shift(self, key_layer: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """Each blendable cached token's estimated key change before RoPE: its chunk's mean ``change``."""
        return self._chunk_means(change)

    def _estimating_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimators' positions and their rows among the active tokens, worked out once per selection
        (with how many each shift group has): every corrected layer reuses them."""
        if self._estimated is None or self._estimated[0] is not self.selected:
            selected = self.selected
            assert selected is not None
            if not self.probes_host:
                self.estimators = selected
            else:  # the selected probes, sifted on the host from the choice's positions read back already
                chosen, cached = set(self.selected_positions or ()), self.layout.cached_list
                kept = [i for i in self.probes_host if cached[i] in chosen]
                self.estimators = torch.tensor(kept, dtype=torch.long, device=selected.device)
            pos = self.layout.cached_pos[self.estimators]
            counts = torch.zeros(self.shift_groups, dtype=torch.float32, device=pos.device)
            counts.index_add_(0, self.chunk_of[self.estimators], torch.ones_like(pos, dtype=torch.float32))
            self._estimated = (selected, pos, torch.searchsorted(self.active, pos), counts.clamp_(min=1))
            self._unrotation_tables = None
        return self._estimated[1], self._estimated[2]

    def _unrotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 tables that turn the estimators' keys back to before RoPE, built once per selection."""
        if self._unrotation_tables is None:
            pos = self._estimating_tokens()[0]
            self._unrotation_tables = self.a.rope_tables(self.cos[:, pos].float(), -self.sin[:, pos].float())
        return self._unrotation_tables

    def _chunk_means(self, change: torch.Tensor) -> torch.Tensor:
        """``change`` (``[1, kv_heads, estimators, head_dim]``) averaged over each chunk's estimating tokens,
        one row per blendable cached token (a chunk with none: no change)."""
        assert self.estimators is not None
        if self._estimated is None or self._estimated[0] is not self.selected:
            self._estimating_tokens()
        assert self._estimated is not None
        totals = change.new_zeros(change.shape[0], change.shape[1], self.shift_groups, change.shape[3])
        totals.index_add_(2, self.chunk_of[self.estimators], change)
        return (totals / self._estimated[3].view(1, 1, -1, 1))[:, :, self.chunk_of]

    def _shift_cached_keys(self, key_layer: torch.Tensor, shift: torch.Tensor) -> None:
        """Add ``stale_key_correction`` times ``shift`` (before RoPE, one row per blendable cached token),
        rotated to each token's position, to ``key_layer``."""
        cached_pos = self.layout.cached_pos
        if self._cached_rotation is None:  # the same positions every layer: the tables are built once a blend
            self._cached_rotation = self.a.rope_tables(self.cos[:, cached_pos].float(), self.sin[:, cached_pos].float())
        rotated = self.a.apply_rope(shift, *self._cached_rotation)
        key_layer.index_add_(2, cached_pos, (self.key_correction * rotated).to(key_layer.dtype))

    def _context(
        self, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached: CachedKV | None = None
    ) -> SelectionContext:
        """Fresh and cached K/V of the blendable cached tokens at ``layer``. ``cached`` (taken from a
        merged layer) and the profile's merged layers hold rotated keys, and the caller rotated the
        fresh K there too; otherwise both are read before RoPE."""
        if cached is not None:
            cached_k, cached_v = cached
        elif self.profile is not None and self.profile.covers(layer):
            cached_pos = self.layout.cached_pos
            cached_k, cached_v = self.profile.keys[layer][0, :, cached_pos], self.profile.values[layer][0, :, cached_pos]
        else:
            cached_k, cached_v = self.merged.cached(layer)
        ctx = SelectionContext(
            layer=layer, budget=self.budget, fresh_k=fresh_k, fresh_v=fresh_v, cached_k=cached_k, cached_v=cached_v,
            chunk_spans=self.layout.chunk_spans, layers_left=self.a.num_layers - 1 - layer,
        )
        if self.profile is not None:
            scores = self.profile.question_attention
            ctx.query_attention = lambda: scores
        return ctx

    def _question_attention(self, layer: int, key_layer: torch.Tensor) -> torch.Tensor:
        """Attention mass from the question (the last fresh segment) to each cached token at ``layer``,
        with every token active (the check layer)."""
        assert self.q is not None
        n, question_len = self.layout.n, self.layout.question_len
        q_pos = torch.arange(n - question_len, n, device=self.q.device)
        # The question is the last fresh segment, so its rows are the last rows of ``q`` (rotated).
        q_rot = self.q[:, :, -question_len:]
        return question_attention(self.a, layer, q_rot, q_pos, key_layer).sum(dim=0)[self.layout.cached_pos]

    # ------------------------------------------------------------------ bookkeeping
    def _active_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the active positions, gathered once per set of them (each layer used to gather its
        own twice: four launches a layer on a GPU)."""
        if self._rope_active is not self.active:
            self._rope_active = self.active
            self._rope = self.a.rope_tables(self.cos[:, self.active], self.sin[:, self.active])
        assert self._rope is not None
        return self._rope

    def _active_for(self, selected: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The positions to carry for the choice ``selected``, on the device and on the host. The choice's
        positions are read back here, once per choice: the blend's one wait on the device before its
        logits (attention groups and the stats take them from the host)."""
        chosen = self.layout.cached_pos[selected]
        self.selected_positions = chosen.tolist()
        carried = self.layout.fresh_list[len(self.layout.fresh_list) - self.carried.numel():]
        return torch.sort(torch.cat([chosen, self.carried])).values, sorted(self.selected_positions + carried)

    def _restrict(self, new_active: torch.Tensor, host: list[int]) -> None:
        """Carry only ``new_active`` (a subset of the active positions, ``host`` on the host) from here on."""
        rel = torch.searchsorted(self.active, new_active)
        assert self.q is not None
        self.q, self.hidden, self.active, self.active_host = self.q[:, :, rel], self.hidden[:, rel], new_active, host
        self.attention.reset()

    def _result(self, started: float) -> BlendResult:
        layout = self.layout
        logits = self.a.final_logits(self.hidden[:, -1:])[0, -1]
        cache = decoding_cache(self.model_config, self.keys, self.values)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.timings["load_wait"] = getattr(self.source, "wait_seconds", 0.0)
        # Chunks whose stored copy failed mid-read are computed in full: a slow request says why.
        self.timings["load_recompute"] = getattr(self.source, "recompute_seconds", 0.0)
        self.timings["total"] = time.perf_counter() - started
        recomputed = 0 if self.selected is None else int(self.selected.numel())
        n_cached_total = int(layout.all_cached_pos.numel())
        # What full prefill computes: everything when every cached token was recomputed or none needed
        # it, else the positions before the first blendable cached token.
        exact_kv = layout.n if self.recompute_all or not layout.n_cached else layout.cached_list[0]
        if layout.reused_approximate_tokens:  # nothing after an approximate prefix's first approximate token is exact
            exact_kv = min(exact_kv, layout.prefix_len - layout.reused_approximate_tokens)
        stats = BlendStats(
            mode="prefix_cached" if not layout.n_cached else "full_reuse" if self.full_reuse else "blend",
            total_tokens=layout.n,
            cached_tokens=n_cached_total,
            reused_tokens=n_cached_total - recomputed,
            recomputed_tokens=recomputed,
            fresh_tokens=layout.n - n_cached_total,
            exact_tokens=layout.exact_end - layout.reused_approximate_tokens,
            prefix_tokens=layout.prefix_tokens,
            approximate_prefix_tokens=layout.approximate_tokens,
            exact_kv_tokens=exact_kv,
            selected_positions=sorted(self.selected_positions or []),
            timings=self.timings,
            probes_dropped=self.probes_dropped,
        )
        return BlendResult(logits=logits, cache=cache, input_ids=layout.input_ids, stats=stats)


def _restricted(ctx: SelectionContext, index: torch.Tensor, budget: int) -> SelectionContext:
    """``ctx`` for the cached tokens ``index`` only (sorted), with ``budget``: a pool's own context."""
    # The spans are counted on the host (one read of ``index``), not with a device search per chunk.
    host = index.tolist()
    spans = []
    for start, end in ctx.chunk_spans:
        lo, hi = bisect.bisect_left(host, start), bisect.bisect_left(host, end)
        if hi > lo:
            spans.append((lo, hi))
    attention = ctx.query_attention
    return SelectionContext(
        layer=ctx.layer, budget=budget, fresh_k=ctx.fresh_k[:, index], fresh_v=ctx.fresh_v[:, index],
        cached_k=ctx.cached_k[:, index], cached_v=ctx.cached_v[:, index], chunk_spans=spans,
        layers_left=ctx.layers_left, query_attention=None if attention is None else (lambda: attention()[index]),
    )


def _without(index: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """``index`` (sorted) without the entries of ``removed`` (a sorted subset of it), with no read back of a
    boolean mask's count: the kept entries' order is that of a stable sort by "removed"."""
    if not removed.numel():
        return index
    gone = torch.isin(index, removed)
    order = torch.sort(gone.to(torch.uint8), stable=True).indices
    return index[order[: index.numel() - removed.numel()]]
