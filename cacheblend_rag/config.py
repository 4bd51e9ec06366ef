"""Validated configuration objects for blending and generation.

Every check raises :class:`ConfigError` naming the field, the value it got and
what it accepts, so a typo in a pipeline's settings fails where it is written.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
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
    segment_recompute_ratio:
        Share of the *cached segments'* tokens recomputed (spans after the chunks that the
        segment cache holds from an earlier request, ``ChunkKV.approximate``): their budget is
        ``round(segment_recompute_ratio * segment tokens)``, chosen among them, beside
        ``round(recompute_ratio * chunk tokens)`` chosen among the chunks. Such a span's K/V was
        computed behind other passages, so it deviates more than a chunk's. ``None`` pools them
        with the chunks under ``recompute_ratio``. At ``recompute_ratio`` 1.0 or 0 it is not used
        (every token recomputed, exact; full reuse). Default 0.35, measured with
        ``benchmarks/bench_chat.py`` (research/quality_notebook.md, "Conversations").
    approximate_prefix_recompute_ratio:
        Share of an *approximate prefix's* tokens recomputed (the prefix cache's approximate blocks:
        an earlier blend's K/V, a chat's earlier turns, ``PrefixSegment.approximate_tokens``): their
        budget is ``round(approximate_prefix_recompute_ratio * approximate tokens)``, chosen among them
        by the selection strategy for this prompt's question, beside the chunks' share. An earlier
        turn's chunks were recomputed for *that* turn's question; the default ``query_profiled`` picks
        the earlier tokens the current question reads, as blending the whole history would. The
        prefix's exact part (a system prompt) stays outside the budget. ``0`` reuses them as is,
        outside the budget (cheapest; the turn reads stale K/V); ``None`` pools them with the chunks
        under ``recompute_ratio``. At ``recompute_ratio`` 0 they are reused as is; at 1.0 recomputed
        (a server never serves approximate blocks there). Default 0 (as is), measured with
        ``benchmarks/bench_chat.py`` (research/quality_notebook.md, "Conversations: an approximate prefix's
        share"):
        on one SmolLM2 conversation 0.1 and 0.15 lowered turn-4 KL against full prefill by 1-1.5% only
        (0.092 to 0.091), raised turns 2-3's, and recomputed 3-4x the tokens; neither met "no worse than
        blending alone" (0.034).
    approximate_prefix_chunk_factor:
        Behind an approximate prefix reused as is (a chat's earlier turns from the prefix cache, with
        ``approximate_prefix_recompute_ratio`` 0), the chunks' share is ``recompute_ratio`` times this
        (at most 1.0). Blending such a prompt anew would give the history's passages their share of the
        budget too, and spend much of it where the current question reads, in its own passages; reused as
        is, the history takes none, so the new passages get it. Default 3.0 (0.45 at the default 0.15),
        measured with ``benchmarks/bench_chat.py`` (research/quality_notebook.md, "Conversations: the new
        passages' share"): on two SmolLM2 conversations turn-4 KL against full prefill was 0.082/0.153 at 1.0,
        0.042/0.050 at 2.5 and 0.031/0.045 at 3.0, against blending alone's 0.034/0.049 (600 tokens
        recomputed there to 3.0's 450); on a quiet machine 3.0 reached turn 4's first token 1.95x
        faster than blending alone and 3.73x faster than full prefill (3.66x and 6.70x before, at 1.0
        with the instruction served from the segment cache). ``1.0``: the chunks' ratio as is.
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
        choice worse (measured in research/quality_notebook.md).
    profile_tokens:
        How many of the question's last tokens (the last fresh segment) ``query_profiled``'s pass
        runs; the earlier ones are left out of the pass (the blend still computes them all).
        ``None``: the whole segment. On RAG prompts that segment opens with a fixed instruction
        that tells the pass little; what 16 saves and costs is measured in
        research/quality_notebook.md ("Cutting the profile's cost").
    stale_key_correction:
        After the chosen tokens are recomputed in a layer, every key of their chunk moves by this
        share of the mean change (taken before RoPE) that the chunk's recomputed keys saw; the
        recomputed tokens keep their own fresh keys. A chunk's stale keys share much of their error
        against full prefill (44-66% of it in layers 3-27 of Qwen2.5-Coder-1.5B, 21-44% on SmolLM2),
        and its recomputed tokens show part of it (their selection overstates it: 0.5 did better
        than 1 at 1.5B). ``0`` (default): stale keys as stored; ``1``: the whole mean change.
        Measured in research/quality_notebook.md ("Stale key correction"); values are left as stored unless
        ``stale_value_correction`` moves them.
    stale_value_correction:
        The same for values: every stale value of a chunk moves by this share of the mean change its
        recomputed (or probe) tokens' values saw. Only worth it with ``shift_probe_stride``: a
        deviation selector picks the tokens whose values changed most, so their mean says nothing of
        the rest's. ``0`` (default): values as stored.
    shift_probe_stride:
        Estimate the two corrections from *probe* tokens instead of the chosen ones: every this-many-th
        token of each chunk (from the middle of the first stride on) is recomputed, inside the
        recompute budget, and the selection strategy picks the rest of the budget among the others.
        Probes are fixed before any evidence is seen, so their mean change is an unbiased estimate of
        the chunk's shared shift. ``0`` (default): no probes, the chosen tokens estimate it. On
        Qwen2.5-Coder-1.5B with both corrections at 1, 10 recovers 63% of full reuse's KL at 0.2 on 13
        questions wherever the probes fall (20: 52-72% by placement), against plain CacheBlend's 29%;
        at 300-token passages it ties the default over 29 questions and loses on the 16 it was not
        developed on (research/quality_notebook.md, "Probe tokens" and after); at 0.3 it recovers 75-78% on those 13
        questions but 50% on held-out 300-token ones. On ``query_profiled`` with chunks computed alone it
        recovers 70.5% at 0.2 over all 29 300-token questions (the built-in default 45%), the setting
        shipped for that model (docs/quality.md, "Calibrating a model"). A budget smaller than the
        probes (a ratio below about ``1 / stride``) drops them and both corrections: too few probes
        estimate the shifts worse than none. Measure it on your prompts (``cacheblend-rag calibrate``).
    shift_window:
        Estimate the two corrections per window of this many tokens of each chunk rather than per
        chunk, for long chunks whose error drifts along them (windows of 100 did better than whole
        300-token chunks on five questions). ``0`` (default): one shift per chunk.
    gate:
        Run the one-time correctness gate (ratio 1.0 against full prefill) per model.
    fallback_to_full_prefill:
        When the architecture is unsupported or the gate fails, answer with full
        prefill instead of raising.
    min_blend_tokens:
        A prompt with fewer cached tokens than this is answered by full prefill (exact, and no
        slower there): on short prompts a blend's fixed costs (the profile pass, the store reads)
        outweigh what reuse saves. The stats say so (``mode="full_prefill"``,
        ``fallback_reason``). ``0`` always blends; ``None`` (default) takes the engine's
        ``min_blend_tokens``, measured by ``benchmarks/bench_short_prompts.py``
        (research/quality_notebook.md, "Short prompts").
    """

    recompute_ratio: float = 0.15
    segment_recompute_ratio: float | None = 0.35
    approximate_prefix_recompute_ratio: float | None = 0.0
    approximate_prefix_chunk_factor: float = 3.0
    check_layer: int | None = None
    deviation: DeviationKind = "value"
    mask: MaskKind = "exact"
    selection: str = "query_profiled"
    sink_tokens: int = 4
    query_weight: float = 0.5
    gradual_expand: float = 2.0
    profile_layers: int | None = None
    profile_tokens: int | None = 16
    stale_key_correction: float = 0.0
    stale_value_correction: float = 0.0
    shift_probe_stride: int = 0
    shift_window: int = 0
    gate: bool = True
    gate_tolerance: float | None = None
    fallback_to_full_prefill: bool = False
    min_blend_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_range("recompute_ratio", self.recompute_ratio, 0.0, 1.0)
        if self.segment_recompute_ratio is not None:
            _check_range("segment_recompute_ratio", self.segment_recompute_ratio, 0.0, 1.0)
        if self.approximate_prefix_recompute_ratio is not None:
            _check_range("approximate_prefix_recompute_ratio", self.approximate_prefix_recompute_ratio, 0.0, 1.0)
        _check_range("approximate_prefix_chunk_factor", self.approximate_prefix_chunk_factor, 1.0, 100.0)
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
        _check_range("stale_key_correction", self.stale_key_correction, 0.0, 2.0)
        _check_range("stale_value_correction", self.stale_value_correction, 0.0, 2.0)
        _check_range("shift_probe_stride", self.shift_probe_stride, 0, 1_000_000, integer=True)
        _check_range("shift_window", self.shift_window, 0, 1_000_000, integer=True)
        if self.shift_probe_stride == 1:
            raise ConfigError("shift_probe_stride=1 makes every chunk token a probe (nothing left to correct); "
                              "use 0 (no probes) or a stride of 2 or more, e.g. 20")
        if self.shift_probe_stride and not (self.stale_key_correction or self.stale_value_correction):
            raise ConfigError(f"shift_probe_stride={self.shift_probe_stride} only says which tokens estimate the stale "
                              "shifts; set stale_key_correction and/or stale_value_correction too (e.g. both 1), "
                              "or leave shift_probe_stride at 0")
        if self.gate_tolerance is not None:
            _check_range("gate_tolerance", self.gate_tolerance, 0.0, 1e6)
        if self.min_blend_tokens is not None:
            _check_range("min_blend_tokens", self.min_blend_tokens, 0, 10_000_000, integer=True)
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
    """How the answer is decoded. A field left ``None`` takes the model's own generation config
    (``model.generation_config``, as ``model.generate`` would): greedy unless that config samples,
    with its temperature, top-p, top-k, min-p and repetition penalty. ``temperature=0`` is greedy.

    json_schema:
        Constrain the answer to JSON (structured output, tool calls): a JSON schema as text, or
        ``"{}"`` for any JSON value. Decoding then allows only tokens that keep the answer a valid
        prefix of such JSON, and ends when it is complete. It is also closed in time: once
        ``max_new_tokens`` would run out first, only tokens that can still finish the JSON within
        the tokens left are allowed (a cut answer is still valid JSON, its ``finish_reason``
        "length").
    min_new_tokens:
        End-of-sequence tokens are not sampled before the answer holds this many tokens (as
        transformers' ``min_new_tokens``); stop strings still end it. ``min_new_tokens =
        max_new_tokens`` fixes the answer's length, as serving benchmarks do.
    json_only:
        ``False``: the answer may be text instead (a tool call the model may or may not make). Its
        first token decides: one that starts the JSON holds it to ``json_schema`` to the end, any
        other leaves it free (a first token that starts some other JSON, or only whitespace, is
        not allowed, so a call cannot slip past the constraint).
    do_sample:
        As ``model.generate``'s: ``False`` is greedy whatever the temperature, ``True`` samples (with
        the fields set here, else the model's generation config, else temperature 1.0) even where the
        model's config does not; ``None`` (default): the model's config decides.
    no_repeat_ngram_size:
        No n-gram of this size occurs twice in the prompt and answer (transformers'
        ``NoRepeatNGramLogitsProcessor``); ``0`` (default) off.
    eos_token_id:
        The ids that end the answer, instead of the model's (its generation config's and tokenizer's),
        as ``model.generate``'s ``eos_token_id`` replaces them; ``None`` (default): the model's.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    json_schema: str | None = None
    json_only: bool = True
    do_sample: bool | None = None
    no_repeat_ngram_size: int = 0
    eos_token_id: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_range("max_new_tokens", self.max_new_tokens, 1, 1_000_000, integer=True)
        _check_range("min_new_tokens", self.min_new_tokens, 0, 1_000_000, integer=True)
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"min_new_tokens={self.min_new_tokens} is above max_new_tokens={self.max_new_tokens}; "
                              "lower it or raise max_new_tokens")
        if self.temperature is not None:
            _check_range("temperature", self.temperature, 0.0, 100.0)
        if self.top_p is not None and (isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p={self.top_p!r} is out of range; allowed range is (0, 1]")
        if self.top_k is not None:
            _check_range("top_k", self.top_k, 0, 10_000_000, integer=True)
        if self.min_p is not None:
            _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.repetition_penalty is not None:
            _check_range("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop={self.stop!r} must hold non-empty strings")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"json_schema is not JSON text ({exc}); pass json.dumps(schema), or '{{}}' for "
                                  "any JSON") from None
            if not isinstance(schema, dict):
                raise ConfigError("json_schema must be a JSON object (a schema), e.g. '{\"type\": \"object\"}'")
        if not isinstance(self.json_only, bool):
            raise ConfigError(f"json_only={self.json_only!r} must be True or False")
        self._check_decoding_choices()

    def _check_decoding_choices(self) -> None:
        """do_sample, no_repeat_ngram_size and eos_token_id, as model.generate takes them."""
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ConfigError(f"do_sample={self.do_sample!r} must be True, False or None (the model's choice)")
        if self.do_sample and self.temperature == 0:
            raise ConfigError("do_sample=True with temperature=0 asks to sample and to be greedy; pass a temperature "
                              "above 0 to sample, or do_sample=False for greedy")
        _check_range("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, 1_000_000, integer=True)
        if self.eos_token_id is not None:
            ids = (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ConfigError(f"eos_token_id={self.eos_token_id!r} must be a token id or a non-empty list of "
                                  "them (ids >= 0), or None for the model's own")
            object.__setattr__(self, "eos_token_id", ids)

    def resolved(self, model_defaults: Any = None) -> "GenerationConfig":
        """Every sampling field concrete: unset ones from ``model_defaults`` (a transformers
        ``GenerationConfig``, or ``None``), else greedy with no penalty."""
        samples = self.do_sample if self.do_sample is not None else bool(getattr(model_defaults, "do_sample", False))

        def default(name: str, fallback: Any) -> Any:
            value = getattr(model_defaults, name, None) if samples or name == "repetition_penalty" else None
            return fallback if value is None else value

        return replace(
            self,
            temperature=0.0 if self.do_sample is False else self.temperature if self.temperature is not None
            else (default("temperature", 1.0) if samples else 0.0),
            top_p=self.top_p if self.top_p is not None else default("top_p", 1.0),
            top_k=self.top_k if self.top_k is not None else default("top_k", 0),
            min_p=self.min_p if self.min_p is not None else default("min_p", 0.0),
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None
            else default("repetition_penalty", 1.0),
        )

    @property
    def greedy(self) -> bool:
        return not self.temperature


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine's scheduler: how many requests decode together, how many may wait, and
    how much memory their KV may take (docs/operations.md, "Sizing").

    max_batch_size:
        Requests decoded together (each holds its KV in memory while it runs). More wait.
    max_queued_requests:
        Requests queued beyond the running ones; one more is refused at once with
        ``SchedulerFullError`` rather than left to wait without bound (jobs, such as a warm, are not
        counted). ``max_waiting``, its old name, is still accepted (deprecated).
    max_prefills_per_step:
        Blends admitted between two decode steps: lower keeps tokens flowing to running
        requests, higher reaches first tokens sooner when many arrive at once.
    kv_budget_bytes:
        Bytes of KV the running requests may hold together. A request reserves ``(prompt tokens +
        max_new_tokens) x`` the model's KV bytes per token when it starts and frees them when it ends;
        one that does not fit beside the running ones waits (first come, first served), one that could
        never fit is refused at once with ``KVBudgetError``. ``None``: sized when the scheduler starts,
        from the model and the device (:func:`cacheblend_rag.serving.admission.default_kv_budget`).
    """

    max_batch_size: int = 16
    max_queued_requests: int = 256
    max_prefills_per_step: int = 1
    kv_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_range("max_batch_size", self.max_batch_size, 1, 4096, integer=True)
        # Every request passes through the queue: 0 would refuse them all.
        _check_range("max_queued_requests", self.max_queued_requests, 1, 1_000_000, integer=True)
        _check_range("max_prefills_per_step", self.max_prefills_per_step, 1, 4096, integer=True)
        if self.kv_budget_bytes is not None:
            _check_range("kv_budget_bytes", self.kv_budget_bytes, 1, 1 << 60, integer=True)


def _accepting_max_waiting(init: Any) -> Any:
    """``SchedulerConfig.__init__`` that also takes ``max_waiting``, the old name of ``max_queued_requests``."""

    @functools.wraps(init)
    def __init__(self: SchedulerConfig, *args: Any, max_waiting: int | None = None, **kwargs: Any) -> None:
        if max_waiting is not None:
            warnings.warn("SchedulerConfig(max_waiting=...) is deprecated; pass max_queued_requests", DeprecationWarning,
                          stacklevel=2)
            if kwargs.get("max_queued_requests", max_waiting) != max_waiting or len(args) > 1:
                raise ConfigError("max_waiting and max_queued_requests are both given; pass max_queued_requests only "
                                  "(max_waiting is its deprecated name)")
            kwargs["max_queued_requests"] = max_waiting
        init(self, *args, **kwargs)

    return __init__


def _deprecated_max_waiting(self: SchedulerConfig) -> int:
    warnings.warn("SchedulerConfig.max_waiting is deprecated; read max_queued_requests", DeprecationWarning,
                  stacklevel=2)
    return self.max_queued_requests


# The old name keeps working, with a warning, in the constructor and when read (it is no field, so
# dataclasses.replace and asdict never see it).
SchedulerConfig.__init__ = _accepting_max_waiting(SchedulerConfig.__init__)  # type: ignore[method-assign]
SchedulerConfig.max_waiting = property(_deprecated_max_waiting)  # type: ignore[attr-defined]
