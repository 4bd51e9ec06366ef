"""The MuSiQue benchmark: every method on every question, then per-method summaries.

Per question:

1. build the prompt (:mod:`cacheblend_rag.bench.prompt`);
2. precompute its passages once per prefix variant into a fresh chunk store (timed: the
   precompute cost), and the prefix-caching prefix once;
3. run full prefill first: its greedy answer is the reference for fidelity;
4. for every method, one full request (TTFT, decoding, answer, teacher-forced logits),
   ``repeats - 1`` more TTFT-only requests, and on the first ``cold_examples`` questions
   a cold request against an empty store, and on the first ``throughput_requests``
   questions one request decoding exactly ``throughput_new_tokens`` tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from cacheblend_rag.bench.methods import (
    MethodSpec,
    PrefixMode,
    parse_methods,
    parse_ratios,
    resolve_default,
    with_references,
)
from cacheblend_rag.bench.metrics import (
    answer_in_text,
    answers_match,
    bootstrap_interval,
    gold_exact_match,
    gold_f1,
    mean_or_none,
    recovery,
    summarize,
    token_kl,
    top1_agreement,
)
from cacheblend_rag.bench.prompt import BenchPrompt, MusiqueExample, build_prompt, load_musique
from cacheblend_rag.bench.requests import (
    BlendRequest,
    FullPrefillRequest,
    PrefillOutput,
    PrefixCachingRequest,
    Request,
    RequestRun,
    run_request,
    time_to_first_token,
)
from cacheblend_rag.bench.stores import ChunkStoreFactory, StoreKind
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.codec import STORAGE_DTYPES

logger = logging.getLogger(__name__)

DEFAULT_METHODS = "full_prefill,prefix_caching,full_reuse,cacheblend"
BOOTSTRAP_RESAMPLES = 5000


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

    def __post_init__(self) -> None:
        self.ratios = tuple(parse_ratios(self.ratios if isinstance(self.ratios, str) else list(self.ratios)))
        if self.prefix_conditioned not in ("off", "on", "both"):
            raise ConfigError(f"prefix_conditioned={self.prefix_conditioned!r}; choose one of 'off', 'on', 'both'")
        if self.store not in ("memory", "disk"):
            raise ConfigError(f"store={self.store!r}; choose 'memory' or 'disk'")
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


@dataclass
class MethodOutcome:
    """One method on one question."""

    answer: str
    f1: float
    gold_exact_match: bool  # SQuAD exact match against the gold answers
    exact_match: bool  # the answer equals full prefill's
    kl: float
    top1: float
    ttft_s: list[float]
    decode_tokens_per_s: float | None
    cold_ttft_s: float | None = None
    throughput_request_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)


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


Variant = tuple[bool, str | None]  # (prefix-conditioned, storage codec or None for the run's)


def _variant(spec: MethodSpec) -> Variant:
    return spec.prefix_conditioned, spec.storage


def _variant_name(variant: Variant) -> str:
    prefix_conditioned, storage = variant
    return ("prefix" if prefix_conditioned else "plain") + (f":{storage}" if storage else "")


class BenchmarkRunner:
    """Runs one :class:`BenchConfig` on one engine."""

    def __init__(self, engine: CacheBlendEngine, config: BenchConfig) -> None:
        if engine.tokenizer is None:
            raise ConfigError("the benchmark needs an engine with a tokenizer")
        self.engine = engine
        self.config = config
        specs, self.added_specs = config.method_specs()
        # "default" is what this engine uses for its model: known only now that the model is loaded.
        self.specs = [resolve_default(s, engine) for s in specs]
        base = engine.config
        if config.check_layer is not None:
            base = base.with_overrides(check_layer=config.check_layer)
        if config.blend_options:
            base = base.with_overrides(**config.blend_options)
        engine.plan(base)
        self.base_blend = base
        self.variants = sorted({_variant(s) for s in self.specs if s.uses_chunk_cache}, key=_variant_name)
        self.eos_ids = eos_token_ids(engine)
        self.stores = ChunkStoreFactory(config.store, engine, config.store_dir, config.storage_dtype)
        self.selection: dict[str, Any] | None = None  # set by run(): which questions ran

    # ----------------------------------------------------------------- run
    def run(self, examples: list[MusiqueExample],
            on_example: Callable[[list[ExampleOutcome]], None] | None = None) -> list[ExampleOutcome]:
        """Every method on every (kept) question; ``on_example`` sees the outcomes so far after each one."""
        if not examples:
            raise ConfigError("no examples to run; check --data and --n")
        prompts = [self.prompt(ex) for ex in examples]
        kept = list(range(len(examples)))
        if self.config.answerable:
            kept = answerable(examples, prompts)
            # Said where a reader of the table sees it, not only in the JSON.
            logger.warning("--answerable: kept %d of %d questions (gold answer in the prompt)", len(kept), len(examples))
            if not kept:
                raise ConfigError(f"--answerable kept none of the {len(examples)} questions: no gold answer occurs in "
                                  "its prompt; raise --max-passage-tokens or --passages")
        self.selection = {"answerable": self.config.answerable, "kept": len(kept), "of": len(examples)}
        try:
            self._warm_up(prompts[kept[0]])
            outcomes = []
            bar = tqdm(total=len(kept), desc="bench", unit="question", disable=not self.config.show_progress)
            for position, index in enumerate(kept):
                outcomes.append(self._run_example(position, index, examples[index], prompts[index], bar))
                bar.update(1)
                if on_example is not None:
                    on_example(outcomes)
            bar.close()
        finally:
            self.stores.close()
        return outcomes

    def prompt(self, example: MusiqueExample) -> BenchPrompt:
        prompt = build_prompt(
            self.engine.tokenizer, example,
            passages=self.config.passages, max_passage_tokens=self.config.max_passage_tokens,
        )
        if prompt.num_tokens + self.config.max_new_tokens > self.engine.context_window:
            raise ConfigError(
                f"question {example.question!r}: the prompt has {prompt.num_tokens} tokens, which with "
                f"{self.config.max_new_tokens} new tokens exceeds the model's context of {self.engine.context_window}; "
                "lower --passages or set --max-passage-tokens"
            )
        return prompt

    def _warm_up(self, prompt: BenchPrompt) -> None:
        """One untimed pass over a short prompt: the one-time correctness gate, allocator and kernel
        warm-up must not land in the first timed request."""
        short = BenchPrompt(prompt.lead_ids, prompt.chunk_ids[:2], prompt.tail_ids, text="")
        requests: list[Request] = [FullPrefillRequest(self.engine, short.input_ids)]
        chunk_specs = [s for s in self.specs if s.uses_chunk_cache]
        if chunk_specs:
            chunks = self.engine.prefill_chunks(short.chunk_ids)
            segments = [short.lead_ids, *chunks, short.tail_ids]
            for spec in chunk_specs:
                requests.append(BlendRequest(self.engine, segments, spec.blend_config(self.base_blend), None))
        for request in requests:
            run_request(self.engine, request, max_new_tokens=2, eos_ids=self.eos_ids, teacher_limit=2)

    # ------------------------------------------------------------ one question
    def _run_example(self, position: int, index: int, example: MusiqueExample, prompt: BenchPrompt,
                     bar: Any) -> ExampleOutcome:
        """``index``: the question's place in the data; ``position``: its place in this run (the first
        ``cold_examples`` and ``throughput_requests`` runs get those measurements)."""
        cfg = self.config
        caches, precompute = self._precompute(prompt)
        prefix_state: PrefillOutput | None = None
        prefix_cache_s = None
        if any(s.kind == "prefix_caching" for s in self.specs):
            start = time.perf_counter()
            prefix_state = FullPrefillRequest(self.engine, prompt.input_ids[: prompt.prefix_cache_length]).prefill()
            prefix_cache_s = time.perf_counter() - start

        reference: RequestRun | None = None
        reference_tokens: list[int] = []
        outcomes: dict[str, MethodOutcome] = {}
        try:
            for spec in self.specs:
                bar.set_postfix_str(spec.name, refresh=True)
                request = self._request(spec, prompt, caches, prefix_state)
                run = run_request(
                    self.engine, request, max_new_tokens=cfg.max_new_tokens, eos_ids=self.eos_ids,
                    teacher_tokens=None if reference is None else reference_tokens,
                    teacher_limit=cfg.teacher_tokens,
                )
                if reference is None:  # full prefill, always first
                    reference = run
                    reference_tokens = run.answer_tokens(cfg.teacher_tokens)
                if run.stats.get("cache_misses"):
                    logger.warning("%s on question %d missed %d chunks in a warm store", spec.name, index,
                                   run.stats["cache_misses"])
                ttfts = [run.ttft_s] + [time_to_first_token(request) for _ in range(cfg.repeats - 1)]
                assert run.teacher_logits is not None and reference.teacher_logits is not None
                outcome = MethodOutcome(
                    answer=run.text,
                    f1=gold_f1(run.text, example.answers),
                    gold_exact_match=gold_exact_match(run.text, example.answers),
                    exact_match=answers_match(run.text, reference.text),
                    kl=float(token_kl(reference.teacher_logits, run.teacher_logits).mean()),
                    top1=top1_agreement(reference.teacher_logits, run.teacher_logits),
                    ttft_s=ttfts,
                    decode_tokens_per_s=run.decode_tokens_per_s,
                    stats={k: run.stats.get(k) for k in ("mode", "total_tokens", "cached_tokens", "reused_tokens",
                                                         "recomputed_tokens", "fresh_tokens", "exact_tokens", "cache_hits",
                                                         "cache_misses", "fallback_reason") if k in run.stats},
                )
                del run
                if position < cfg.cold_examples:
                    outcome.cold_ttft_s = self._cold_ttft(spec, prompt, outcome)
                if position < cfg.throughput_requests:
                    outcome.throughput_request_s = run_request(
                        self.engine, request, max_new_tokens=cfg.throughput_new_tokens, eos_ids=self.eos_ids,
                        ignore_eos=True, teacher_limit=0,
                    ).total_s
                outcomes[spec.name] = outcome
        finally:
            for cache in caches.values():
                self.stores.release(cache)

        assert reference is not None
        return ExampleOutcome(
            index=index,
            question=example.question,
            answers=example.answers,
            prompt_tokens=prompt.num_tokens,
            chunk_tokens=[len(c) for c in prompt.chunk_ids],
            reference_answer_tokens=len(reference_tokens),
            precompute_s=precompute,
            prefix_cache_s=prefix_cache_s,
            methods=outcomes,
        )

    def _precompute(self, prompt: BenchPrompt) -> tuple[dict[Variant, Any], dict[str, float]]:
        """A fresh chunk store per variant holding this prompt's passages, and the seconds each took."""
        caches: dict[Variant, Any] = {}
        precompute: dict[str, float] = {}
        for variant in self.variants:
            cache = self.stores.open(prompt.conditioning_prefix(variant[0]), variant[1])
            start = time.perf_counter()
            cache.warm(prompt.chunk_ids)
            precompute[_variant_name(variant)] = time.perf_counter() - start
            # The lead opens every prompt: stored losslessly it is an exact prefix. Once for the whole
            # run in practice, so not a per-question cost.
            cache.warm([prompt.lead_ids], prefix_ids=(), lossless=True)
            caches[variant] = cache
        return caches, precompute

    def _request(self, spec: MethodSpec, prompt: BenchPrompt, caches: dict[Variant, Any],
                 prefix_state: PrefillOutput | None) -> Request:
        if spec.kind == "full_prefill":
            return FullPrefillRequest(self.engine, prompt.input_ids)
        if spec.kind == "prefix_caching":
            return PrefixCachingRequest(self.engine, prompt.input_ids, prompt.prefix_cache_length, prefix_state)
        segments = prompt.stored_segments(prompt.conditioning_prefix(spec.prefix_conditioned))
        return BlendRequest(self.engine, segments, spec.blend_config(self.base_blend), caches[_variant(spec)])

    def _cold_ttft(self, spec: MethodSpec, prompt: BenchPrompt, outcome: MethodOutcome) -> float:
        """TTFT with nothing cached: chunks (or the prefix) are computed inside the request."""
        if spec.kind == "full_prefill":
            return outcome.ttft_s[0]  # nothing is ever cached
        if spec.kind == "prefix_caching":
            return time_to_first_token(
                PrefixCachingRequest(self.engine, prompt.input_ids, prompt.prefix_cache_length, None)
            )
        cache = self.stores.open(prompt.conditioning_prefix(spec.prefix_conditioned), spec.storage)
        try:
            segments = prompt.stored_segments(prompt.conditioning_prefix(spec.prefix_conditioned))
            return time_to_first_token(BlendRequest(self.engine, segments, spec.blend_config(self.base_blend), cache))
        finally:
            self.stores.release(cache)


def answerable(examples: list[MusiqueExample], prompts: list[BenchPrompt]) -> list[int]:
    """Indices of the questions whose gold answer occurs in the passages as the prompt holds them
    (after truncation to ``max_passage_tokens``)."""
    return [i for i, (example, prompt) in enumerate(zip(examples, prompts))
            if answer_in_text(example.answers, "".join(prompt.passage_texts))]


# --------------------------------------------------------------------------- summaries
def summarize_methods(specs: list[MethodSpec], outcomes: list[ExampleOutcome]) -> list[dict[str, Any]]:
    """Per-method aggregates over all questions (see docs/benchmark_schema.md)."""
    full_prefill = MethodSpec("full_prefill").name
    full_reuse = MethodSpec("full_reuse").name

    def per_example(name: str, attr: str) -> list[Any]:
        return [getattr(o.methods[name], attr) for o in outcomes if name in o.methods]

    ttft_by_method = {s.name: [float(np.median(o.methods[s.name].ttft_s)) for o in outcomes] for s in specs}
    reference_f1 = per_example(full_prefill, "f1")
    reference_ttft = summarize(ttft_by_method[full_prefill])["median"]
    full_reuse_kl = per_example(full_reuse, "kl") if any(s.name == full_reuse for s in specs) else None
    full_reuse_mean = mean_or_none(full_reuse_kl) if full_reuse_kl else None

    precompute_totals: dict[str, tuple[float, int, int]] = {}
    for variant in {_variant_name(_variant(s)) for s in specs if s.uses_chunk_cache}:
        seconds = sum(o.precompute_s.get(variant, 0.0) for o in outcomes)
        chunks = sum(len(o.chunk_tokens) for o in outcomes if variant in o.precompute_s)
        tokens = sum(sum(o.chunk_tokens) for o in outcomes if variant in o.precompute_s)
        precompute_totals[variant] = (seconds, chunks, tokens)

    summaries = []
    for spec in specs:
        name = spec.name
        ttft = summarize(ttft_by_method[name])
        kls = per_example(name, "kl")
        mean_kl = mean_or_none(kls)
        cold = [v for v in per_example(name, "cold_ttft_s") if v is not None]
        throughput = [v for v in per_example(name, "throughput_request_s") if v is not None]
        decode = [v for v in per_example(name, "decode_tokens_per_s") if v is not None]
        recomputed = [o.methods[name].stats.get("recomputed_tokens") or 0 for o in outcomes]
        # Of the tokens a blend may recompute: an exact prefix (the cached lead) is outside the budget.
        cached = [(o.methods[name].stats.get("cached_tokens") or 0) - (o.methods[name].stats.get("exact_tokens") or 0)
                  for o in outcomes]
        precompute = None
        if spec.uses_chunk_cache:
            seconds, chunks, tokens = precompute_totals[_variant_name(_variant(spec))]
            precompute = {
                "ms_per_chunk": 1000 * seconds / chunks if chunks else None,
                "ms_per_1k_tokens": 1e6 * seconds / tokens if tokens else None,
            }
        worse = None
        if full_reuse_kl is not None:
            worse = int(sum(kl > ref for kl, ref in zip(kls, full_reuse_kl)))
        f1_delta = [f1 - ref for f1, ref in zip(per_example(name, "f1"), reference_f1)]
        summaries.append({
            **spec.to_dict(),
            "examples": len(outcomes),
            "ttft_s": ttft,
            "ttft_speedup": (reference_ttft / ttft["median"]) if reference_ttft and ttft["median"] else None,
            "cold_ttft_s": float(np.mean(cold)) if cold else None,
            "decode_tokens_per_s": float(np.median(decode)) if decode else None,
            "throughput_rps": len(throughput) / sum(throughput) if throughput else None,
            "throughput_requests": len(throughput),
            "precompute": precompute,
            "recompute_fraction": (sum(recomputed) / sum(cached)) if sum(cached) else None,
            "quality": {
                "f1": mean_or_none(per_example(name, "f1")),
                "gold_em": mean_or_none([float(v) for v in per_example(name, "gold_exact_match")]),
                # Paired over questions: the same question's F1 under full prefill is subtracted.
                "f1_delta": mean_or_none(f1_delta),
                "f1_delta_ci95": None if spec.kind == "full_prefill" else _interval(f1_delta),
                "kl": mean_kl,
                "kl_median": float(np.median(kls)) if kls else None,
                "top1": mean_or_none(per_example(name, "top1")),
                "recovery": recovery(mean_kl, full_reuse_mean) if spec.kind != "full_prefill" else 1.0,
                "exact_match": mean_or_none([float(v) for v in per_example(name, "exact_match")]),
                "worse_than_full_reuse": worse,
            },
        })
    return summaries


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
    outcomes = [
        ExampleOutcome(**{**e, "methods": {name: MethodOutcome(**m) for name, m in e["methods"].items()}})
        for e in document["examples"] if e["index"] in keep
    ]
    if not outcomes:
        raise ConfigError(f"none of the questions {sorted(keep)} is in this result")
    specs = [MethodSpec(kind=m["kind"], selection=m["selection"], ratio=m["ratio"] if m["kind"] == "blend" else None,
                        prefix_conditioned=m["prefix_conditioned"], storage=m["storage"], label=m.get("label"),
                        overrides=tuple((m.get("overrides") or {}).items()), source=m.get("source"))
             for m in document["methods"]]
    summaries = summarize_methods(specs, outcomes)
    for summary, old in zip(summaries, document["methods"]):
        summary["added_as_reference"] = old["added_as_reference"]
    data = {**document["data"], "examples": len(outcomes),
            "selection": {**document["data"].get("selection", {}), "restricted_to": sorted(keep)}}
    return {**document, "data": data, "methods": summaries, "examples": [asdict(o) for o in outcomes]}


def run_benchmark(config: BenchConfig, engine: CacheBlendEngine | None = None,
                  on_partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the result document (see docs/benchmark_schema.md).

    ``on_partial`` gets the document of the questions done so far after each question (``partial``
    true until the last), so a long run that is stopped keeps what it measured."""
    from cacheblend_rag.bench.report import build_document, git_info

    # The commit whose code runs; taken now, as a long run can outlive several commits.
    git = git_info()
    examples = load_musique(config.data, config.n)
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(config.model, device=config.device)
    runner = BenchmarkRunner(engine, config)
    backend = runner.stores.backend_name
    started = time.time()

    def document(outcomes: list[ExampleOutcome]) -> dict[str, Any]:
        return build_document(
            config=config, engine=engine, specs=runner.specs, added=runner.added_specs,
            blend_config=runner.base_blend, store_backend=backend, outcomes=outcomes,
            summaries=summarize_methods(runner.specs, outcomes), elapsed_s=time.time() - started, git=git,
            selection=runner.selection,
        )

    def partial(outcomes: list[ExampleOutcome]) -> None:
        if on_partial is not None:
            on_partial({**document(outcomes), "partial": len(outcomes) < runner.selection["kept"]})

    return {**document(runner.run(examples, on_example=partial)), "partial": False}
