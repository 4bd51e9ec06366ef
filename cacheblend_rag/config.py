"""Validated configuration objects for blending and generation.

Every check raises :class:`ConfigError` naming the field, the value it got and
what it accepts, so a typo in a pipeline's settings fails where it is written.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from cacheblend_rag.errors import ConfigError

DeviationKind = Literal["value", "key"]
MaskKind = Literal["exact", "bottom_right"]


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}")


def _check_range(name: str, value: Any, lo: float, hi: float, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and math.isnan(value)):
        raise ConfigError(f"{name}={value!r} must be {'an integer' if integer else 'a number'} in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value!r} is out of range; allowed range is [{lo}, {hi}]")


@dataclass(frozen=True)
class BlendConfig:
    """How a prompt made of cached chunks is blended.

    recompute_ratio:
        Share of the *cached* tokens recomputed from ``check_layer`` on. ``0`` is
        full KV reuse (no layer recomputes a cached token, not even those before
        the check layer); ``1`` recomputes everything and equals full prefill.
    check_layer:
        Layer at which the tokens to recompute are chosen. Layers before it are
        recomputed for every token. ``None`` (default) takes the strategy's own:
        1 for deviation-based strategies, 0 for ``query_profiled`` (the engine works it
        out and checks it against the model's depth).
    deviation:
        ``"value"`` (CacheBlend's default) or ``"key"`` deviation ranks tokens.
    mask:
        ``"exact"`` is the causal mask by absolute position. ``"bottom_right"``
        reproduces the reference implementations, which align the selected
        queries to the end of the key sequence.
    selection:
        Name of a registered token-selection strategy. The default, ``query_profiled``,
        recovered the most of full prefill's quality at equal recompute in our MuSiQue
        measurement (docs/quality.md); ``kv_deviation`` is CacheBlend as published.
    sink_tokens:
        Tokens at the start of every chunk that sink-aware strategies always pick.
    profile_layers:
        How many of the first layers ``query_profiled``'s full-reuse pass runs (and scores the
        question's attention in). ``None``: every layer. Fewer make the pass cheaper and the
        choice worse (measured in docs/quality.md).
    profile_tokens:
        How many of the question's last tokens (the last fresh segment) ``query_profiled``'s pass
        runs; the earlier ones are left out of the pass (the blend still computes them all).
        ``None``: the whole segment. On RAG prompts that segment opens with a fixed instruction
        that tells the pass little; what 16 saves and costs is measured in docs/quality.md
        ("Cutting the profile's cost").
    gate:
        Run the one-time correctness gate (ratio 1.0 against full prefill) per model.
    fallback_to_full_prefill:
        When the architecture is unsupported or the gate fails, answer with full
        prefill instead of raising.
    """

    recompute_ratio: float = 0.15
    check_layer: int | None = None
    deviation: DeviationKind = "value"
    mask: MaskKind = "exact"
    selection: str = "query_profiled"
    sink_tokens: int = 4
    query_weight: float = 0.5
    gradual_expand: float = 2.0
    profile_layers: int | None = None
    profile_tokens: int | None = 16
    gate: bool = True
    gate_tolerance: float | None = None
    fallback_to_full_prefill: bool = False

    def __post_init__(self) -> None:
        _check_range("recompute_ratio", self.recompute_ratio, 0.0, 1.0)
        if self.check_layer is not None:
            _check_range("check_layer", self.check_layer, 0, 10_000, integer=True)
        _check_choice("deviation", self.deviation, ("value", "key"))
        _check_choice("mask", self.mask, ("exact", "bottom_right"))
        _check_range("sink_tokens", self.sink_tokens, 0, 1_000_000, integer=True)
        _check_range("query_weight", self.query_weight, 0.0, 1.0)
        _check_range("gradual_expand", self.gradual_expand, 1.0, 100.0)
        if self.profile_layers is not None:
            _check_range("profile_layers", self.profile_layers, 1, 10_000, integer=True)
        if self.profile_tokens is not None:
            _check_range("profile_tokens", self.profile_tokens, 1, 1_000_000, integer=True)
        if self.gate_tolerance is not None:
            _check_range("gate_tolerance", self.gate_tolerance, 0.0, 1e6)
        # Which strategies exist is the engine's registry (plugins may add some); the engine and the
        # integrations check the name against it when the config is first used.
        if not isinstance(self.selection, str) or not self.selection:
            raise ConfigError(f"selection={self.selection!r} must be the name of a selection strategy, "
                              "e.g. 'query_profiled' or 'kv_deviation'")

    def with_overrides(self, **overrides: Any) -> "BlendConfig":
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check_range("max_new_tokens", self.max_new_tokens, 1, 1_000_000, integer=True)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0 or isinstance(self.top_p, bool):
            raise ConfigError(f"top_p={self.top_p!r} is out of range; allowed range is (0, 1]")
        _check_range("top_k", self.top_k, 0, 10_000_000, integer=True)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop={self.stop!r} must hold non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
