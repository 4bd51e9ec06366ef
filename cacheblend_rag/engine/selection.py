"""Which cached tokens to recompute: pluggable strategies behind a small registry.

A strategy sees, at the check layer, the fresh and the cached K/V of every cached
token and may ask for the attention that the fresh (question) tokens pay them.
It returns indices into the cached tokens. Every strategy returns exactly
``ctx.budget`` indices in the end; a gradual strategy may start with more and
narrow them over the next layers through :meth:`SelectionStrategy.refine`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from cacheblend_rag.errors import ConfigError


def selection_budget(ratio: float, num_cached: int) -> int:
    """Number of cached tokens recomputed at ``ratio``: ``round(ratio * num_cached)``."""
    return min(num_cached, int(round(ratio * num_cached)))


@dataclass
class SelectionContext:
    layer: int
    budget: int
    fresh_k: torch.Tensor  # [kv_heads, n_cached, head_dim], before RoPE
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    chunk_spans: list[tuple[int, int]]  # [start, end) of each chunk, in cached-token index space
    deviation: str = "value"
    sink_tokens: int = 4
    query_weight: float = 0.5
    gradual_expand: float = 2.0
    layers_left: int = 0  # layers after this one; a gradual strategy must reach its budget by the last
    # Attention mass that the fresh query tokens pay each cached token, [n_cached]; computed lazily.
    query_attention: Callable[[], torch.Tensor] | None = None

    @property
    def num_cached(self) -> int:
        return self.cached_v.shape[1]

    def deviation_scores(self) -> torch.Tensor:
        fresh, cached = (self.fresh_v, self.cached_v) if self.deviation == "value" else (self.fresh_k, self.cached_k)
        diff = fresh.float() - cached.float()
        return diff.pow(2).sum(dim=(0, 2))


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, sorted ascending; ties go to the earlier token."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(-scores, stable=True).indices[:k]
    return torch.sort(order).values


def _normalise(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else torch.zeros_like(x)


class SelectionStrategy(ABC):
    name: ClassVar[str]
    needs_query_attention: ClassVar[bool] = False
    # A profiling strategy gets ``ctx.query_attention`` from a full-reuse pass over every layer
    # (see ``CacheBlendEngine._profile_pass``) instead of from the check layer alone.
    needs_profile: ClassVar[bool] = False
    # The check layer used when BlendConfig.check_layer is None. Deviation needs layer 1: layer 0's
    # K/V depend on the token alone, so cached and fresh agree there.
    default_check_layer: ClassVar[int] = 1

    @abstractmethod
    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """Indices into the cached tokens to recompute from the check layer on."""

    def refine(self, ctx: SelectionContext, current: torch.Tensor) -> torch.Tensor | None:
        """Narrow ``current`` at a later layer; ``None`` keeps it. ``ctx`` holds only ``current``'s tokens."""
        return None


class KVDeviation(SelectionStrategy):
    """CacheBlend as published: the tokens whose V (or K) deviates most at the check layer."""

    name = "kv_deviation"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return top_indices(ctx.deviation_scores(), ctx.budget)


class SinkAware(SelectionStrategy):
    """EPIC-style: each chunk's first ``sink_tokens`` are always picked, the rest of the budget by deviation."""

    name = "sink_aware"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        scores = ctx.deviation_scores()
        sinks = [i for start, end in ctx.chunk_spans for i in range(start, min(end, start + ctx.sink_tokens))]
        sinks = sinks[: ctx.budget]
        boosted = scores.clone()
        if sinks:
            boosted[torch.tensor(sinks, device=scores.device)] = float("inf")
        return top_indices(boosted, ctx.budget)


class QueryAware(SelectionStrategy):
    """ProphetKV/A3-style: rank cached tokens by the attention the question pays them,
    mixed with deviation by ``query_weight`` (1.0 = attention alone)."""

    name = "query_aware"
    needs_query_attention = True

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        assert ctx.query_attention is not None
        attention = _normalise(ctx.query_attention())
        if ctx.query_weight < 1.0:
            score = ctx.query_weight * attention + (1 - ctx.query_weight) * _normalise(ctx.deviation_scores())
        else:
            score = attention
        return top_indices(score, ctx.budget)


class GradualFilter(SelectionStrategy):
    """The CacheBlend paper's gradual filtering: pick ``gradual_expand`` times the budget
    at the check layer, then keep the most deviating half at each next layer until the
    budget is reached."""

    name = "gradual"

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        wide = min(ctx.num_cached, int(math.ceil(ctx.budget * ctx.gradual_expand)))
        if ctx.layers_left == 0:
            wide = ctx.budget
        return top_indices(ctx.deviation_scores(), wide)

    def refine(self, ctx: SelectionContext, current: torch.Tensor) -> torch.Tensor | None:
        if current.numel() <= ctx.budget:
            return None
        keep = ctx.budget if ctx.layers_left == 0 else max(ctx.budget, (current.numel() + 1) // 2)
        return current[top_indices(ctx.deviation_scores(), keep)]


class QueryProfiled(SelectionStrategy):
    """ProphetKV-style, measured over the whole model: a full-reuse pass (only the fresh tokens
    compute, about the cost of full reuse) records the attention the question pays every cached
    token in every layer and head; the tokens it leans on most are recomputed from layer 0.
    Needs no full check layer; its pass runs only the question's last ``profile_tokens`` tokens.
    The tokens it picks lie late in the prompt, where a recomputed token attends the most keys:
    1.08-1.14x plain CacheBlend's TTFT at the same ratio on 1,100-2,100-token MuSiQue prompts,
    1.2x at 6,000 tokens (docs/quality.md, "Cutting the profile's cost")."""

    name = "query_profiled"
    needs_profile = True
    default_check_layer = 0

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        assert ctx.query_attention is not None
        return top_indices(ctx.query_attention(), ctx.budget)


_REGISTRY: dict[str, Callable[[], SelectionStrategy]] = {}


def register_strategy(cls: type[SelectionStrategy]) -> type[SelectionStrategy]:
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (KVDeviation, SinkAware, QueryAware, GradualFilter, QueryProfiled):
    register_strategy(_cls)


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> SelectionStrategy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError(f"selection={name!r} is not registered; choose one of {available_strategies()}") from None
