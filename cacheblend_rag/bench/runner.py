"""The benchmark's per-question execution: :class:`BenchmarkRunner` runs every method on every question.

Per question:

1. build the prompt (:mod:`cacheblend_rag.bench.prompt`);
2. precompute its passages once per prefix variant into a fresh chunk store (timed: the
   precompute cost), and the prefix-caching prefix once;
3. run full prefill first: its greedy answer is the reference for fidelity;
4. for every method, one full request (TTFT, decoding, answer, teacher-forced logits),
   ``repeats - 1`` more TTFT-only requests, and on the first ``cold_examples`` questions
   a cold request against an empty store, and on the first ``throughput_requests``
   questions one request decoding exactly ``throughput_new_tokens`` tokens.

The run as a whole (loading, resuming, the result document) is :func:`cacheblend_rag.bench.harness.run_benchmark`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from cacheblend_rag.bench.config import BenchConfig
from cacheblend_rag.bench.methods import MethodSpec, resolve_default
from cacheblend_rag.bench.metrics import (
    answer_in_text,
    answers_match,
    gold_exact_match,
    gold_f1,
    token_kl,
    top1_agreement,
)
from cacheblend_rag.bench.outcomes import ExampleOutcome, MethodOutcome, Variant, chunk_variant, variant_name
from cacheblend_rag.bench.prompt import BenchPrompt, MusiqueExample, build_prompt
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
from cacheblend_rag.bench.stores import ChunkStoreFactory
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError

logger = logging.getLogger(__name__)


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
        self.variants = sorted({chunk_variant(s) for s in self.specs if s.uses_chunk_cache}, key=variant_name)
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

        caches, precompute, from_store = self._precompute(prompt, {chunk_variant(s) for s in chunk_todo})
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
        for variant in sorted(variants, key=variant_name):
            cache = self.stores.open(prompt.conditioning_prefix(variant[0]), variant[1])
            start = time.perf_counter()
            summary = cache.warm(prompt.chunk_ids)
            seconds = time.perf_counter() - start
            self.work["chunks_computed"] += summary.new
            self.work["chunks_from_store"] += summary.present
            if summary.present == 0:
                precompute[variant_name(variant)] = seconds
            else:
                # A lookup, not a precompute: timing it would report a precompute cost of nearly nothing.
                from_store[variant_name(variant)] = summary.present
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
        return BlendRequest(self.engine, segments, spec.blend_config(self.base_blend), caches[chunk_variant(spec)])

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
