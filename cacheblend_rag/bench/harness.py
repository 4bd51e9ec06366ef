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
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

import numpy as np
import torch
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
    recovery_interval,
    summarize,
    token_kl,
    top1_agreement,
)
from cacheblend_rag.bench.prompt import BenchPrompt, MusiqueExample, build_prompt, load_musique
from cacheblend_rag.bench.references import Reference, ReferenceCache
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


def _variant(spec: MethodSpec) -> Variant:
    return spec.prefix_conditioned, spec.storage


def _variant_name(variant: Variant) -> str:
    prefix_conditioned, storage = variant
    return ("prefix" if prefix_conditioned else "plain") + (f":{storage}" if storage else "")


def outcome_from_dict(record: dict[str, Any]) -> ExampleOutcome:
    """An :class:`ExampleOutcome` read back from a result document's ``examples``."""
    known = {f.name for f in fields(MethodOutcome)}
    methods = {name: MethodOutcome(**{k: v for k, v in m.items() if k in known}) for name, m in record["methods"].items()}
    keep = {f.name for f in fields(ExampleOutcome)} - {"methods"}
    return ExampleOutcome(**{k: v for k, v in record.items() if k in keep}, methods=methods)


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
        self.stores = ChunkStoreFactory(config.store, engine, config.store_dir, config.storage_dtype,
                                        persistent=config.store_path)
        self.references = ReferenceCache(config.reference_cache) if config.reference_cache else None
        self.selection: dict[str, Any] | None = None  # set by run(): which questions ran
        # What this run computed, for the document's "work": a rerun shows what it did not redo.
        self.work: dict[str, int] = {"questions_run": 0, "questions_kept": 0, "pairs_run": 0, "pairs_kept": 0,
                                     "full_prefill_runs": 0, "references_from_cache": 0, "blend_requests": 0,
                                     "chunks_computed": 0, "chunks_from_store": 0}
        self._warmed = False

    # ----------------------------------------------------------------- run
    def run(self, examples: list[MusiqueExample],
            on_example: Callable[[list[ExampleOutcome]], None] | None = None,
            previous: dict[int, ExampleOutcome] | None = None) -> list[ExampleOutcome]:
        """Every method on every (kept) question; ``on_example`` sees the outcomes so far after each
        method run (the question in progress last, with the methods it has). ``previous``: outcomes of
        an earlier run by data index (``--resume``); only the (question, method) pairs it lacks run."""
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
        previous = previous or {}
        try:
            outcomes: list[ExampleOutcome] = []
            bar = tqdm(total=len(kept), desc="bench", unit="question", disable=not self.config.show_progress)
            for position, index in enumerate(kept):
                before = previous.get(index)
                if before is not None and before.question != examples[index].question:
                    raise ConfigError(
                        f"--resume: question {index} of the result is {before.question!r}, the data's is "
                        f"{examples[index].question!r}; the data changed, write to another --out")

                def emit(current: ExampleOutcome) -> None:
                    if on_example is not None:
                        on_example([*outcomes, current])

                # emit() has shown every pair this question ran; a question kept whole adds nothing to write.
                outcomes.append(self._run_example(position, index, examples[index], prompts[index], bar, before, emit))
                bar.update(1)
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
        self._warmed = True
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

    def _is_done(self, spec: MethodSpec, outcome: MethodOutcome | None) -> bool:
        if outcome is None:
            return False
        # Asked for diagnostics, a pair measured without them is run again.
        return not (self.config.diagnostics and spec.kind != "full_prefill" and outcome.diagnostics is None)

    # ------------------------------------------------------------ one question
    def _run_example(self, position: int, index: int, example: MusiqueExample, prompt: BenchPrompt,
                     bar: Any, before: ExampleOutcome | None = None,
                     emit: Callable[[ExampleOutcome], None] | None = None) -> ExampleOutcome:
        """``index``: the question's place in the data; ``position``: its place in this run (the first
        ``cold_examples`` and ``throughput_requests`` runs get those measurements). ``before``: this
        question's outcome in an earlier run; its finished methods are kept, the others run."""
        cfg = self.config
        done = {s.name: before.methods[s.name] for s in self.specs
                if before is not None and self._is_done(s, before.methods.get(s.name))}
        todo = [s for s in self.specs if s.name not in done]
        record = ExampleOutcome(
            index=index, question=example.question, answers=example.answers, prompt_tokens=prompt.num_tokens,
            chunk_tokens=[len(c) for c in prompt.chunk_ids],
            reference_answer_tokens=before.reference_answer_tokens if before is not None else 0,
            precompute_s=dict(before.precompute_s) if before is not None else {},
            prefix_cache_s=before.prefix_cache_s if before is not None else None,
            methods={}, chunks_from_store=dict(before.chunks_from_store) if before is not None else {},
        )

        def ordered(methods: dict[str, MethodOutcome]) -> dict[str, MethodOutcome]:
            return {s.name: methods[s.name] for s in self.specs if s.name in methods}

        self.work["pairs_kept"] += len(done)
        if not todo:
            self.work["questions_kept"] += 1
            record.methods = ordered(done)
            return record
        self.work["questions_run"] += 1
        if not self._warmed:
            self._warm_up(prompt)

        chunk_todo = [s for s in todo if s.uses_chunk_cache]
        need_kv = cfg.diagnostics and bool(chunk_todo)
        reference, full_outcome = self._reference(todo[0].kind == "full_prefill", position, prompt, example, need_kv)
        record.reference_answer_tokens = len(reference.teacher_ids)
        methods = dict(done)
        if full_outcome is not None:
            methods["full_prefill"] = full_outcome
            self.work["pairs_run"] += 1
        record.methods = ordered(methods)
        if emit is not None and full_outcome is not None:
            emit(record)

        caches, precompute, from_store = self._precompute(prompt, {_variant(s) for s in chunk_todo})
        for name, seconds in precompute.items():
            record.precompute_s.setdefault(name, seconds)
        record.chunks_from_store.update(from_store)
        prefix_state: PrefillOutput | None = None
        if any(s.kind == "prefix_caching" for s in todo):
            start = time.perf_counter()
            prefix_state = FullPrefillRequest(self.engine, prompt.input_ids[: prompt.prefix_cache_length]).prefill()
            record.prefix_cache_s = time.perf_counter() - start

        try:
            for spec in todo:
                if spec.kind == "full_prefill":
                    continue
                bar.set_postfix_str(spec.name, refresh=True)
                outcome = self._run_method(spec, position, index, example, prompt, caches, prefix_state, reference)
                methods[spec.name] = outcome
                self.work["pairs_run"] += 1
                record.methods = ordered(methods)
                if emit is not None:
                    emit(record)
        finally:
            for cache in caches.values():
                self.stores.release(cache)
        return record

    def _reference(self, run_full_prefill: bool, position: int, prompt: BenchPrompt, example: MusiqueExample,
                   need_kv: bool) -> tuple[Reference, MethodOutcome | None]:
        """Full prefill's reference for ``prompt``, from the reference cache or computed (and stored);
        with ``run_full_prefill``, also full prefill's outcome (timed only when it was computed here,
        or with ``time_full_prefill``)."""
        cfg = self.config
        settings = dict(max_new_tokens=cfg.max_new_tokens, teacher_tokens=cfg.teacher_tokens)
        fingerprint = self.engine.fingerprint
        kv_shape = (self.engine.num_layers, self.engine.adapter.num_kv_heads, self.engine.adapter.head_dim) \
            if self.engine.adapter is not None else None
        keep_kv = need_kv or cfg.reference_kv
        reference = None
        if self.references is not None:
            reference = self.references.get(fingerprint, prompt.input_ids, need_kv=keep_kv, kv_shape=kv_shape,
                                            **settings)
        if reference is not None:
            self.work["references_from_cache"] += 1
            if not run_full_prefill:
                return reference, None
            ttfts = None
            if cfg.time_full_prefill:
                request = FullPrefillRequest(self.engine, prompt.input_ids)
                ttfts = [time_to_first_token(request) for _ in range(cfg.repeats)]
            outcome = self._outcome(reference.text, reference.teacher_logits, reference, example, ttfts, None,
                                    {"mode": "full_prefill", "total_tokens": prompt.num_tokens, "cached_tokens": 0,
                                     "reused_tokens": 0, "recomputed_tokens": 0, "fresh_tokens": prompt.num_tokens,
                                     "reference": "cached"})
            if ttfts is not None and position < cfg.cold_examples:
                outcome.cold_ttft_s = ttfts[0]  # nothing is ever cached
            return reference, outcome

        request = FullPrefillRequest(self.engine, prompt.input_ids)
        run = run_request(self.engine, request, max_new_tokens=cfg.max_new_tokens, eos_ids=self.eos_ids,
                          teacher_limit=cfg.teacher_tokens, keep_prompt_kv=keep_kv)
        self.work["full_prefill_runs"] += 1
        assert run.teacher_logits is not None
        reference = Reference(answer_ids=list(run.token_ids), stopped_by=run.stopped_by, text=run.text,
                              teacher_ids=run.answer_tokens(cfg.teacher_tokens), teacher_logits=run.teacher_logits,
                              kv=run.prompt_kv)
        if self.references is not None:
            try:
                self.references.put(fingerprint, prompt.input_ids, reference, **settings)
            except OSError as exc:  # a full or read-only disk costs the next run a prefill, not this run
                logger.warning("could not store full prefill's reference in %s (%s); the run goes on without",
                               self.references.root, exc)
        if not run_full_prefill:
            return reference, None
        ttfts = [run.ttft_s] + [time_to_first_token(request) for _ in range(cfg.repeats - 1)]
        outcome = self._outcome(run.text, run.teacher_logits, reference, example, ttfts, run.decode_tokens_per_s,
                                run.stats)
        if position < cfg.cold_examples:
            outcome.cold_ttft_s = ttfts[0]  # nothing is ever cached
        if position < cfg.throughput_requests:
            outcome.throughput_request_s = run_request(
                self.engine, request, max_new_tokens=cfg.throughput_new_tokens, eos_ids=self.eos_ids,
                ignore_eos=True, teacher_limit=0,
            ).total_s
        return reference, outcome

    def _outcome(self, text: str, teacher_logits: torch.Tensor, reference: Reference, example: MusiqueExample,
                 ttfts: list[float] | None, decode: float | None, stats: dict[str, Any]) -> MethodOutcome:
        return MethodOutcome(
            answer=text,
            f1=gold_f1(text, example.answers),
            gold_exact_match=gold_exact_match(text, example.answers),
            exact_match=answers_match(text, reference.text),
            kl=float(token_kl(reference.teacher_logits, teacher_logits).mean()),
            top1=top1_agreement(reference.teacher_logits, teacher_logits),
            ttft_s=ttfts,
            decode_tokens_per_s=decode,
            stats={k: stats.get(k) for k in ("mode", "total_tokens", "cached_tokens", "reused_tokens",
                                             "recomputed_tokens", "fresh_tokens", "exact_tokens", "cache_hits",
                                             "cache_misses", "fallback_reason", "reference") if k in stats},
        )

    def _run_method(self, spec: MethodSpec, position: int, index: int, example: MusiqueExample, prompt: BenchPrompt,
                    caches: dict[Variant, Any], prefix_state: PrefillOutput | None,
                    reference: Reference) -> MethodOutcome:
        cfg = self.config
        request = self._request(spec, prompt, caches, prefix_state)
        diagnose = cfg.diagnostics
        run = run_request(
            self.engine, request, max_new_tokens=cfg.max_new_tokens, eos_ids=self.eos_ids,
            teacher_tokens=reference.teacher_ids, teacher_limit=cfg.teacher_tokens,
            keep_prompt_kv=diagnose and spec.uses_chunk_cache,
        )
        if spec.uses_chunk_cache:
            self.work["blend_requests"] += 1
        if run.stats.get("cache_misses"):
            logger.warning("%s on question %d missed %d chunks in a warm store", spec.name, index,
                           run.stats["cache_misses"])
        ttfts = [run.ttft_s] + [time_to_first_token(request) for _ in range(cfg.repeats - 1)]
        assert run.teacher_logits is not None
        outcome = self._outcome(run.text, run.teacher_logits, reference, example, ttfts, run.decode_tokens_per_s,
                                run.stats)
        if diagnose:
            outcome.diagnostics = self._diagnostics(spec, prompt, run, reference)
        del run
        if position < cfg.cold_examples:
            outcome.cold_ttft_s = self._cold_ttft(spec, prompt, outcome)
        if position < cfg.throughput_requests:
            outcome.throughput_request_s = run_request(
                self.engine, request, max_new_tokens=cfg.throughput_new_tokens, eos_ids=self.eos_ids,
                ignore_eos=True, teacher_limit=0,
            ).total_s
        return outcome

    def _diagnostics(self, spec: MethodSpec, prompt: BenchPrompt, run: RequestRun,
                     reference: Reference) -> dict[str, Any]:
        from cacheblend_rag.bench.diagnostics import blend_diagnostics, kl_by_position

        assert run.teacher_logits is not None
        out: dict[str, Any] = {"kl_by_position": kl_by_position(reference.teacher_logits, run.teacher_logits)}
        if spec.uses_chunk_cache and run.prompt_kv is not None and reference.kv is not None \
                and self.engine.adapter is not None:
            _, check_layer = self.engine.plan(spec.blend_config(self.base_blend))
            out.update(blend_diagnostics(self.engine, prompt, run.stats, run.prompt_kv, reference.kv,
                                         spec.blend_config(self.base_blend), check_layer,
                                         blend_first_logits=run.teacher_logits[0]))
        return out

    def _precompute(self, prompt: BenchPrompt, variants: set[Variant]
                    ) -> tuple[dict[Variant, Any], dict[str, float], dict[str, int]]:
        """A chunk store per variant holding this prompt's passages, the seconds each took (only where
        every chunk was computed) and how many chunks a persistent store already held."""
        caches: dict[Variant, Any] = {}
        precompute: dict[str, float] = {}
        from_store: dict[str, int] = {}
        for variant in sorted(variants, key=_variant_name):
            cache = self.stores.open(prompt.conditioning_prefix(variant[0]), variant[1])
            start = time.perf_counter()
            summary = cache.warm(prompt.chunk_ids)
            seconds = time.perf_counter() - start
            self.work["chunks_computed"] += summary.new
            self.work["chunks_from_store"] += summary.present
            if summary.present == 0:
                precompute[_variant_name(variant)] = seconds
            else:
                # A lookup, not a precompute: timing it would report a precompute cost of nearly nothing.
                from_store[_variant_name(variant)] = summary.present
            # The lead opens every prompt: stored losslessly it is an exact prefix. Once for the whole
            # run in practice, so not a per-question cost.
            cache.warm([prompt.lead_ids], prefix_ids=(), lossless=True)
            caches[variant] = cache
        return caches, precompute, from_store

    def _request(self, spec: MethodSpec, prompt: BenchPrompt, caches: dict[Variant, Any],
                 prefix_state: PrefillOutput | None) -> Request:
        if spec.kind == "full_prefill":
            return FullPrefillRequest(self.engine, prompt.input_ids)
        if spec.kind == "prefix_caching":
            return PrefixCachingRequest(self.engine, prompt.input_ids, prompt.prefix_cache_length, prefix_state)
        segments = prompt.stored_segments(prompt.conditioning_prefix(spec.prefix_conditioned))
        return BlendRequest(self.engine, segments, spec.blend_config(self.base_blend), caches[_variant(spec)])

    def _cold_ttft(self, spec: MethodSpec, prompt: BenchPrompt, outcome: MethodOutcome) -> float | None:
        """TTFT with nothing cached: chunks (or the prefix) are computed inside the request."""
        if spec.kind == "full_prefill":
            return outcome.ttft_s[0] if outcome.ttft_s else None  # nothing is ever cached
        if spec.kind == "prefix_caching":
            return time_to_first_token(
                PrefixCachingRequest(self.engine, prompt.input_ids, prompt.prefix_cache_length, None)
            )
        cache = self.stores.open(prompt.conditioning_prefix(spec.prefix_conditioned), spec.storage, empty=True)
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
    for variant in {_variant_name(_variant(s)) for s in specs if s.uses_chunk_cache}:
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
            seconds, chunks, tokens = precompute_totals[_variant_name(_variant(spec))]
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


def run_benchmark(config: BenchConfig, engine: CacheBlendEngine | None = None,
                  on_partial: Callable[[dict[str, Any]], None] | None = None,
                  resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the result document (see docs/benchmark_schema.md).

    ``on_partial`` gets the document of what is done so far after each (question, method) pair
    (``partial`` true until every pair is in), so a long run that is stopped keeps what it measured.
    ``resume``: an earlier document of this benchmark (:mod:`cacheblend_rag.bench.resume`); its
    finished pairs are kept if its settings match this run's (a :class:`ConfigError` names the
    first difference otherwise), and only the missing pairs run."""
    from cacheblend_rag.bench.report import build_document, git_info
    from cacheblend_rag.bench.resume import check_resumable, data_digest

    # The commit whose code runs; taken now, as a long run can outlive several commits.
    git = git_info()
    examples = load_musique(config.data, config.n)
    data_sha = data_digest(config.data)
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(config.model, device=config.device)
    runner = BenchmarkRunner(engine, config)
    backend = runner.stores.backend_name
    started = time.time()

    def document(outcomes: list[ExampleOutcome]) -> dict[str, Any]:
        doc = build_document(
            config=config, engine=engine, specs=runner.specs, added=runner.added_specs,
            blend_config=runner.base_blend, store_backend=backend, outcomes=outcomes,
            summaries=summarize_methods(runner.specs, outcomes), elapsed_s=time.time() - started, git=git,
            selection=runner.selection,
        )
        doc["data"]["sha256"] = data_sha
        doc["work"] = dict(runner.work)
        if resume is not None:
            # The runs this document grew from: their pairs were measured by that code, on that day.
            doc["history"] = [*resume.get("history", []), {k: resume.get(k) for k in ("created_utc", "command", "git")}]
        return doc

    previous = None
    if resume is not None:
        check_resumable(resume, document([]), [spec.to_dict() for spec in runner.specs])
        try:
            previous = {int(e["index"]): outcome_from_dict(e) for e in resume["examples"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--resume: the result's examples do not read back ({type(exc).__name__}: {exc}); "
                              "it is left as it is") from None
        dropped = sorted({name for o in previous.values() for name in o.methods} - {s.name for s in runner.specs})
        if dropped:
            logger.warning("--resume: the result holds methods this run does not ask for, left out of the new "
                           "document (the backup keeps them): %s", ", ".join(dropped))

    def finished(outcomes: list[ExampleOutcome]) -> bool:
        assert runner.selection is not None
        return len(outcomes) == runner.selection["kept"] and all(
            len(o.methods) == len(runner.specs) for o in outcomes)

    def partial(outcomes: list[ExampleOutcome]) -> None:
        if on_partial is None:
            return
        # A resumed run's questions not reached yet are written as they were: a run stopped midway must
        # not leave a file that has lost them (resuming it would measure them all again).
        reached = {o.index for o in outcomes}
        names = {spec.name for spec in runner.specs}
        waiting = [replace(o, methods={name: m for name, m in o.methods.items() if name in names})
                   for index, o in (previous or {}).items() if index not in reached]
        written = sorted([*outcomes, *waiting], key=lambda o: o.index)
        on_partial({**document(written), "partial": not finished(outcomes)})

    outcomes = runner.run(examples, on_example=partial, previous=previous)
    left_out = sorted(set(previous or {}) - {o.index for o in outcomes})
    if left_out:
        logger.warning("--resume: the result holds questions this run does not select (--n, --answerable), left "
                       "out of the new document (the backup keeps them): %s", left_out)
    return {**document(outcomes), "partial": not finished(outcomes)}
