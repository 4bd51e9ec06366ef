"""What a benchmark run is asked for: :class:`BenchConfig`, checked when it is made.

Kept apart from the runner (:mod:`cacheblend_rag.bench.runner`) so that the command line
(:mod:`cacheblend_rag.bench.commands`) can build and check a run's settings on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from cacheblend_rag.bench.methods import MethodSpec, PrefixMode, parse_methods, parse_ratios, with_references
from cacheblend_rag.bench.stores import StoreKind
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.format.codec import STORAGE_DTYPES

DEFAULT_METHODS = "full_prefill,prefix_caching,full_reuse,cacheblend"


@dataclass
class BenchConfig:
    """Everything a run depends on; mirrors the ``cacheblend-rag bench`` options."""

    data: str
    n: int | None = None
    passages: int = 10
    max_passage_tokens: int | None = None
    # Keep only questions whose gold answer is in the prompt once passages are cut (see answerable()).
    answerable: bool = False
    ratios: tuple[float, ...] = (0.05, 0.15, 0.3)
    methods: str = DEFAULT_METHODS
    prefix_conditioned: PrefixMode = "off"
    store: StoreKind = "memory"
    store_dir: str | None = None
    # A persistent disk store shared by every question and every later run (``--store disk:PATH``).
    store_path: str | None = None
    storage_dtype: str = "auto"
    max_new_tokens: int = 32
    teacher_tokens: int = 16
    repeats: int = 1
    cold_examples: int = 1
    throughput_requests: int = 4
    throughput_new_tokens: int = 32
    check_layer: int | None = None
    # Other BlendConfig fields for every method, e.g. {"sink_tokens": 8}; ratio and selection come per method.
    blend_options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    device: str | None = None
    show_progress: bool = True
    # Full prefill's references (answer, teacher-forced logits) kept here across runs (references.py).
    reference_cache: str | None = None
    reference_kv: bool = False  # keep full prefill's prompt K/V in the reference cache too
    # With a cached reference full prefill is not run, so not timed; this times its TTFT anyway.
    time_full_prefill: bool = False
    diagnostics: bool = False  # per-position KL, K/V distance and attention on stale entries (diagnostics.py)

    def __post_init__(self) -> None:
        self.ratios = tuple(parse_ratios(self.ratios if isinstance(self.ratios, str) else list(self.ratios)))
        if self.prefix_conditioned not in ("off", "on", "both"):
            raise ConfigError(f"prefix_conditioned={self.prefix_conditioned!r}; choose one of 'off', 'on', 'both'")
        if self.store not in ("memory", "disk"):
            raise ConfigError(f"store={self.store!r}; choose 'memory' or 'disk'")
        if self.store_path is not None and self.store != "disk":
            raise ConfigError(f"store_path={self.store_path!r} is a persistent disk store; set store='disk'")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype={self.storage_dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
        _positive("passages", self.passages)
        _positive("max_new_tokens", self.max_new_tokens)
        _positive("teacher_tokens", self.teacher_tokens)
        _positive("repeats", self.repeats)
        _positive("throughput_new_tokens", self.throughput_new_tokens)
        for name in ("n", "max_passage_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("cold_examples", "throughput_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0 (0 skips that measurement)")
        allowed = {f.name for f in fields(BlendConfig)} - {"recompute_ratio", "selection"}
        unknown = sorted(set(self.blend_options) - allowed)
        if unknown:
            raise ConfigError(
                f"blend option(s) {unknown} are not BlendConfig fields a run can set; allowed: {sorted(allowed)} "
                "(ratio and selection are given per method by --methods and --ratios)"
            )
        if self.max_new_tokens < self.teacher_tokens:
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} is below teacher_tokens={self.teacher_tokens}: full prefill's "
                "answer must be at least as long as the teacher-forced span; raise --max-new-tokens"
            )
        self.method_specs()  # a bad --methods fails here, before a model is loaded

    def method_specs(self) -> tuple[list[MethodSpec], list[MethodSpec]]:
        specs, added = with_references(parse_methods(self.methods, self.ratios, self.prefix_conditioned))
        # Full prefill runs first on every question: its answer is what the others are forced along.
        specs.sort(key=lambda s: s.kind != "full_prefill")
        return specs, added


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
