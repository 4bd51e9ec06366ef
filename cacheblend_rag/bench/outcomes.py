"""What a benchmark run measures: one method on one question (:class:`MethodOutcome`), one
question with all its methods (:class:`ExampleOutcome`), and reading them back from a result document.

Shared by the runner that fills them in (:mod:`cacheblend_rag.bench.runner`) and the summaries
that aggregate them (:mod:`cacheblend_rag.bench.summary`), along with the chunk-store variant a
method reads (the key of ``precompute_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from cacheblend_rag.bench.methods import MethodSpec


@dataclass
class MethodOutcome:
    """One method on one question."""

    answer: str
    f1: float
    gold_exact_match: bool  # SQuAD exact match against the gold answers
    exact_match: bool  # the answer equals full prefill's
    kl: float
    top1: float
    ttft_s: list[float] | None  # None: not measured (full prefill's reference came from the reference cache)
    decode_tokens_per_s: float | None
    cold_ttft_s: float | None = None
    throughput_request_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    diagnostics: dict[str, Any] | None = None  # with --diagnostics (cacheblend_rag.bench.diagnostics)


@dataclass
class ExampleOutcome:
    index: int
    question: str
    answers: list[str]
    prompt_tokens: int
    chunk_tokens: list[int]
    reference_answer_tokens: int
    precompute_s: dict[str, float]  # chunk variant ("plain", "prefix", "prefix:int8") -> seconds for all its chunks
    prefix_cache_s: float | None
    methods: dict[str, MethodOutcome]
    # chunk variant -> chunks a persistent store already held (no precompute time is recorded for those)
    chunks_from_store: dict[str, int] = field(default_factory=dict)


Variant = tuple[bool, str | None]  # (prefix-conditioned, storage codec or None for the run's)


def chunk_variant(spec: MethodSpec) -> Variant:
    return spec.prefix_conditioned, spec.storage


def variant_name(variant: Variant) -> str:
    prefix_conditioned, storage = variant
    return ("prefix" if prefix_conditioned else "plain") + (f":{storage}" if storage else "")


def outcome_from_dict(record: dict[str, Any]) -> ExampleOutcome:
    """An :class:`ExampleOutcome` read back from a result document's ``examples``."""
    known = {f.name for f in fields(MethodOutcome)}
    methods = {name: MethodOutcome(**{k: v for k, v in m.items() if k in known}) for name, m in record["methods"].items()}
    keep = {f.name for f in fields(ExampleOutcome)} - {"methods"}
    return ExampleOutcome(**{k: v for k, v in record.items() if k in keep}, methods=methods)
