"""CacheBlendEngine: one model, its chunk precompute, its blends, full prefill and decoding.

The engine is a facade over the pieces that do the work, each in its own module:

* :mod:`~cacheblend_rag.engine.precompute`: a chunk's K (before RoPE) and V, computed alone or
  behind a prefix (CacheBlend's offline step);
* :mod:`~cacheblend_rag.engine.validation`: the segments checked before anything is computed;
* :mod:`~cacheblend_rag.engine.blend_run`: one blend, layer by layer (start reading there);
* :mod:`~cacheblend_rag.engine.selection`: which cached tokens to recompute;
* :mod:`~cacheblend_rag.engine.profile` and :mod:`~cacheblend_rag.engine.attention`: the
  question's attention and the attention kernels a blend needs;
* :mod:`~cacheblend_rag.engine.gate`: the one-time check that ratio 1.0 equals full prefill;
* :mod:`~cacheblend_rag.engine.generate`: decoding from the blended cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Sequence

import torch
from transformers import DynamicCache

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import gate
from cacheblend_rag.engine.blend_run import SKIP_EXACT_PREFIX_SHARE, BlendRun
from cacheblend_rag.calibration.lookup import (CalibratedSetting, CalibrationLookup, WeightsKey, describe_config,
                                              find_calibration)
from cacheblend_rag.engine.generate import GenerationResult, GenerationStream, run_generation
from cacheblend_rag.kv.source import KVSourceProvider, open_cached_source
from cacheblend_rag.engine.layout import PromptLayout, exact_prefix_length, fresh_after_exact, split_approximate_prefix
from cacheblend_rag.engine.precompute import precompute_chunks
from cacheblend_rag.engine.results import BlendResult, BlendStats
from cacheblend_rag.kv.segments import ChunkKV, FreshSegment, PrefixSegment, Segment, SegmentLike, as_token_ids
from cacheblend_rag.engine.selection import SelectionStrategy, build_strategy
from cacheblend_rag.reuse.text import token_ids
from cacheblend_rag.engine.validation import validate_segments
from cacheblend_rag.errors import BlendInputError, ConfigError, UnsupportedArchitectureError
from cacheblend_rag.models.adapters import DecoderAdapter, get_adapter
from cacheblend_rag.models.dtype_choice import dtype_name
from cacheblend_rag.models.fingerprint import (WeightsStamp, model_fingerprint, source_identity, weights_identities,
                                               weights_shape, weights_stamp)

logger = logging.getLogger(__name__)

# Fewer cached tokens than this and a blend is no faster than full prefill: SmolLM2-135M on a
# 2-core CPU broke even at about 100 (benchmarks/bench_short_prompts.py, research/quality_notebook.md "Short
# prompts"). Full prefill is exact, so the rounding is up.
DEFAULT_MIN_BLEND_TOKENS = 128


class CacheBlendEngine:
    """Runs full prefill, chunk precompute and blends for one model.

    >>> engine = CacheBlendEngine.from_pretrained()          # SmolLM2-135M-Instruct, offline
    >>> chunk = engine.prefill_chunk(engine.tokenize("Paris is the capital of France.\\n"))
    >>> out = engine.generate([engine.tokenize("Context:\\n"), chunk, engine.tokenize("Q: capital?\\nA:")])
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        config: BlendConfig | None = None,
        adapter: DecoderAdapter | None = None,
        model_name: str | None = None,
        min_blend_tokens: int = DEFAULT_MIN_BLEND_TOKENS,
        calibration_dir: str | None = None,
    ) -> None:
        """``config``: the blend setting of calls that pass none; without it, the setting
        ``cacheblend-rag calibrate`` saved for this model (in ``calibration_dir``, else
        ``$CACHEBLEND_CALIBRATION_DIR``, else the cache's ``calibration`` folder) or the built-in one
        (:meth:`default_config`, :attr:`config_source`)."""
        self.model = model.eval()
        self.min_blend_tokens = BlendConfig(min_blend_tokens=min_blend_tokens).min_blend_tokens  # validated
        self.tokenizer = tokenizer
        self.config = config or BlendConfig()
        self.config_given = config is not None
        self.calibration_dir = calibration_dir
        self.model_name = model_name or getattr(model.config, "_name_or_path", None) or model.config.model_type
        self.unsupported_reason: str | None = None
        if adapter is None:
            try:
                adapter = get_adapter(model)
            except UnsupportedArchitectureError as exc:
                if not self.config.fallback_to_full_prefill:
                    raise
                self.unsupported_reason = str(exc)
        self.adapter = adapter
        if adapter is not None:
            self.plan(self.config)
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        # why the model is in this dtype; from_pretrained says how the loader chose it (models.dtype_choice)
        self.dtype_reason = f"as given: the model passed in holds {dtype_name(first.dtype)}"
        self._fingerprint: str | None = None
        self._stamp: WeightsStamp | None = None

    # ------------------------------------------------------------------ setup
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        *,
        config: BlendConfig | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        tokenizer: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        min_blend_tokens: int = DEFAULT_MIN_BLEND_TOKENS,
        calibration_dir: str | None = None,
        show_progress: bool | None = None,
    ) -> "CacheBlendEngine":
        """Load a model (default: the embedded SmolLM2-135M-Instruct) and wrap it; the options are
        :func:`cacheblend_rag.models.load_model`'s. ``min_blend_tokens``: prompts with fewer cached
        tokens are answered by full prefill, unless a :class:`BlendConfig` says otherwise."""
        from cacheblend_rag.models.loader import load_model

        loaded = load_model(name_or_path, device=device, dtype=dtype, require_adapter=False, tokenizer=tokenizer,
                            model_kwargs=model_kwargs, show_progress=show_progress)
        engine = cls(loaded.model, loaded.tokenizer, config=config, model_name=loaded.name,
                     min_blend_tokens=min_blend_tokens, calibration_dir=calibration_dir)
        engine.dtype_reason = loaded.dtype_reason
        return engine

    @property
    def fingerprint(self) -> str:
        """The model's identity (:mod:`~cacheblend_rag.models.fingerprint`): computed again whenever its
        weights change (in place, replaced, or this engine wraps a copy), so chunk KV of other weights
        is never reused. Checking walks every parameter (a few milliseconds on a CPU), so a caller that
        needs it many times in one request reads it once; recomputing hashes the weights."""
        stamp = weights_stamp(self.model)
        if self._fingerprint is None or stamp != self._stamp:
            if self._fingerprint is not None:
                logger.warning("the weights of %s changed since chunk KV was keyed; keys change with them",
                               self.model_name)
            elif not stamp.tracks_changes:
                logger.warning("the weights of %s are inference tensors, which keep no version counter: a change "
                               "made to them in place cannot be seen, and chunk KV keyed before it would be "
                               "reused. Load the model outside torch.inference_mode()", self.model_name)
            self._fingerprint = model_fingerprint(self.model, self.tokenizer, self.dtype)
            self._stamp = stamp
        return self._fingerprint

    # ------------------------------------------------------ the default setting
    def calibration(self, directory: str | None = None) -> CalibratedSetting | None:
        """The setting saved by ``cacheblend-rag calibrate`` (or shipped) for this model, if any: measured on this
        engine's device type first (its fingerprint's, else its weights' in another dtype), else one measured on
        another device type (:func:`~cacheblend_rag.calibration.lookup.find_calibration`)."""
        return self.calibration_lookup(directory).setting

    def calibration_lookup(self, directory: str | None = None) -> CalibrationLookup:
        """:meth:`calibration`, and why none fits where a calibration names this model but cannot be used."""
        if self.adapter is None:
            return CalibrationLookup(None)
        fingerprint = self.fingerprint  # (checks the weights' stamp first, which source_identity then reuses)
        key = WeightsKey(fingerprint, dtype_name(self.dtype), self.model_name, weights_shape(self.model),
                         source_identity(self.model, self._stamp),
                         lambda: weights_identities(self.model, self.tokenizer), device=self.device.type)
        return find_calibration(key, directory or self.calibration_dir)

    def default_and_source(self) -> tuple[BlendConfig, str]:
        """The blend setting of calls that pass none, and where it comes from: ``"user"`` (the
        engine's ``config``), ``"calibrated: <file>"`` (the user's calibration), ``"calibrated (shipped):
        <file>"`` (the one the package ships for this model; ``(shipped, measured in float32)`` when measured
        in another dtype, ``(measured on cpu in float32)`` when on another device type) or ``"built-in"`` (``"built-in (<why>)"`` when a calibration names this model but
        cannot be used)."""
        if self.config_given:
            return self.config, "user"
        found = self.calibration_lookup()
        if found.setting is None:
            return self.config, found.source
        return found.setting.apply_to(self.config), found.source

    def default_config(self) -> BlendConfig:
        return self.default_and_source()[0]

    @property
    def config_source(self) -> str:
        return self.default_and_source()[1]

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config(decoder=True).num_hidden_layers

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", 2048))

    def tokenize(self, text: str, *, what: str = "the text", special_tokens: str = "control") -> list[int]:
        """Token ids of ``text`` with no special tokens added (segments are tokenized on their own).
        Text that is not valid Unicode is a :class:`BlendInputError` naming ``what`` and the position.
        ``special_tokens="text"`` tokenizes special-token strings in it as plain text, as a document's are
        (:func:`~cacheblend_rag.reuse.text.document_ids`); ``"control"``, the tokenizer's way, is a prompt's."""
        return token_ids(self.tokenizer, text, what=what, special_tokens=special_tokens)

    def check_vocabulary(self, ids: Sequence[int], what: str) -> Sequence[int]:
        """``ids``, unless one lies outside the model's vocabulary (an error that names it)."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise BlendInputError(f"{what} holds token id {outside}, outside the model's vocabulary of {vocab} tokens "
                                  f"(ids 0 to {vocab - 1}); tokenize with this model's tokenizer")
        return ids

    def plan(self, cfg: BlendConfig) -> tuple[SelectionStrategy, int]:
        """The strategy ``cfg`` names, built with its settings, and the check layer it chooses at
        (``cfg.check_layer``, else the strategy's own). Raises :class:`ConfigError` for a strategy
        that is not registered or a layer this model does not have."""
        strategy = build_strategy(cfg)
        check_layer = cfg.check_layer if cfg.check_layer is not None else strategy.needs.check_layer
        num_layers = self.num_layers
        if check_layer >= num_layers:
            raise ConfigError(f"check_layer={check_layer} is out of range for a model with {num_layers} layers; "
                              f"allowed range is [0, {num_layers - 1}]")
        if cfg.profile_layers is not None and cfg.profile_layers > num_layers:
            raise ConfigError(f"profile_layers={cfg.profile_layers} is out of range for a model with {num_layers} "
                              f"layers; allowed range is [1, {num_layers}]")
        return strategy, check_layer

    # ------------------------------------------------------- chunk precompute
    @torch.inference_mode()
    def prefill_chunk(self, token_ids: Sequence[int], *, prefix_ids: Sequence[int] = ()) -> ChunkKV:
        """KV of one chunk at positions 0..n-1 (or behind ``prefix_ids``, which is not stored)."""
        return self.prefill_chunks([token_ids], prefix_ids=prefix_ids)[0]

    @torch.inference_mode()
    def prefill_chunks(
        self, chunks: Sequence[Sequence[int]], *, prefix_ids: Sequence[int] = (), batch_size: int = 8
    ) -> list[ChunkKV]:
        """Batched :meth:`prefill_chunk`, in the order given."""
        adapter = self._require_adapter("precompute chunk KV")
        checked = [self.check_vocabulary(as_token_ids(c, f"chunk {i}"), f"chunk {i}") for i, c in enumerate(chunks)]
        prefix = self.check_vocabulary(as_token_ids(prefix_ids, "prefix_ids"), "prefix_ids")
        return precompute_chunks(adapter, checked, prefix_ids=prefix, batch_size=batch_size,
                                 device=self.device, fingerprint=self.fingerprint)

    # ------------------------------------------------------------------ blend
    @torch.inference_mode()
    def blend(
        self,
        segments: Iterable[SegmentLike],
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
        room: int = 0,
    ) -> BlendResult:
        """Blend ``segments`` into next-token logits and a decoding cache (:mod:`~cacheblend_rag.engine.blend_run`).
        ``config``: this call's setting; ``None`` takes :meth:`default_config`. The stats name the
        setting and its source (``blend_setting``, ``config_source``). ``room``: tokens the answer may add,
        left free after the prompt in each merged layer's buffer so decoding writes them in place (generation
        passes its ``max_new_tokens``; capped by the context window)."""
        started = time.perf_counter()
        cfg, source = (config, "user") if config is not None else self.default_and_source()
        result = self._blend(segments, cfg, store, started, room)
        result.stats.blend_setting, result.stats.config_source = describe_config(cfg), source
        result.stats.dtype, result.stats.dtype_reason = dtype_name(self.dtype), self.dtype_reason
        result.stats.device = self.device.type  # whose calibration applies: one setting per device type
        return result

    def _blend(self, segments: Iterable[SegmentLike], cfg: BlendConfig, store: KVSourceProvider | None,
               started: float, room: int = 0) -> BlendResult:
        segs = validate_segments(self, segments, store)
        if all(isinstance(s, FreshSegment) for s in segs):
            return self._prefill([t for s in segs for t in s.token_ids], started)
        if self.adapter is None:
            return self._fall_back(segs, started, self.unsupported_reason)
        segs = self._approximate_prefix_blended(segs, cfg)
        # Exact as far as the segments tell; a store may yet say a stored lead was kept at fewer bits.
        exact = exact_prefix_length(segs)
        blendable = sum(len(s.token_ids) for s in segs if not isinstance(s, FreshSegment)) - exact
        least = self.min_blend_tokens if cfg.min_blend_tokens is None else cfg.min_blend_tokens
        reason = None
        if 0 < blendable < least:
            reason = (f"{blendable} cached tokens, fewer than min_blend_tokens={least}: full prefill is as fast on "
                      "a prompt this short, and exact")
            if not exact:
                return self._fall_back(segs, started, reason)
            # An exact prefix costs nothing to reuse: only what follows it is computed, as full prefill would.
            segs = fresh_after_exact(segs, exact)
        gate_s = 0.0  # the gate's one-time cost, said in the timings of the blend that paid it
        if cfg.gate:
            ok, gate_s = gate.passed(self, cfg)
            if not ok:
                result = self._fall_back(segs, started, "correctness gate failed for this model")
                if gate_s:
                    result.stats.timings["gate"] = gate_s
                return result
        strategy, check_layer = self.plan(cfg)
        # The store reads ahead from the first layer the blend reads: 0 when a profile or full reuse
        # reads every layer, or a long exact prefix read from it is left out of the early layers,
        # else the check layer (layers before it compute every token afresh).
        total = sum(len(s.token_ids) for s in segs)
        prefix_len = len(segs[0].token_ids) if isinstance(segs[0], PrefixSegment) else 0
        skips_stored_prefix = exact > prefix_len and exact >= SKIP_EXACT_PREFIX_SHARE * total
        reads_from_start = cfg.recompute_ratio == 0 or strategy.needs.profile is not None or skips_stored_prefix
        source, hits, misses = open_cached_source(self, segs, store, 0 if reads_from_start else check_layer)
        try:
            layout = PromptLayout.of(segs, self.device, source.lossless())
            room = max(0, min(room, self.context_window - layout.n))
            run = BlendRun(self.adapter, layout, source, cfg, strategy, check_layer, self.model.config, self.dtype,
                           room)
            result = run.run(started)
        finally:
            source.close()
        # A chunk is a hit only if its stored KV was used: one recomputed after a failed load is not.
        stats = result.stats
        if gate_s:
            stats.timings["gate"] = gate_s
        stats.fallback_reason = reason
        stats.load_failures = source.load_failures
        stats.cache_hits, stats.cache_misses = hits - stats.load_failures, misses
        stats.memory_hits = source.memory_hits  # of those hits, the ones the host-memory tier answered
        stats.store_error = source.store_error  # this request's failed store read, if one failed
        stats.loaded_tokens = stats.cached_tokens - source.computed_tokens
        return result

    def _approximate_prefix_blended(self, segs: list[Segment], cfg: BlendConfig) -> list[Segment]:
        """``segs`` with an opening prefix segment's approximate tokens split off as a cached segment the
        blend may recompute a share of (``BlendConfig.approximate_prefix_recompute_ratio``), unless
        nothing of it would be: at ``recompute_ratio`` 0 (full reuse) or that share 0, it is reused as is.
        At ``recompute_ratio`` 1.0 it is split whatever the share, so every token is recomputed."""
        first = segs[0]
        if not isinstance(first, PrefixSegment) or not first.approximate_tokens or self.adapter is None:
            return segs
        as_is = cfg.approximate_prefix_recompute_ratio == 0.0 and cfg.recompute_ratio < 1.0
        if cfg.recompute_ratio == 0.0 or as_is:
            return segs
        return [*split_approximate_prefix(self.adapter, first), *segs[1:]]

    def _fall_back(self, segs: list[Segment], started: float, reason: str | None) -> BlendResult:
        result = self._prefill([t for s in segs for t in s.token_ids], started)
        result.stats.fallback_reason = reason
        return result

    # ----------------------------------------------------------- full prefill
    @torch.inference_mode()
    def full_prefill(self, token_ids: Sequence[int]) -> BlendResult:
        """The baseline: the model's own forward over every token."""
        started = time.perf_counter()
        input_ids = list(self.check_vocabulary(as_token_ids(token_ids), "the prompt"))
        if not input_ids:
            raise BlendInputError("the prompt is empty; pass at least one token")
        return self._prefill(input_ids, started)

    def _prefill(self, input_ids: list[int], started: float) -> BlendResult:
        """Full prefill of ids already checked (a blend's segments were, as they were validated)."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = len(input_ids)
        stats = BlendStats(
            mode="full_prefill", total_tokens=n, cached_tokens=0, reused_tokens=0,
            recomputed_tokens=0, fresh_tokens=n, exact_kv_tokens=n, timings={"total": time.perf_counter() - started},
        )
        return BlendResult(logits=logits, cache=cache, input_ids=input_ids, stats=stats)

    # ---------------------------------------------------------------- gate
    def run_gate(self, cfg: BlendConfig) -> tuple[bool, float]:
        """Blend a short synthetic prompt at ratio 1.0 against full prefill: ``(passed, relative error)``.
        Blends call it once per model and device (:mod:`~cacheblend_rag.engine.gate`)."""
        return gate.run(self, cfg, self.plan(cfg)[1])

    def _require_adapter(self, what: str) -> DecoderAdapter:
        if self.adapter is None:
            raise UnsupportedArchitectureError(f"cannot {what}: {self.unsupported_reason}")
        return self.adapter

    # ------------------------------------------------------------ generation
    def generate(
        self,
        segments: Iterable[SegmentLike],
        generation: GenerationConfig | None = None,
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
        **generation_overrides: Any,
    ) -> GenerationResult:
        """Blend, then decode. ``generation_overrides`` are :class:`GenerationConfig` fields."""
        return run_generation(self, segments, generation, config, store, generation_overrides).result()

    def stream(
        self,
        segments: Iterable[SegmentLike],
        generation: GenerationConfig | None = None,
        *,
        config: BlendConfig | None = None,
        store: KVSourceProvider | None = None,
        **generation_overrides: Any,
    ) -> GenerationStream:
        """Like :meth:`generate`, but iterate over text deltas; ``.result()`` afterwards gives the totals."""
        return run_generation(self, segments, generation, config, store, generation_overrides)
