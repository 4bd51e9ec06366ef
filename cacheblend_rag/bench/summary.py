"""A result document's per-method summaries: aggregates over the questions, paired comparisons
with full prefill and full reuse, bootstrap intervals, and a saved document summarised again over a
subset of its questions (:func:`restrict_document`).

Pure functions of the outcomes (:mod:`cacheblend_rag.bench.outcomes`): nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from cacheblend_rag.bench.methods import MethodSpec, parse_methods
from cacheblend_rag.bench.metrics import (
    bootstrap_interval,
    mean_or_none,
    recovery,
    recovery_interval,
    summarize,
)
from cacheblend_rag.bench.outcomes import ExampleOutcome, chunk_variant, outcome_from_dict, variant_name
from cacheblend_rag.errors import ConfigError

BOOTSTRAP_RESAMPLES = 5000


def summarize_methods(specs: list[MethodSpec], outcomes: list[ExampleOutcome]) -> list[dict[str, Any]]:
    """Per-method aggregates over all questions (see docs/benchmark_schema.md).

    A question may lack a method (a partial run, a resumed one still filling in), and a method its
    TTFT (full prefill's reference from the reference cache): every comparison between two methods
    is paired over the questions where both were measured."""
    full_prefill = MethodSpec("full_prefill").name
    full_reuse = MethodSpec("full_reuse").name

    def by_question(name: str, attr: str) -> dict[int, Any]:
        return {o.index: getattr(o.methods[name], attr) for o in outcomes if name in o.methods}

    def ttfts(name: str) -> dict[int, float]:
        return {i: float(np.median(t)) for i, t in by_question(name, "ttft_s").items() if t}

    reference_ttft = ttfts(full_prefill)
    reference_f1 = by_question(full_prefill, "f1")
    has_full_reuse = any(s.name == full_reuse for s in specs)
    full_reuse_kl = by_question(full_reuse, "kl") if has_full_reuse else None

    precompute_totals: dict[str, tuple[float, int, int]] = {}
    for variant in {variant_name(chunk_variant(s)) for s in specs if s.uses_chunk_cache}:
        seconds = sum(o.precompute_s.get(variant, 0.0) for o in outcomes)
        chunks = sum(len(o.chunk_tokens) for o in outcomes if variant in o.precompute_s)
        tokens = sum(sum(o.chunk_tokens) for o in outcomes if variant in o.precompute_s)
        precompute_totals[variant] = (seconds, chunks, tokens)

    summaries = []
    for spec in specs:
        name = spec.name
        rows = [o for o in outcomes if name in o.methods]
        ttft_map = ttfts(name)
        ttft = summarize(list(ttft_map.values()))
        # Speedup over the questions where both TTFTs were measured.
        common = sorted(set(ttft_map) & set(reference_ttft))
        speedup = None
        if common:
            method_median = float(np.median([ttft_map[i] for i in common]))
            reference_median = float(np.median([reference_ttft[i] for i in common]))
            speedup = reference_median / method_median if method_median else None
        cold = [v for v in by_question(name, "cold_ttft_s").values() if v is not None]
        throughput = [v for v in by_question(name, "throughput_request_s").values() if v is not None]
        decode = [v for v in by_question(name, "decode_tokens_per_s").values() if v is not None]
        recomputed = [o.methods[name].stats.get("recomputed_tokens") or 0 for o in rows]
        # Of the tokens a blend may recompute: an exact prefix (the cached lead) is outside the budget.
        cached = [(o.methods[name].stats.get("cached_tokens") or 0) - (o.methods[name].stats.get("exact_tokens") or 0)
                  for o in rows]
        precompute = None
        if spec.uses_chunk_cache:
            seconds, chunks, tokens = precompute_totals[variant_name(chunk_variant(spec))]
            precompute = {
                "ms_per_chunk": 1000 * seconds / chunks if chunks else None,
                "ms_per_1k_tokens": 1e6 * seconds / tokens if tokens else None,
            }
        summaries.append({
            **spec.to_dict(),
            "examples": len(rows),
            "ttft_s": ttft,
            "ttft_measured": len(ttft_map),
            "ttft_speedup": speedup,
            "cold_ttft_s": float(np.mean(cold)) if cold else None,
            "decode_tokens_per_s": float(np.median(decode)) if decode else None,
            "throughput_rps": len(throughput) / sum(throughput) if throughput else None,
            "throughput_requests": len(throughput),
            "precompute": precompute,
            "recompute_fraction": (sum(recomputed) / sum(cached)) if sum(cached) else None,
            "quality": _quality(spec, lambda attr, _name=name: by_question(_name, attr), reference_f1, full_reuse_kl),
        })
    return summaries


def _quality(spec: MethodSpec, by_question: Callable[[str], dict[int, Any]], reference_f1: dict[int, float],
             full_reuse_kl: dict[int, float] | None) -> dict[str, Any]:
    """A method's quality summary; comparisons are paired over the questions both methods have."""
    kl_map = by_question("kl")
    kls = list(kl_map.values())
    mean_kl = mean_or_none(kls)
    worse = None
    full_reuse_mean = None
    recovery_ci = None
    if full_reuse_kl is not None:
        paired = [i for i in kl_map if i in full_reuse_kl]
        worse = int(sum(kl_map[i] > full_reuse_kl[i] for i in paired))
        full_reuse_mean = mean_or_none([full_reuse_kl[i] for i in paired])
        # Full prefill's recovery is 1 and plain full reuse's 0 by definition (conditioned or compressed full
        # reuse is another method).
        if spec.kind != "full_prefill" and spec.name != MethodSpec("full_reuse").name:
            interval = recovery_interval([kl_map[i] for i in paired], [full_reuse_kl[i] for i in paired],
                                         resamples=BOOTSTRAP_RESAMPLES, seed=0)
            recovery_ci = None if interval is None else list(interval)
    f1_map = by_question("f1")
    f1_delta = [f1_map[i] - reference_f1[i] for i in f1_map if i in reference_f1]
    return {
        "f1": mean_or_none(list(f1_map.values())),
        "gold_em": mean_or_none([float(v) for v in by_question("gold_exact_match").values()]),
        # Paired over questions: the same question's F1 under full prefill is subtracted.
        "f1_delta": mean_or_none(f1_delta),
        "f1_delta_ci95": None if spec.kind == "full_prefill" else _interval(f1_delta),
        "kl": mean_kl,
        "kl_median": float(np.median(kls)) if kls else None,
        "top1": mean_or_none(list(by_question("top1").values())),
        "recovery": recovery(mean_kl, full_reuse_mean) if spec.kind != "full_prefill" else 1.0,
        "recovery_ci95": recovery_ci,
        "exact_match": mean_or_none([float(v) for v in by_question("exact_match").values()]),
        "worse_than_full_reuse": worse,
    }


def _interval(values: list[float]) -> list[float] | None:
    interval = bootstrap_interval(values, resamples=BOOTSTRAP_RESAMPLES, seed=0)
    return None if interval is None else list(interval)


def example_records(outcomes: list[ExampleOutcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]


def restrict_document(document: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    """``document`` summarised again over the questions whose data ``index`` is in ``indices`` (two
    runs compared on the questions both finished). TTFT speedups stay relative to full prefill on
    those questions; the data spread is left as it was."""
    keep = set(indices)
    outcomes = [outcome_from_dict(e) for e in document["examples"] if e["index"] in keep]
    if not outcomes:
        raise ConfigError(f"none of the questions {sorted(keep)} is in this result")
    summaries = summarize_methods(document_specs(document), outcomes)
    for summary, old in zip(summaries, document["methods"]):
        summary["added_as_reference"] = old["added_as_reference"]
    data = {**document["data"], "examples": len(outcomes),
            "selection": {**document["data"].get("selection", {}), "restricted_to": sorted(keep)}}
    return {**document, "data": data, "methods": summaries, "examples": [asdict(o) for o in outcomes]}


def document_specs(document: dict[str, Any]) -> list[MethodSpec]:
    """The methods of a saved document. A method's name is how ``--methods`` writes it, and only the name
    carries its corrections (``+keyshift``, ``+probeshift10``), so it is parsed back; a resolved ``default``
    has a label instead and records its fields."""
    specs = []
    for m in document["methods"]:
        if m.get("label") is None:
            (spec,) = parse_methods(m["name"], ratios=())
        else:
            spec = MethodSpec(kind=m["kind"], selection=m["selection"],
                              ratio=m["ratio"] if m["kind"] == "blend" else None,
                              prefix_conditioned=m["prefix_conditioned"], storage=m["storage"], label=m["label"],
                              overrides=tuple((m.get("overrides") or {}).items()), source=m.get("source"))
        specs.append(spec)
    return specs
