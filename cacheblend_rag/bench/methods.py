"""The methods a benchmark run compares, and how ``--methods`` names them.

Grammar of one ``--methods`` item: ``NAME[+prefix][@RATIO][:STORAGE]``.

- ``full_prefill``: the model's own forward over the whole prompt (the reference).
- ``prefix_caching``: what vLLM/SGLang prefix caching reuses here: the KV of everything up to
  and including the first passage, computed at its true positions; the rest is computed.
- ``full_reuse``: every passage's cached KV is reused as is (ratio 0).
- ``cacheblend``: CacheBlend as published (``kv_deviation`` selection), at every ``--ratios``
  value unless ``@RATIO`` pins one. ``kv_deviation`` is accepted as the same method.
- any other registered selection strategy (``sink_aware``, ``query_aware``, ``gradual``, ...):
  the blend with that selection, at every ratio.
- ``+prefix``: passages are precomputed behind the prompt text that really precedes them
  (the rendered system turn, the user header and ``Passages:``) and the stand-in passage of
  ``cacheblend_rag.reuse.prompt``, instead of behind nothing.
  Only methods that reuse chunk KV (``full_reuse`` and blends) take it.
- ``:STORAGE``: the chunk KV of this method is stored with this codec (``int8``, ``int4``,
  ``float16``, ...; :mod:`cacheblend_rag.store.format.codec`) instead of the run's ``--storage-dtype``.
  Only methods that reuse chunk KV take it. Recovery and "worse than full reuse" stay measured
  against plain ``full_reuse`` at the run's storage, one yardstick for every codec.
- ``all``: full prefill, prefix caching, full reuse and every registered strategy.
- ``default``: whatever the engine uses for the loaded model when given no setting: the setting
  ``cacheblend-rag calibrate`` saved for it, else the built-in one (chunks prefix-conditioned as
  the integrations compute them, unless the calibration chose otherwise). Shown as ``default``,
  with the setting and its source beside it (:func:`resolve_default`).

Result names are unambiguous: ``full_prefill``, ``prefix_caching``, ``full_reuse``,
``full_reuse+prefix``, ``cacheblend@0.15``, ``sink_aware+prefix@0.15``, ``full_reuse:int8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.calibration.lookup import (CALIBRATED_FIELDS, DEFAULT_CONDITION_CHUNKS, describe_config,
                                              PROBE_SHIFT_STRIDE, PROBE_SHIFT_WINDOW,
                                              correction_suffix)
from cacheblend_rag.engine.selection import available_strategies
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.format.codec import STORAGE_DTYPES

MethodKind = Literal["full_prefill", "prefix_caching", "full_reuse", "blend", "default"]
PrefixMode = Literal["off", "on", "both"]

PREFIX_SUFFIX = "+prefix"
# A blend with BlendConfig.stale_key_correction at 1 (the chunks' stale keys moved by their recomputed tokens'
# mean change); ``+keyshift0.5`` for another share.
KEYSHIFT_SUFFIX = "+keyshift"
# Probe tokens every 20 tokens of each chunk (``+probeshift10``: every 10), whose mean K and V change moves the
# stale keys and values of their window of 100 tokens (BlendConfig.shift_probe_stride, both corrections at 1,
# shift_window 100).
PROBESHIFT_SUFFIX = "+probeshift"
# CacheBlend as published; shown under its own name rather than its selection's.
CACHEBLEND = "cacheblend"
CACHEBLEND_SELECTION = "kv_deviation"
DEFAULT = "default"
_BASELINES = ("full_prefill", "prefix_caching", "full_reuse")


@dataclass(frozen=True)
class MethodSpec:
    kind: MethodKind
    selection: str | None = None  # blends only
    ratio: float | None = None  # blends: recompute ratio; full_reuse: 0
    prefix_conditioned: bool = False
    storage: str | None = None  # the codec of this method's chunk KV; None: the run's --storage-dtype
    # ``default`` once resolved (resolve_default): its name, its other BlendConfig fields, its source
    label: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    source: str | None = None

    @property
    def uses_chunk_cache(self) -> bool:
        return self.kind in ("full_reuse", "blend", DEFAULT)

    @property
    def setting(self) -> str:
        """What it runs, named as ``--methods`` would (``default`` resolved: its setting's own name)."""
        if self.kind == "blend":
            return describe_config(self.blend_config(BlendConfig()), self.prefix_conditioned)
        return self.kind + (PREFIX_SUFFIX if self.prefix_conditioned else "")

    @property
    def family(self) -> str:
        """The method without its ratio: ``cacheblend``, ``sink_aware+prefix``, ``full_prefill``..."""
        if self.label is not None:
            return self.label
        if self.kind == "blend":
            base = CACHEBLEND if self.selection == CACHEBLEND_SELECTION else str(self.selection)
        else:
            base = self.kind
        fields = dict(self.overrides)
        correction = correction_suffix(fields.get("stale_key_correction", 0.0),
                                       fields.get("stale_value_correction", 0.0),
                                       fields.get("shift_probe_stride", 0), fields.get("shift_window", 0))
        return base + (PREFIX_SUFFIX if self.prefix_conditioned else "") + correction

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        name = f"{self.family}@{format_ratio(self.ratio)}" if self.kind == "blend" else self.family
        return name + (f":{self.storage}" if self.storage else "")

    def blend_config(self, base: BlendConfig) -> BlendConfig:
        if self.kind == DEFAULT:
            raise ValueError("the default method is resolved against an engine first (resolve_default)")
        if self.kind == "full_reuse":
            return base.with_overrides(**dict(self.overrides), recompute_ratio=0.0)
        if self.kind == "blend":
            return base.with_overrides(**dict(self.overrides), recompute_ratio=self.ratio, selection=self.selection)
        raise ValueError(f"{self.name} does not blend cached chunks")

    def to_dict(self) -> dict:
        extra = {} if self.label is None else {"label": self.label, "setting": self.setting, "source": self.source,
                                               "overrides": dict(self.overrides)}
        return {**extra,
            "name": self.name,
            "family": self.family,
            "kind": self.kind,
            "selection": self.selection,
            "ratio": 0.0 if self.kind == "full_reuse" else self.ratio,
            "prefix_conditioned": self.prefix_conditioned,
            "storage": self.storage,
        }


def format_ratio(ratio: float | None) -> str:
    return f"{ratio:g}" if ratio is not None else "-"


def parse_ratios(text: str | Sequence[float]) -> list[float]:
    """``"0.05,0.15,0.3"`` -> ``[0.05, 0.15, 0.3]``; each must lie in (0, 1]."""
    items = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    ratios: list[float] = []
    for item in items:
        if item == "":
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"--ratios: {item!r} is not a number; pass e.g. --ratios 0.05,0.15,0.3") from None
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                f"--ratios: {value:g} is out of range; recompute ratios lie in (0, 1] "
                "(ratio 0 is the full_reuse method)"
            )
        if value not in ratios:
            ratios.append(value)
    if not ratios:
        raise ConfigError("--ratios is empty; pass e.g. --ratios 0.05,0.15,0.3")
    return ratios


def parse_methods(text: str, ratios: Sequence[float], prefix_conditioned: PrefixMode = "off") -> list[MethodSpec]:
    """Expand a ``--methods`` string into specs, in the order given, without duplicates.

    ``prefix_conditioned`` applies to every chunk-reusing method: ``off`` keeps the items as
    written, ``on`` makes them all prefix-conditioned, ``both`` runs each with and without.
    """
    if prefix_conditioned not in ("off", "on", "both"):
        raise ConfigError(f"prefix_conditioned={prefix_conditioned!r}; choose one of 'off', 'on', 'both'")
    strategies = available_strategies()
    allowed = [*_BASELINES, CACHEBLEND, *strategies, DEFAULT]
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ConfigError(f"--methods is empty; pass a comma-separated list of {', '.join(allowed)} or 'all'")
    if "all" in items:
        at = items.index("all")
        expanded = [*_BASELINES, CACHEBLEND, *(s for s in strategies if s != CACHEBLEND_SELECTION)]
        items = items[:at] + expanded + items[at + 1 :]

    specs: list[MethodSpec] = []
    for item in items:
        name, pinned = item, None
        name, _, storage = name.partition(":")
        if storage and storage not in STORAGE_DTYPES:
            raise ConfigError(f"--methods: {item!r}: storage {storage!r} is not one of {', '.join(STORAGE_DTYPES)}")
        if "@" in name:
            name, _, ratio_text = name.partition("@")
            pinned = parse_ratios(ratio_text)
        name, correction = _key_correction(name, item)
        name, probe_stride = _probe_shift(name, item)
        if correction and probe_stride:
            raise ConfigError(f"--methods: {item!r}: '{PROBESHIFT_SUFFIX}' sets the key correction itself (from its "
                              f"probes); drop '{KEYSHIFT_SUFFIX}'")
        prefixed = name.endswith(PREFIX_SUFFIX)
        if prefixed:
            name = name[: -len(PREFIX_SUFFIX)]
        if name not in allowed:
            raise ConfigError(
                f"--methods: unknown method {item!r}; choose from {', '.join(allowed)} or 'all', "
                f"optionally with '{PREFIX_SUFFIX}', '{KEYSHIFT_SUFFIX}' or '{PROBESHIFT_SUFFIX}' and '@RATIO' "
                f"(e.g. cacheblend{PREFIX_SUFFIX}@0.15)"
            )
        if (correction or probe_stride) and name in (*_BASELINES, DEFAULT):
            suffix = PROBESHIFT_SUFFIX if probe_stride else KEYSHIFT_SUFFIX
            raise ConfigError(f"--methods: {item!r}: {name} recomputes no chunk token, so it takes no "
                              f"'{suffix}' (a blend's stale K/V move by what its recomputed tokens saw)")
        overrides: tuple[tuple[str, Any], ...] = (("stale_key_correction", correction),) if correction else ()
        if probe_stride:
            overrides = (("shift_probe_stride", probe_stride), ("stale_key_correction", 1.0),
                         ("stale_value_correction", 1.0), ("shift_window", PROBE_SHIFT_WINDOW))
        if name == DEFAULT:
            if prefixed or pinned or storage:
                raise ConfigError(f"--methods: {item!r}: default is the engine's own setting for the model, whole; "
                                  f"it takes neither '{PREFIX_SUFFIX}', a ratio nor a storage codec")
            specs.append(MethodSpec(kind=DEFAULT))
            continue
        if name in ("full_prefill", "prefix_caching"):
            if prefixed or pinned or storage:
                raise ConfigError(
                    f"--methods: {item!r}: {name} reuses no chunk KV, so it takes neither "
                    f"'{PREFIX_SUFFIX}', a ratio nor a storage codec"
                )
            specs.append(MethodSpec(kind=name))
            continue
        if name == "full_reuse" and pinned:
            raise ConfigError(f"--methods: {item!r}: full_reuse is ratio 0 by definition; drop '@...'")
        variants = {"off": [prefixed], "on": [True], "both": [False, True]}[prefix_conditioned]
        for with_prefix in variants:
            if name == "full_reuse":
                specs.append(MethodSpec(kind="full_reuse", prefix_conditioned=with_prefix, storage=storage or None))
                continue
            selection = CACHEBLEND_SELECTION if name == CACHEBLEND else name
            for ratio in pinned or ratios:
                specs.append(MethodSpec("blend", selection, ratio, with_prefix, storage or None, overrides=overrides))

    unique: list[MethodSpec] = []
    for spec in specs:
        if spec not in unique:
            unique.append(spec)
    return unique


def _suffix_argument(name: str, suffix: str) -> tuple[str, str | None]:
    """``name`` without ``suffix`` and the argument written after it (``""`` when bare; ``None`` when the
    suffix is absent), wherever after the strategy the suffix stands."""
    head, found, rest = name.partition(suffix)
    if not found:
        return name, None
    argument = rest.split("+", 1)[0]
    return head + rest[len(argument):], argument


def _key_correction(name: str, item: str) -> tuple[str, float]:
    """``name`` without its ``+keyshift[VALUE]``, and the correction it asks for (0: none)."""
    name, digits = _suffix_argument(name, KEYSHIFT_SUFFIX)
    if digits is None:
        return name, 0.0
    try:
        value = float(digits) if digits else 1.0
        BlendConfig(stale_key_correction=value)
    except (ValueError, ConfigError):
        raise ConfigError(f"--methods: {item!r}: '{KEYSHIFT_SUFFIX}{digits}' wants a share in [0, 2] after it, or "
                          f"none for 1 (e.g. cacheblend{KEYSHIFT_SUFFIX}@0.15)") from None
    return name, value


def _probe_shift(name: str, item: str) -> tuple[str, int]:
    """``name`` without its ``+probeshift[STRIDE]``, and the probe stride it asks for (0: none)."""
    name, digits = _suffix_argument(name, PROBESHIFT_SUFFIX)
    if digits is None:
        return name, 0
    try:
        stride = int(digits) if digits else PROBE_SHIFT_STRIDE
        BlendConfig(shift_probe_stride=stride, stale_key_correction=1.0, stale_value_correction=1.0)
    except (ValueError, ConfigError):
        raise ConfigError(f"--methods: {item!r}: '{PROBESHIFT_SUFFIX}{digits}' wants a probe stride of 2 or more "
                          f"after it, or none for {PROBE_SHIFT_STRIDE} "
                          f"(e.g. cacheblend{PROBESHIFT_SUFFIX}@0.15)") from None
    return name, stride


def resolve_default(spec: MethodSpec, engine: Any) -> MethodSpec:
    """``default`` as the setting ``engine`` uses for its model when given none (calibrated or
    built in); any other spec as it is."""
    if spec.kind != DEFAULT:
        return spec
    config, source = engine.default_and_source()
    calibrated = engine.calibration() if source.startswith("calibrated") else None
    conditioned = calibrated.condition_chunks if calibrated is not None else DEFAULT_CONDITION_CHUNKS
    overrides = tuple((name, getattr(config, name)) for name in CALIBRATED_FIELDS
                      if name not in ("recompute_ratio", "selection"))
    kind = "full_reuse" if config.recompute_ratio == 0 else "blend"
    return MethodSpec(kind, None if kind == "full_reuse" else config.selection,
                      None if kind == "full_reuse" else config.recompute_ratio, conditioned,
                      label=DEFAULT, overrides=overrides, source=source)


def with_references(specs: Sequence[MethodSpec]) -> tuple[list[MethodSpec], list[MethodSpec]]:
    """Add what the metrics are relative to: full prefill (TTFT speedup, fidelity) and plain
    full reuse (recovery, "worse than full reuse"). Returns (all specs, the added ones)."""
    full_prefill = MethodSpec("full_prefill")
    full_reuse = MethodSpec("full_reuse")
    added: list[MethodSpec] = []
    out = list(specs)
    if full_prefill not in out:
        out.insert(0, full_prefill)
        added.append(full_prefill)
    if any(s.uses_chunk_cache for s in out) and full_reuse not in out:
        out.insert(out.index(full_prefill) + 1, full_reuse)
        added.append(full_reuse)
    return out, added
