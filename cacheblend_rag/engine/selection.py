"""Which cached tokens to recompute: strategies, each with its own settings, behind a registry.

A strategy declares what it needs from the engine through :attr:`SelectionStrategy.needs`:
the check layer it chooses at by default, whether it reads the question's attention at
that layer, and whether it wants a profile (a full-reuse pass before the blend that
records the question's attention in every layer; ``cacheblend_rag.engine.profile``).
At its check layer it gets a :class:`SelectionContext` with the fresh and the cached K/V
of every blendable cached token, and returns indices into them.

Every strategy returns exactly ``ctx.budget`` indices in the end; a gradual strategy may
start with more and narrow them over the next layers through :meth:`SelectionStrategy.refine`.
When the budget covers every cached token there is nothing to choose, and the engine
recomputes them all without asking a strategy.

Strategies are built from a :class:`~cacheblend_rag.config.BlendConfig` by
:func:`build_strategy` (each takes the fields it uses), or directly with their settings.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from cacheblend_rag.config import BlendConfig, DeviationKind
from cacheblend_rag.errors import ConfigError


def selection_budget(ratio: float, num_cached: int) -> int:
    """Number of cached tokens recomputed at ``ratio``: ``round(ratio * num_cached)``."""
    return min(num_cached, int(round(ratio * num_cached)))


@dataclass(frozen=True)
class ProfileRequest:
    """A profile pass over the first ``layers`` layers (``None``: all) with the question's last
    ``question_tokens`` tokens (``None``: all of the last fresh segment)."""

    layers: int | None = None
    question_tokens: int | None = None


@dataclass(frozen=True)
class SelectionNeeds:
    """What a strategy needs the engine to compute before it can choose."""

    check_layer: int = 1  # default check layer; deviation needs 1, as layer 0's K/V depend on the token alone
    query_attention: bool = False  # the question's attention over the cached tokens at the check layer
    profile: ProfileRequest | None = None  # the question's attention from a full-reuse pass over many layers


@dataclass
class SelectionContext:
    """The evidence at one layer about the blendable cached tokens (or, in :meth:`SelectionStrategy.refine`,
    about the still-selected ones). K is before RoPE, or rotated on both sides: deviations are norms,
    which a rotation does not change."""

    layer: int
    budget: int
    fresh_k: torch.Tensor  # [kv_heads, tokens, head_dim]
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    chunk_spans: list[tuple[int, int]]  # [start, end) of each chunk, in cached-token index space
    layers_left: int = 0  # layers after this one; a gradual strategy must reach its budget by the last
    # Attention mass that the question pays each cached token, [n_cached]; computed when first asked for.
    query_attention: Callable[[], torch.Tensor] | None = None

    @property
    def num_cached(self) -> int:
        return self.cached_v.shape[1]

    def deviation_scores(self, kind: DeviationKind = "value") -> torch.Tensor:
        fresh, cached = (self.fresh_v, self.cached_v) if kind == "value" else (self.fresh_k, self.cached_k)
        diff = fresh.float() - cached.float()
        return diff.pow(2).sum(dim=(0, 2))

    def question_attention(self) -> torch.Tensor:
        if self.query_attention is None:
            raise RuntimeError("this strategy reads the question's attention, but the engine did not provide it; "
                               "declare it in the strategy's `needs`")
        return self.query_attention()


def probe_list(chunk_spans: Sequence[tuple[int, int]], stride: int) -> list[int]:
    """Every ``stride``-th token of each chunk, from the middle of the first stride on (never a chunk's first
    token, which a chunk computed alone makes a sink): the probes of ``BlendConfig.shift_probe_stride``, in
    cached-token index space. ``stride`` 0: none."""
    if not stride:
        return []
    first = max(1, stride // 2)
    return [i for start, end in chunk_spans for i in range(start + first, end, stride)]


def probe_indices(chunk_spans: Sequence[tuple[int, int]], stride: int) -> torch.Tensor:
    """:func:`probe_list` as a tensor."""
    return torch.tensor(probe_list(chunk_spans, stride), dtype=torch.long)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, sorted ascending; ties go to the earlier token."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(-scores, stable=True).indices[:k]
    return torch.sort(order).values


def chunk_starts_first(scores: torch.Tensor, chunk_spans: Sequence[tuple[int, int]], n: int) -> torch.Tensor:
    """A copy of ``scores`` in which each chunk's first ``n`` tokens outrank every other token; among them
    :func:`top_indices` keeps the earlier ones when the budget cannot hold them all."""
    starts = [i for start, end in chunk_spans for i in range(start, min(end, start + n))]
    boosted = scores.clone()
    if starts:
        boosted[torch.tensor(starts, device=scores.device)] = float("inf")
    return boosted


def _normalise(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else torch.zeros_like(x)


class SelectionStrategy(ABC):
    name: ClassVar[str]

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds()

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "SelectionStrategy":
        """This strategy with the settings ``cfg`` holds for it."""
        return cls()

    @abstractmethod
    def select(self, ctx: SelectionContext) -> torch.Tensor:
        """Indices into the cached tokens to recompute from the check layer on."""

    def refine(self, ctx: SelectionContext, current: torch.Tensor) -> torch.Tensor | None:
        """Narrow ``current`` at a later layer; ``None`` keeps it. ``ctx`` holds only ``current``'s tokens."""
        return None


@dataclass(frozen=True)
class KVDeviation(SelectionStrategy):
    """CacheBlend as published: the tokens whose V (or K) deviates most at the check layer."""

    name: ClassVar[str] = "kv_deviation"
    deviation: DeviationKind = "value"

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "KVDeviation":
        return cls(deviation=cfg.deviation)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return top_indices(ctx.deviation_scores(self.deviation), ctx.budget)


@dataclass(frozen=True)
class SinkAware(SelectionStrategy):
    """EPIC-style: each chunk's first ``sink_tokens`` are always picked, the rest of the budget by deviation."""

    name: ClassVar[str] = "sink_aware"
    deviation: DeviationKind = "value"
    sink_tokens: int = 4

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "SinkAware":
        return cls(deviation=cfg.deviation, sink_tokens=cfg.sink_tokens)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        scores = ctx.deviation_scores(self.deviation)
        return top_indices(chunk_starts_first(scores, ctx.chunk_spans, self.sink_tokens), ctx.budget)


@dataclass(frozen=True)
class QueryAware(SelectionStrategy):
    """ProphetKV/A3-style: rank cached tokens by the attention the question pays them at the check
    layer, mixed with deviation by ``query_weight`` (1.0 = attention alone)."""

    name: ClassVar[str] = "query_aware"
    deviation: DeviationKind = "value"
    query_weight: float = 0.5

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(query_attention=True)

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "QueryAware":
        return cls(deviation=cfg.deviation, query_weight=cfg.query_weight)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        attention = _normalise(ctx.question_attention())
        if self.query_weight < 1.0:
            deviation = _normalise(ctx.deviation_scores(self.deviation))
            score = self.query_weight * attention + (1 - self.query_weight) * deviation
        else:
            score = attention
        return top_indices(score, ctx.budget)


@dataclass(frozen=True)
class GradualFilter(SelectionStrategy):
    """The CacheBlend paper's gradual filtering: pick ``expand`` times the budget at the check
    layer, then keep the most deviating half at each next layer until the budget is reached."""

    name: ClassVar[str] = "gradual"
    deviation: DeviationKind = "value"
    expand: float = 2.0

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "GradualFilter":
        return cls(deviation=cfg.deviation, expand=cfg.gradual_expand)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        wide = min(ctx.num_cached, int(math.ceil(ctx.budget * self.expand)))
        if ctx.layers_left == 0:
            wide = ctx.budget
        return top_indices(ctx.deviation_scores(self.deviation), wide)

    def refine(self, ctx: SelectionContext, current: torch.Tensor) -> torch.Tensor | None:
        if current.numel() <= ctx.budget:
            return None
        keep = ctx.budget if ctx.layers_left == 0 else max(ctx.budget, (current.numel() + 1) // 2)
        return current[top_indices(ctx.deviation_scores(self.deviation), keep)]


@dataclass(frozen=True)
class QueryProfiled(SelectionStrategy):
    """ProphetKV-style, measured over the whole model: a full-reuse pass (only the fresh tokens
    compute, about the cost of full reuse) records the attention the question pays every cached
    token in every layer and head; the tokens it leans on most are recomputed from layer 0.
    Needs no full check layer. Its measured cost and quality against plain CacheBlend:
    research/quality_notebook.md, "What it costs" and "Cutting the profile's cost"."""

    name: ClassVar[str] = "query_profiled"
    profile_layers: int | None = None
    profile_tokens: int | None = 16

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=0, profile=ProfileRequest(self.profile_layers, self.profile_tokens))

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "QueryProfiled":
        return cls(profile_layers=cfg.profile_layers, profile_tokens=cfg.profile_tokens)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return top_indices(ctx.question_attention(), ctx.budget)


@dataclass(frozen=True)
class ProfiledDeviation(SelectionStrategy):
    """Both signals at once: a profile pass (as ``query_profiled``) says which cached tokens the
    question reads, the check layer's deviation (as CacheBlend) says which ones cross-chunk
    attention changes. ``query_weight`` of the budget goes to the most read tokens, the rest to
    the most deviating of the others."""

    name: ClassVar[str] = "profiled_deviation"
    deviation: DeviationKind = "value"
    query_weight: float = 0.5
    profile_layers: int | None = None
    profile_tokens: int | None = 16

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=1, profile=ProfileRequest(self.profile_layers, self.profile_tokens))

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "ProfiledDeviation":
        return cls(deviation=cfg.deviation, query_weight=cfg.query_weight, profile_layers=cfg.profile_layers,
                   profile_tokens=cfg.profile_tokens)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        read = top_indices(ctx.question_attention(), int(round(self.query_weight * ctx.budget)))
        deviation = ctx.deviation_scores(self.deviation)
        deviation[read] = -math.inf
        rest = top_indices(deviation, ctx.budget - read.numel())
        return torch.sort(torch.cat([read, rest])).values


@dataclass(frozen=True)
class StaleImpact(SelectionStrategy):
    """The tokens whose stale KV would move the answer most: the attention the question pays a
    token (from a profile pass) times how far its V moves when its real context is restored (the
    check layer's deviation). A token the question never reads costs nothing however stale it is,
    and a read token whose KV barely changes needs no recompute."""

    name: ClassVar[str] = "stale_impact"
    deviation: DeviationKind = "value"
    profile_layers: int | None = None
    profile_tokens: int | None = 16

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=1, profile=ProfileRequest(self.profile_layers, self.profile_tokens))

    @classmethod
    def from_config(cls, cfg: BlendConfig) -> "StaleImpact":
        return cls(deviation=cfg.deviation, profile_layers=cfg.profile_layers, profile_tokens=cfg.profile_tokens)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        impact = ctx.question_attention().float() * ctx.deviation_scores(self.deviation).sqrt()
        return top_indices(impact, ctx.budget)


_REGISTRY: dict[str, type[SelectionStrategy]] = {}


def register_strategy(cls: type[SelectionStrategy]) -> type[SelectionStrategy]:
    """Make ``BlendConfig(selection=cls.name)`` build ``cls.from_config(config)``."""
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (KVDeviation, SinkAware, QueryAware, GradualFilter, QueryProfiled, ProfiledDeviation, StaleImpact):
    register_strategy(_cls)


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def strategy_class(name: str) -> type[SelectionStrategy]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"selection={name!r} is not supported; choose one of {', '.join(map(repr, available_strategies()))}"
        ) from None


def build_strategy(cfg: BlendConfig) -> SelectionStrategy:
    """The strategy ``cfg.selection`` names, with the settings ``cfg`` holds for it."""
    return strategy_class(cfg.selection).from_config(cfg)


def get_strategy(name: str) -> SelectionStrategy:
    """The strategy registered as ``name``, with its default settings."""
    return strategy_class(name)()
