"""Calibration: the cheapest blend setting that keeps a model's answers close enough to full prefill.

On a handful of prompts it measures full prefill (the reference: its greedy answer is the
teacher), plain full reuse (the yardstick of recovery) and every candidate setting, the way the
harness does (:mod:`cacheblend_rag.bench.runner`: same prompts, same stores, same requests):

* fidelity: the mean per-token KL(full prefill || setting) along full prefill's first
  ``teacher_tokens`` answer tokens, teacher-forced;
* recovery: ``1 - mean KL(setting) / mean KL(full reuse)`` over the prompts (the harness's
  summary); a prompt is *worse than full reuse* when its KL exceeds full reuse's on it;
* answers: top-1 agreement, the share of those answer tokens the setting ranks first as full
  prefill does (teacher-forced, :func:`~cacheblend_rag.bench.metrics.top1_agreement`); and whether
  its greedy answer is full prefill's, token for token over those tokens. Both are read off the same
  teacher-forced pass: greedy decoding from the setting's cache takes full prefill's token at every
  step exactly while the setting ranks that token first, so the answer is identical if and only if
  every position agrees (one forward over the answer instead of one per token; no extra decoding);
* cost: ``work`` (default, deterministic): the layer-units the setting computes, from the model's
  shapes (:func:`cacheblend_rag.calibration.bound.work_bound` with the tokens the engine really
  recomputed, and the profile pass's tokens and layers), over full prefill's; or ``ttft``: the
  measured TTFT over full prefill's. On a GPU, calibrate with ``ttft`` on the GPU itself: there a
  blend's time is mostly the host's fixed costs, and a higher ratio costs far less than ``work`` says.

The chosen setting is the cheapest that meets the target (:class:`CalibrationTarget`: recovery at
least ``target.recovery``, at most ``target.allow_worse`` prompts worse than full reuse, and the answer
targets given). When none does, that is said (``target_met`` false, ``message``, with the best each
measure reached) and the best measured one is chosen, or full reuse when it is closer to full prefill
than every affordable candidate (:func:`~cacheblend_rag.calibration.choice.choose`). The result
is saved per model fingerprint and device type (:mod:`cacheblend_rag.calibration.lookup`), where the
engine and the integrations find it.

Every measurement is written to a JSON state file as it is made (atomically: a stop leaves a
valid file), keyed by the model's fingerprint, a hash of the prompt's token ids and the setting,
so a rerun with ``resume=True`` skips what is there (:mod:`~cacheblend_rag.calibration.state`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
from tqdm.auto import tqdm

from cacheblend_rag.calibration.bound import LayerShapes, work_bound
from cacheblend_rag.calibration.choice import CalibrationTarget, CandidateOutcome, choose
from cacheblend_rag.calibration.state import (
    STATE_FORMAT,
    CalibrationState,
    default_state_path,
    prompt_key,
)
from cacheblend_rag.bench.methods import parse_methods
from cacheblend_rag.bench.metrics import mean_or_none, recovery, token_kl, top1_agreement
from cacheblend_rag.bench.prompt import BenchPrompt
from cacheblend_rag.bench.requests import BlendRequest, FullPrefillRequest, RequestRun, run_request
from cacheblend_rag.bench.stores import ChunkStoreFactory
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.calibration.lookup import CALIBRATED_FIELDS, FORMAT, VERSION, describe_config, save_calibration
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.dtype_choice import dtype_name
from cacheblend_rag.models.fingerprint import weights_identities, weights_shape

logger = logging.getLogger(__name__)

CostKind = Literal["work", "ttft"]
# The target, outcome and state classes live in choice and state; importable from here too.
__all__ = ["CalibrationResult", "CalibrationState", "CalibrationTarget", "Calibrator", "Candidate", "CandidateOutcome",
           "DEFAULT_CANDIDATES", "STATE_FORMAT", "calibrate", "default_state_path", "parse_candidates", "prompt_key",
           "summarize", "work_share"]

# The grid measured when the user names none; the lead edits it as research moves on. Each item is a
# ``--methods`` item (NAME[+prefix][+keyshift|+probeshift]@RATIO). ``query_profiled+prefix`` is the integrations'
# built-in default (chunks computed behind the prompt's lead); ``kv_deviation`` is CacheBlend as
# published, chunks computed alone. ``+keyshift0.5`` (half the stale key correction) is left out: it
# helped Qwen2.5-Coder-1.5B at 100-token passages and hurt it at 300 (research/quality_notebook.md, "The key
# correction at 300-token passages"), so calibration prompts shorter than the deployed ones could pick it wrongly.
# Name it in --candidates to measure it. Probe tokens (each chunk's K/V shift estimated from evenly spaced
# recomputed tokens) are in, one every 10 tokens (``+probeshift10``): on that model they recover 58-63% at
# 0.15-0.2 wherever they fall, while one every 20 tokens swings by 20 points with the placement
# (research/quality_notebook.md, "Where the probes fall"), and a candidate that wins a calibration by a lucky placement
# would not carry over to the user's other prompts. At 300-token passages they tie the default over 29
# questions and lose to it on the 16 they were not developed on: a candidate to measure, not a default.
# On the default's own selection they gain 11-13 points at 300-token passages over all 29 questions, with chunks
# conditioned (``query_profiled+prefix+probeshift10``: 60% at 0.2, 73% at 0.3) and more with chunks computed
# alone (``query_profiled+probeshift10``: 70.5% at 0.2, 77% at 0.3, the setting shipped for Qwen2.5-Coder-1.5B;
# research/quality_notebook.md, "The default's selection with probes"); both are in the grid, so that the user's
# prompts decide.
DEFAULT_CANDIDATES: list[str] = [
    *(f"query_profiled+prefix@{r:g}" for r in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)),
    *(f"kv_deviation@{r:g}" for r in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8)),
    *(f"kv_deviation+probeshift10@{r:g}" for r in (0.1, 0.15, 0.2, 0.3)),
    *(f"query_profiled+prefix+probeshift10@{r:g}" for r in (0.15, 0.2, 0.3)),
    *(f"query_profiled+probeshift10@{r:g}" for r in (0.15, 0.2, 0.3)),
]
# Ratios of a --candidates item that pins none (e.g. "kv_deviation").
CANDIDATE_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


# --------------------------------------------------------------------------- what is measured
@dataclass(frozen=True)
class Candidate:
    """One setting: a BlendConfig and whether chunk KV is computed behind the prompt's lead."""

    config: BlendConfig
    condition_chunks: bool = False

    @property
    def name(self) -> str:
        return describe_config(self.config, self.condition_chunks)

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self.config, name) for name in CALIBRATED_FIELDS}

    @property
    def key(self) -> str:
        """Stable across processes: the name (for a reader) and a digest of every calibrated field."""
        blob = json.dumps({"fields": self.fields(), "condition_chunks": self.condition_chunks}, sort_keys=True)
        return f"{self.name}#{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def parse_candidates(items: str | Sequence[str] | None = None, base: BlendConfig | None = None) -> list[Candidate]:
    """``"kv_deviation@0.15,query_profiled+prefix@0.15"`` (``--methods`` items, :mod:`~cacheblend_rag.bench.methods`)
    as candidates on ``base``; ``None``: :data:`DEFAULT_CANDIDATES`. A name without ``@RATIO`` takes
    :data:`CANDIDATE_RATIOS`."""
    text = ",".join(DEFAULT_CANDIDATES if items is None else ([items] if isinstance(items, str) else list(items)))
    base = base or BlendConfig()
    candidates: list[Candidate] = []
    for spec in parse_methods(text, CANDIDATE_RATIOS):
        if not spec.uses_chunk_cache:
            raise ConfigError(f"--candidates: {spec.name} reuses no chunk KV, so it is no blend setting; it is "
                              "measured anyway as the reference (drop it)")
        if spec.storage:
            raise ConfigError(f"--candidates: {spec.name}: a calibration measures blend settings, not storage "
                              "codecs; drop ':{spec.storage}' (bench --methods compares codecs)")
        candidate = Candidate(spec.blend_config(base), spec.prefix_conditioned)
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


# --------------------------------------------------------------------------- results
@dataclass
class CalibrationResult:
    model: str
    fingerprint: str
    target: CalibrationTarget
    cost_kind: CostKind
    prompts: int
    candidates: list[CandidateOutcome]  # ordered by cost
    full_reuse: CandidateOutcome
    chosen: CandidateOutcome
    target_met: bool
    message: str
    measurement: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    # the compute dtype measured in, and the weights' identities across dtypes (architecture, width, depth and
    # "identities"): an engine of the same weights in another dtype finds the result by them (engine.calibrated)
    dtype: str | None = None
    weights: dict[str, Any] = field(default_factory=dict)
    # the device type measured on ("cpu", "cuda"): the engine prefers its own device type's setting
    device: str | None = None
    created_utc: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    def to_document(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "model": self.model,
            **({"dtype": self.dtype} if self.dtype else {}), **({"device": self.device} if self.device else {}),
            **({"weights": self.weights} if self.weights else {}),
            "created_utc": self.created_utc, "target": asdict(self.target), "cost": self.cost_kind,
            "target_met": self.target_met, "message": self.message,
            "chosen": {"name": self.chosen.name, "config": self.chosen.config,
                       "condition_chunks": self.chosen.condition_chunks, "kl": self.chosen.kl,
                       "recovery": self.chosen.recovery, "worse_than_full_reuse": self.chosen.worse_than_full_reuse,
                       "top1": self.chosen.top1, "identical_answers": self.chosen.identical_answers,
                       "cost": self.chosen.cost},
            "prompts": self.prompts, "measurement": self.measurement, "data": self.data,
            "full_reuse": asdict(self.full_reuse),
            "table": [asdict(c) for c in self.candidates],
        }

    def save(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write the result where the engine looks for this model's (:func:`~cacheblend_rag.calibration.lookup.calibration_dir`)."""
        return save_calibration(self.to_document(), directory)

    def table(self) -> str:
        lines = [f"| setting | KL | recovery | worse than full reuse (of {self.prompts}) | top-1 | identical answers "
                 f"| cost ({self.cost_kind}, full prefill = 1) | meets target |", "|---|---|---|---|---|---|---|---|",
                 self.full_reuse.table_row()]
        return "\n".join(lines + [c.table_row() for c in self.candidates])

    def target_line(self) -> str:
        """What was asked and where it was measured: ``target: recovery >= 0.8 with at most 0 of 8 prompts worse
        than full reuse, top-1 agreement >= 0.9; cost ttft; measured on cuda in bfloat16``."""
        ceiling = "" if self.target.max_cost is None else f" at a cost of at most {self.target.max_cost:g}"
        return (f"target: {self.target.describe(self.prompts)}{ceiling}; cost {self.cost_kind}; measured on "
                f"{self.device or 'an unrecorded device'} in {self.dtype or 'an unrecorded dtype'}")


# --------------------------------------------------------------------------- cost
def work_share(engine: CacheBlendEngine, config: BlendConfig, stats: dict[str, Any]) -> float:
    """The layer-units the blend that produced ``stats`` computed, over full prefill's (1.0), by the
    work bound's count with the tokens the engine really recomputed and its profile pass."""
    if stats.get("mode") == "full_prefill":
        return 1.0  # a fallback (gate, short prompt) computes everything
    shapes = LayerShapes.of(engine.model.config)
    n, fresh = int(stats["total_tokens"]), int(stats["fresh_tokens"])
    cached = n - fresh
    ratio = stats["recomputed_tokens"] / cached if cached else 0.0
    if config.recompute_ratio == 0:
        units = work_bound(shapes, n, fresh, 0.0, check_layer=0)
        return (units["units"] - units["parts"]["profile"]) / shapes.num_layers
    strategy, check_layer = engine.plan(config)
    profile = strategy.needs.profile
    if check_layer == 0 and profile is not None:
        units = work_bound(shapes, n, fresh, ratio, check_layer=0, profile_tokens=profile.question_tokens)
        # The bound runs the profile through every layer; profile_layers cuts it short.
        profiled = (profile.layers or shapes.num_layers) / shapes.num_layers
        return (units["units"] - units["parts"]["profile"] * (1 - profiled)) / shapes.num_layers
    if 1 <= check_layer < shapes.num_layers - 1:
        return work_bound(shapes, n, fresh, ratio, check_layer=check_layer)["units"] / shapes.num_layers
    # A choice the bound does not model (at layer 0 with no profile, or at the last layers): the
    # share of tokens computed, in every layer.
    return min(1.0, (stats["recomputed_tokens"] + fresh) / n)


# --------------------------------------------------------------------------- the run
@dataclass
class _Method:
    key: str  # the state's key: Candidate.key, or "full_reuse"
    config: BlendConfig
    condition_chunks: bool


class Calibrator:
    """Runs one calibration on one engine (:func:`calibrate` is the short way)."""

    def __init__(self, engine: CacheBlendEngine, candidates: Sequence[Candidate], *, cost: CostKind = "work",
                 teacher_tokens: int = 16, state: CalibrationState, progress: bool = True) -> None:
        if engine.tokenizer is None:
            raise ConfigError("calibration needs an engine with a tokenizer")
        if cost not in ("work", "ttft"):
            raise ConfigError(f"cost={cost!r}; choose 'work' (layer-units computed) or 'ttft' (measured)")
        if isinstance(teacher_tokens, bool) or not isinstance(teacher_tokens, int) or teacher_tokens < 1:
            raise ConfigError(f"teacher_tokens={teacher_tokens!r} must be an integer >= 1")
        if not candidates:
            raise ConfigError("no candidate settings to calibrate; pass at least one (e.g. kv_deviation@0.15)")
        self.engine, self.cost, self.teacher_tokens = engine, cost, teacher_tokens
        self.state, self.progress = state, progress
        self.candidates = list(candidates)
        for c in self.candidates:
            engine.plan(c.config)  # a bad check layer fails now, not midway
        # Measured as blends whatever the prompt's length: the short-prompt fallback is the user's
        # policy, the same for every setting, and would hide what a setting does.
        full_reuse = _Method("full_reuse", BlendConfig(recompute_ratio=0.0, min_blend_tokens=0), False)
        self.methods = [full_reuse, *(_Method(c.key, c.config.with_overrides(min_blend_tokens=0), c.condition_chunks)
                                      for c in self.candidates)]
        self.eos_ids = eos_token_ids(engine)
        self.stores = ChunkStoreFactory("memory", engine)

    def run(self, prompts: Sequence[BenchPrompt]) -> list[str]:
        """Measure what the state lacks; returns the prompts' keys."""
        if not prompts:
            raise ConfigError("no prompts to calibrate on; pass a few questions with their passages")
        keys = [prompt_key(p, self.teacher_tokens) for p in prompts]
        bar = tqdm(total=len(prompts) * (len(self.methods) + 1), desc="calibrate", unit="run",
                   disable=not self.progress)
        try:
            if self.cost == "ttft":
                self._warm_up(prompts[0])
            for key, prompt in zip(keys, prompts):
                self._run_prompt(key, prompt, bar)
        finally:
            bar.close()
            self.stores.close()
        return keys

    def _warm_up(self, prompt: BenchPrompt) -> None:
        """As the harness does before timing: the one-time correctness gate and kernel warm-up must
        not land in the first measured TTFT."""
        short = BenchPrompt(prompt.lead_ids, prompt.chunk_ids[:2], prompt.tail_ids, text="")
        run_request(self.engine, FullPrefillRequest(self.engine, short.input_ids), max_new_tokens=2,
                    eos_ids=self.eos_ids, teacher_limit=2)
        segments = [short.lead_ids, *self.engine.prefill_chunks(short.chunk_ids), short.tail_ids]
        for method in self.methods:
            run_request(self.engine, BlendRequest(self.engine, segments, method.config, None), max_new_tokens=2,
                        eos_ids=self.eos_ids, teacher_limit=2)

    def _run_prompt(self, key: str, prompt: BenchPrompt, bar: Any) -> None:
        todo = [m for m in self.methods if self.state.measured(key, m.key) is None]
        if not todo and self.state.reference(key) is not None:
            bar.update(len(self.methods) + 1)
            return
        bar.set_postfix_str("full_prefill", refresh=False)
        reference = run_request(self.engine, FullPrefillRequest(self.engine, prompt.input_ids),
                                max_new_tokens=self.teacher_tokens, eos_ids=self.eos_ids,
                                teacher_limit=self.teacher_tokens)
        self.state.set_reference(key, {"tokens": reference.answer_tokens(self.teacher_tokens),
                                       "ttft_s": reference.ttft_s})
        bar.update(1)
        todo = [m for m in self.methods if self.state.measured(key, m.key) is None]
        bar.update(len(self.methods) - len(todo))
        caches: dict[bool, Any] = {}
        try:
            for method in todo:
                bar.set_postfix_str(method.key.partition("#")[0], refresh=False)
                if method.condition_chunks not in caches:
                    caches[method.condition_chunks] = self._warm(prompt, method.condition_chunks)
                run = self._measure(prompt, method, caches[method.condition_chunks], reference)
                self.state.record(key, method.key, run)
                bar.update(1)
        finally:
            for cache in caches.values():
                self.stores.release(cache)

    def _warm(self, prompt: BenchPrompt, conditioned: bool) -> Any:
        """A fresh store with the prompt's passages, and its lead as an exact prefix, as the harness has it."""
        cache = self.stores.open(prompt.conditioning_prefix(conditioned))
        cache.warm(prompt.chunk_ids)
        cache.warm([prompt.lead_ids], prefix_ids=(), lossless=True)
        return cache

    def _measure(self, prompt: BenchPrompt, method: _Method, cache: Any, reference: RequestRun) -> dict[str, Any]:
        segments = prompt.stored_segments(prompt.conditioning_prefix(method.condition_chunks))
        teacher = reference.answer_tokens(self.teacher_tokens)
        run = run_request(self.engine, BlendRequest(self.engine, segments, method.config, cache), max_new_tokens=1,
                          eos_ids=self.eos_ids, teacher_tokens=teacher, teacher_limit=self.teacher_tokens)
        assert run.teacher_logits is not None and reference.teacher_logits is not None
        stats = {k: run.stats.get(k) for k in ("mode", "total_tokens", "cached_tokens", "recomputed_tokens",
                                               "fresh_tokens", "exact_tokens", "fallback_reason")}
        # The greedy answer is full prefill's exactly while the setting ranks full prefill's token first at each
        # step (module docstring): identity read off the teacher-forced pass, without decoding.
        picked = run.teacher_logits.argmax(dim=-1).tolist()
        return {"kl": float(token_kl(reference.teacher_logits, run.teacher_logits).mean()),
                "top1": top1_agreement(reference.teacher_logits, run.teacher_logits),
                "identical": picked == list(teacher),
                "work": work_share(self.engine, method.config, run.stats), "ttft_s": run.ttft_s, "stats": stats}


def calibrate(
    engine: CacheBlendEngine,
    prompts: Sequence[BenchPrompt],
    candidates: Sequence[Candidate] | str | None = None,
    target: CalibrationTarget | None = None,
    *,
    cost: CostKind = "work",
    teacher_tokens: int = 16,
    progress: bool = True,
    state_path: str | os.PathLike[str] | None = None,
    resume: bool = True,
    data: dict[str, Any] | None = None,
) -> CalibrationResult:
    """Measure ``candidates`` (default :data:`DEFAULT_CANDIDATES`) on ``prompts`` and choose the
    cheapest that meets ``target`` (module docstring). ``state_path``: the JSON file measurements
    go to as they are made; with ``resume``, those already there are not made again. The result is
    not saved: :meth:`CalibrationResult.save` does that."""
    target = target or CalibrationTarget()
    chosen = parse_candidates(candidates) if candidates is None or isinstance(candidates, str) else list(candidates)
    state = CalibrationState(state_path, engine.fingerprint, resume=resume)
    calibrator = Calibrator(engine, chosen, cost=cost, teacher_tokens=teacher_tokens, state=state, progress=progress)
    keys = calibrator.run(prompts)
    return summarize(engine, keys, chosen, state, target, cost,
                     measurement={"teacher_tokens": teacher_tokens, "state_path": str(state_path) if state_path else None},
                     data=data or {})


def summarize(engine: CacheBlendEngine, keys: list[str], candidates: Sequence[Candidate], state: CalibrationState,
              target: CalibrationTarget, cost: CostKind, *, measurement: dict[str, Any],
              data: dict[str, Any]) -> CalibrationResult:
    """The table over ``keys`` (every measurement is in ``state``) and the choice."""

    def outcome(key: str, name: str, config: dict[str, Any], conditioned: bool, reference_kls: list[float] | None
                ) -> CandidateOutcome:
        runs = [state.measured(k, key) for k in keys]
        kls = [float(r["kl"]) for r in runs]
        if cost == "work":
            costs = [float(r["work"]) for r in runs]
        else:
            costs = [float(r["ttft_s"]) / float(state.reference(k)["ttft_s"]) for r, k in zip(runs, keys)]
        mean_kl = float(np.mean(kls))
        rec, worse = None, 0
        if reference_kls is not None:
            rec = recovery(mean_kl, mean_or_none(reference_kls))
            worse = int(sum(kl > ref for kl, ref in zip(kls, reference_kls)))
        top1 = float(np.mean([float(r["top1"]) for r in runs]))
        identical = sum(bool(r["identical"]) for r in runs) / len(runs)  # a count over n: exact, not a float mean
        return CandidateOutcome(name, config, conditioned, mean_kl, rec, worse, float(np.mean(costs)), False, kls,
                                top1=top1, identical_answers=identical)

    full_reuse = outcome("full_reuse", "full_reuse", {"recompute_ratio": 0.0}, False, None)
    full_reuse.reference = True
    rows = [outcome(c.key, c.name, c.fields(), c.condition_chunks, full_reuse.per_prompt_kl) for c in candidates]
    rows, chosen, met, message = choose(full_reuse, rows, target, len(keys))
    return CalibrationResult(model=engine.model_name, fingerprint=engine.fingerprint, target=target, cost_kind=cost,
                             prompts=len(keys), candidates=rows, full_reuse=full_reuse, chosen=chosen, target_met=met,
                             message=message, measurement=measurement, data=data, dtype=dtype_name(engine.dtype),
                             device=engine.device.type, weights={**weights_shape(engine.model),
                                      "identities": weights_identities(engine.model, engine.tokenizer)})

