"""The settings both integrations share, declared once as pydantic fields.

``CacheBlendLLM`` (LlamaIndex) and ``ChatCacheBlend`` (LangChain) inherit
:class:`CacheBlendSettings` beside their framework's base class, so they expose the same
fields with the same defaults, validated the same way: every :class:`~cacheblend_rag.BlendConfig`
field, which model and where chunk KV lives. Unknown keywords are an error that suggests the
closest known one (:mod:`~cacheblend_rag.serving.arguments` checks the names and reads the Hugging
Face spellings). Generation settings keep each framework's own names (``max_new_tokens`` in
LlamaIndex, ``max_tokens`` in LangChain) and live in the integrations.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, Literal, Optional, Union

from pydantic import ByteSize, ConfigDict, Field, PrivateAttr, SecretStr, ValidationInfo, field_validator, model_validator

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, build_strategy
from cacheblend_rag.calibration.lookup import (
    CALIBRATED_FIELDS,
    DEFAULT_CONDITION_CHUNKS,
    CalibratedSetting,
    CalibrationLookup,
    describe_config,
)
from cacheblend_rag.errors import ConfigError, UnsupportedArchitectureError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.prompting import default_conditioning_prefix
from cacheblend_rag.serving.arguments import (
    BLEND_FIELDS,
    SAMPLING_FIELDS,
    checked_as_given,
    hugging_face_spellings,
    unknown_names_error,
    with_generate_kwargs,
)
from cacheblend_rag.serving.chat_turn import ChatTurn, TurnEvent, appears_in, run_turn
from cacheblend_rag.serving.chunks import AnnouncedChunks
from cacheblend_rag.serving.pickling import PicklesWithoutEngine
from cacheblend_rag.serving.registry import chunk_cache_for, prefix_cache_for, scheduler_for, segment_cache_for
from cacheblend_rag.serving.registry import shared_engine
from cacheblend_rag.serving.remote import RemoteChat
from cacheblend_rag.serving.service import BlendService, Served
from cacheblend_rag.serving.thinking import checked_template_kwargs
from cacheblend_rag.store import ChunkCache, WarmSummary, parse_size
from cacheblend_rag.store.codec import codec_named
from cacheblend_rag.store.store_key import require_store_key, store_key
from cacheblend_rag.store.urls import password_apart, redact, split_password

logger = logging.getLogger(__name__)
_DEFAULTS = BlendConfig()
# 256 MiB holds about 5,700 tokens of SmolLM2-135M's K/V in float32 (46 KB a token): the leads and
# recent conversations of a small server. Larger models want more.
DEFAULT_PREFIX_CACHE_BYTES = 256 * 1024 * 1024
# On by default, so RAG chat engines (history after the context) reuse earlier turns without user
# code. 64 MiB holds about 1,400 tokens of SmolLM2-135M's K/V in float32 (46 KB a token): a few
# conversations' system prompt and recent turns, a quarter of the prefix cache's bound, whose exact
# K/V serves more requests. The price: a repeated span's K/V comes from whichever request computed
# it last, so an answer depends on the requests before it (serial and concurrent runs of the same
# prompts may differ slightly, still blended); 0 gives order-independent answers. docs/design.md,
# "The segment cache", has what it buys.
DEFAULT_SEGMENT_CACHE_BYTES = 64 * 1024 * 1024
# Setting any of these leaves the setting to the user: a saved calibration is then not used.
_CALIBRATED_CHOICES = frozenset({*CALIBRATED_FIELDS, "condition_chunks"})


class CacheBlendSettings(PicklesWithoutEngine):
    """Which model, where its chunk KV lives, and how prompts are blended. Pickled without the model,
    which an unpickled object attaches again on first use (:mod:`~cacheblend_rag.serving.pickling`)."""

    # hide_input_in_errors: pydantic's message of a failed check would quote every argument, store_password,
    # store_key and api_key among them; each check here names the value it refuses itself.
    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), hide_input_in_errors=True)

    # Standard parameters of hosted models that a subclass accepts and ignores.
    _ignored_init_args: ClassVar[frozenset[str]] = frozenset()

    # --- which model, and where chunk KV lives
    model: str = Field(
        default=DEFAULT_MODEL_NAME,
        description="The embedded 'SmolLM2-135M-Instruct' (default, offline), a catalog name ('qwen2.5-coder-1.5b', "
        "fetched once with `cacheblend-rag model fetch`), a model folder, a .gguf file, a hub id, or "
        "'tiny-<llama|mistral|qwen2|qwen3>' (tiny random models for tests).",
    )
    base_url: Optional[str] = Field(
        default=None,
        description="URL of a running `cacheblend-rag serve` (http://host:port, with or without /v1): the model "
        "answers there and nothing is loaded here; chunks go to it as the request's documents. None: in process.",
    )
    api_key: Optional[SecretStr] = Field(
        default=None, exclude=True, repr=False,
        description="The server's key (with base_url); None: $CACHEBLEND_API_KEY, else none. Never stored.",
    )
    engine: Optional[CacheBlendEngine] = Field(
        default=None, exclude=True, repr=False,
        description="An engine built by the caller, used instead of loading `model` (which then defaults to its name).",
    )
    chunk_cache: Optional[ChunkCache] = Field(
        default=None, exclude=True, repr=False,
        description="A chunk cache of `engine` to use instead of opening `store_path`.",
    )
    store_path: Optional[str] = Field(
        default=None,
        description="Where chunk KV lives: a folder (disk store), 'memory', 'tiered:PATH[,SPEC]' or 'redis://...' "
        "(cacheblend_rag.store.open_store); None keeps it in memory. Objects on one engine and store share it. "
        "A URL's password (redis://:PASSWORD@host/0) is moved to store_password: this field then reads "
        "redis://:***@host/0, and so do repr, dumps, traces, logs and errors.",
    )
    store_password: Optional[SecretStr] = Field(
        default=None, exclude=True, repr=False,
        description="The password of store_path's URL, kept apart from it (store_path='redis://:PASSWORD@...' puts "
        "it here); None: $CACHEBLEND_STORE_PASSWORD where the URL has none or '***' (a dump's, loaded elsewhere). "
        "Never stored or shown; pickles keep it, for the workers they are sent to.",
    )
    store_size_limit: Optional[Union[int, str]] = Field(
        default=None, description="Bound on a disk or memory store, in bytes or with a unit ('2GB'). None: a memory "
        "store (the default, 'memory', a tiered store's memory tier) holds at most an eighth of this process's memory, "
        "4 GiB at most (cacheblend_rag.store.memory_budget); a disk store is unbounded."
    )
    resident_bytes: Optional[Union[int, str]] = Field(
        default=None,
        description="Bound on the host-memory tier in front of the store, in bytes or with a unit ('4GB'): chunks "
        "already read (and verified) or computed, kept (page-locked on a GPU) so that later blends copy them "
        "without the store. "
        "None: 2 GiB on a GPU, 1 GiB on a CPU (at most a sixteenth of its memory); 0 disables it.",
    )
    storage_dtype: str = Field(
        default="auto",
        description="How chunk KV is stored: 'auto' (16 bits), 'float16', 'bfloat16', 'float32', or quantized 'int8' "
        "(about 0.51 of the 16-bit bytes) or 'int4' (about 0.28); a warm job must use the same.",
    )
    store_key: Optional[SecretStr] = Field(
        default=None, exclude=True, repr=False,
        description="Key of authenticated mode for a store shared with writers you do not trust (HMAC-SHA256 on "
        "every value; entries without a valid MAC are not used); None: $CACHEBLEND_STORE_KEY, else off. Never stored.",
    )
    require_store_key: bool = Field(
        default=False,
        description="Refuse to start without a store key (store_key or $CACHEBLEND_STORE_KEY). Without one a shared "
        "store (disk, Redis) takes any self-consistent entry planted in it, which is warned about once.",
    )
    device: Optional[str] = Field(default=None, description="Torch device; None picks CUDA when available.")
    dtype: Optional[str] = Field(default=None, description="float32, bfloat16 or float16; None picks per device.")
    show_progress: bool = Field(
        default=False,
        description="Show transformers' own progress bars (\"Loading weights\") while this object loads its model; "
                    "off, a load prints at most one line per step ($CACHEBLEND_SHOW_PROGRESS=1 turns them on too).",
    )
    tokenizer_name: Optional[str] = Field(
        default=None, description="Load the tokenizer from this folder or hub id instead of the model's."
    )
    model_kwargs: Dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to AutoModelForCausalLM.from_pretrained: trust_remote_code, revision, attn_implementation...",
    )
    chat_template_kwargs: Dict[str, Any] = Field(
        default_factory=dict,
        description="Variables of the model's chat template, passed to tokenizer.apply_chat_template: "
        "{'enable_thinking': False} turns Qwen3's thinking off.",
    )
    condition_chunks: bool = Field(
        default=DEFAULT_CONDITION_CHUNKS,
        description="Precompute chunks behind the chat template's lead and a stand-in passage (measured better "
        "than computing each alone, docs/quality.md); False computes each chunk on its own.",
    )
    document_special_tokens: Literal["text", "control"] = Field(
        default="text",
        description="How special-token strings (<|im_end|>, <|endoftext|>) in chunk and document text are "
        "tokenized: 'text' as the plain characters they spell, so a retrieved document cannot close a turn, open "
        "a system turn or end the text; 'control' as control tokens, the tokenizer's way, for trusted text. The "
        "template and question are tokenized as the tokenizer does either way. Warm chunks with the same setting "
        "(cacheblend-rag warm --document-special-tokens). In process only: a server has its own flag.",
    )
    calibration_dir: Optional[str] = Field(
        default=None,
        description="Folder of `cacheblend-rag calibrate` results; None: $CACHEBLEND_CALIBRATION_DIR, else "
        "~/.cache/cacheblend-rag/calibration. The model's result there is used unless a blend field or "
        "condition_chunks is set.",
    )
    reuse_chunk_kv: bool = Field(
        default=True, description="False answers every prompt by full prefill of the whole prompt (a baseline)."
    )
    max_announced_chunks: int = Field(
        default=4096, ge=1, description="How many announced chunk texts are remembered (least recent dropped)."
    )
    prefix_cache_bytes: Union[int, str] = Field(
        default=DEFAULT_PREFIX_CACHE_BYTES,
        description="Bound on the prefix cache, in bytes or with a unit ('256MB'): the K/V of prompt openings "
        "earlier requests computed exactly (template lead, system prompt, a chat's previous prompt and answer), "
        "reused as is; 0 disables it. Shared by every object on one engine and store (the largest bound wins).",
    )
    segment_cache_bytes: Union[int, str] = Field(
        default=DEFAULT_SEGMENT_CACHE_BYTES,
        description="Bound on the segment cache, in bytes or with a unit: the K/V of recent prompt spans after the "
        "chunks (an app's system prompt after the context, earlier turns of a chat), blended like a chunk when a "
        "later prompt repeats them; default 64MB. With it on, a span's K/V comes from an earlier request, so the "
        "same prompt may get a slightly different (still blended) answer depending on what was cached before; "
        "0 disables it: answers then never depend on the requests before them.",
    )
    prefix_cache_in_store: bool = Field(
        default=False,
        description="Also keep prefix-cache blocks in the chunk store when other processes can read it (a disk "
        "folder, Redis), so replicas share prefixes. Off by default: blocks are stored losslessly, every new "
        "block of every request is written, and a store sized for chunks fills up; a memory store never holds them.",
    )
    # --- tenants: what requests of different users share (docs/serving.md, "cache_salt")
    cache_salt: Optional[str] = Field(
        default=None,
        description="This object's requests' cache salt (a tenant's name, say); a call may pass its own "
        "(cache_salt=...; '' for none). Requests with different salts share no cached K/V of their prompts or "
        "answers (prefix cache, segment cache); the same salt, or none, share as before. Sent to the server "
        "with base_url. None: the shared namespace.",
    )
    chunk_sharing: Literal["shared", "per_salt"] = Field(
        default="shared",
        description="Whether cache salts share the chunk store: 'shared' (a common corpus is warmed once; a chunk's "
        "K/V comes from its text alone, so another salt learns only whether a chunk was seen, by its hits) or "
        "'per_salt' (each salt's chunks keyed apart, for tenants whose documents must not be probed). In process "
        "only: a server has its own (--chunk-sharing).",
    )
    # --- the engine's scheduler, shared by every object on the engine (the last one set wins)
    max_queued_requests: Optional[int] = Field(
        default=None, ge=1, description="Requests that may wait beyond the running ones; one more is refused at once "
        "(SchedulerFullError). None: the scheduler's own (256). docs/operations.md, 'Sizing'.",
    )
    kv_budget_bytes: Optional[ByteSize] = Field(
        default=None, gt=0, description="KV memory the running requests may hold together, in bytes or with a unit "
        "('4GB'): a request that does not fit waits, one that never could is refused (KVBudgetError). None: sized "
        "from the memory free when the scheduler starts (half on a CPU, 80% on a GPU).",
    )

    # --- BlendConfig (cacheblend_rag.config.BlendConfig has their full meaning)
    recompute_ratio: float = Field(default=_DEFAULTS.recompute_ratio, description="Share of cached tokens recomputed.")
    segment_recompute_ratio: Optional[float] = Field(
        default=_DEFAULTS.segment_recompute_ratio,
        description="Share of a cached segment's tokens recomputed (spans after the chunks from the segment cache, "
        "K/V computed behind other passages); None recomputes them under recompute_ratio with the chunks.",
    )
    approximate_prefix_recompute_ratio: Optional[float] = Field(
        default=_DEFAULTS.approximate_prefix_recompute_ratio,
        description="Share of an approximate prefix's tokens recomputed (a chat's earlier turns from the prefix "
        "cache, an earlier blend's K/V), chosen for the current question; 0 reuses them as is, None recomputes them "
        "under recompute_ratio with the chunks.",
    )
    approximate_prefix_chunk_factor: float = Field(
        default=_DEFAULTS.approximate_prefix_chunk_factor,
        description="Behind an approximate prefix reused as is (a chat's earlier turns), the chunks' recompute "
        "ratio is recompute_ratio times this (at most 1.0): the history takes no share, the new passages get it.",
    )
    check_layer: Optional[int] = Field(
        default=_DEFAULTS.check_layer,
        description="Layer where the tokens to recompute are chosen; None takes the selection strategy's own.",
    )
    deviation: str = Field(default=_DEFAULTS.deviation, description="'value' or 'key' deviation ranks tokens.")
    mask: str = Field(default=_DEFAULTS.mask, description="'exact' or 'bottom_right' attention mask for recompute.")
    selection: str = Field(default=_DEFAULTS.selection, description="Registered token-selection strategy.")
    sink_tokens: int = Field(default=_DEFAULTS.sink_tokens, description="Tokens at each chunk start sink_aware keeps.")
    query_weight: float = Field(default=_DEFAULTS.query_weight, description="Weight of attention in query_aware.")
    gradual_expand: float = Field(default=_DEFAULTS.gradual_expand, description="gradual's expansion factor.")
    profile_layers: Optional[int] = Field(
        default=_DEFAULTS.profile_layers,
        description="Layers query_profiled's profiling pass runs; None: all (fewer is cheaper and chooses worse).",
    )
    profile_tokens: Optional[int] = Field(
        default=_DEFAULTS.profile_tokens,
        description="The question's last tokens query_profiled's profiling pass runs; None: the whole question.",
    )
    stale_key_correction: float = Field(
        default=_DEFAULTS.stale_key_correction,
        description="Share of each chunk's mean key change, seen by its recomputed tokens, added to its stale keys "
        "(0: keys as stored).",
    )
    stale_value_correction: float = Field(
        default=_DEFAULTS.stale_value_correction,
        description="The same for values (0: values as stored); worth it with shift_probe_stride.",
    )
    shift_probe_stride: int = Field(
        default=_DEFAULTS.shift_probe_stride,
        description="Recompute every N-th token of each chunk as a probe, inside the budget, and estimate the two "
        "corrections from the probes only (0: from every recomputed token).",
    )
    shift_window: int = Field(
        default=_DEFAULTS.shift_window,
        description="Estimate the corrections per window of this many tokens of each chunk (0: per chunk).",
    )
    min_blend_tokens: Optional[int] = Field(
        default=_DEFAULTS.min_blend_tokens,
        description="Prompts with fewer cached tokens are answered by full prefill (as fast there, and exact); None: "
        "the engine's (128, measured on SmolLM2), 0: always blend.",
    )
    gate: bool = Field(default=_DEFAULTS.gate, description="Check once per model that ratio 1.0 equals full prefill.")
    gate_tolerance: Optional[float] = Field(default=_DEFAULTS.gate_tolerance, description="Gate tolerance override.")
    fallback_to_full_prefill: bool = Field(
        default=_DEFAULTS.fallback_to_full_prefill,
        description="Serve with full prefill when the architecture is unsupported or the gate fails.",
    )

    # --- sampling (the answer's length is each framework's own field: max_new_tokens, max_tokens)
    temperature: Optional[float] = Field(
        default=None, description="0 is greedy; None takes the model's generation config (greedy unless it samples)."
    )
    top_p: Optional[float] = Field(default=None, description="Nucleus sampling mass in (0, 1]; None: the model's.")
    top_k: Optional[int] = Field(default=None, description="Top-k sampling, 0 off; None: the model's.")
    min_p: Optional[float] = Field(default=None, description="Min-p sampling, 0 off; None: the model's.")
    repetition_penalty: Optional[float] = Field(
        default=None, description="Penalty on tokens already in the prompt or answer (1.0 none); None: the model's."
    )
    seed: Optional[int] = Field(default=None, description="Sampling seed, for reproducible sampled answers.")
    min_new_tokens: int = Field(
        default=0, description="End-of-sequence is not sampled before the answer holds this many tokens."
    )

    # As HuggingFaceLLM and HuggingFacePipeline take it; keys with a field here set it (serving.arguments).
    generate_kwargs: Dict[str, Any] = Field(default_factory=dict, description="model.generate's keyword arguments: "
        "max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size, "
        "stop_strings, eos_token_id, seed; a call may pass its own. num_beams>1 and the like are refused, saying why.")
    _max_tokens_field: ClassVar[str] = "max_new_tokens"

    _service: Optional[BlendService] = PrivateAttr(default=None)
    _remote: Optional[RemoteChat] = PrivateAttr(default=None)
    _remote_announced: Optional[AnnouncedChunks] = PrivateAttr(default=None)
    _calibration: Optional[CalibratedSetting] = PrivateAttr(default=None)
    _calibration_lookup: CalibrationLookup = PrivateAttr(default=CalibrationLookup(None))

    # ------------------------------------------------------------------ validation
    @model_validator(mode="before")
    @classmethod
    def _known_arguments_only(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        given = {k: v for k, v in values.items() if k not in cls._ignored_init_args}
        values = hugging_face_spellings(cls.__name__, given, cls._max_tokens_field, logger)
        allowed = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise unknown_names_error(cls.__name__, unknown, allowed)
        if values.get("model") is None:
            engine = values.get("engine")
            values["model"] = engine.model_name if engine is not None else DEFAULT_MODEL_NAME
        checked_as_given(values)
        return values

    @model_validator(mode="before")
    @classmethod
    def _store_password_apart(cls, values: Any) -> Any:
        # Before any other check, so that nothing after it sees (or can show) the password in store_path.
        return password_apart(values, "store_path", "store_password")

    @field_validator("store_path")
    @classmethod
    def _store_path_is_usable(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        value = os.fspath(value)
        if "://" in value or value == "memory" or value.split(":", 1)[0] in ("memory", "tiered", "disk"):
            return value  # opened (and checked) by open_store
        folder = Path(value).expanduser()
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            what = "is not a folder" if not existing.is_dir() else "is not writable"
            raise ValueError(
                f"store_path={value!r} cannot hold a chunk KV store: {existing} {what}; pass a folder this "
                "process can create and write, or store_path=None to keep chunk KV in memory"
            )
        return str(folder)

    @field_validator("base_url")
    @classmethod
    def _base_url_is_http(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url={redact(value)!r} must be an http:// or https:// URL of a running "
                             "`cacheblend-rag serve`, e.g. http://127.0.0.1:8000, or None to load the model in process")
        if value is not None and split_password(value)[1] is not None:  # it would show in repr, dumps and traces
            raise ValueError(f"base_url={redact(value)!r} carries a password; the server takes a key: pass it as "
                             "api_key= (or $CACHEBLEND_API_KEY) and drop it from the URL")
        return value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_are_the_templates(cls, value: Any) -> Dict[str, Any]:
        return checked_template_kwargs(cls.__name__, value)

    @field_validator("storage_dtype")
    @classmethod
    def _storage_dtype_is_known(cls, value: str) -> str:
        codec_named(value)  # ConfigError names the choices
        return value

    @field_validator("prefix_cache_bytes", "segment_cache_bytes")
    @classmethod
    def _cache_size_is_understood(cls, value: Union[int, str], info: ValidationInfo) -> Union[int, str]:
        if isinstance(value, bool) or parse_size(value) < 0:
            raise ValueError(f"{info.field_name}={value!r} must be a size >= 0, e.g. 256MB, or 0 to disable it")
        return value

    @field_validator("resident_bytes")
    @classmethod
    def _resident_size_is_understood(cls, value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
        if value is not None and (isinstance(value, bool) or parse_size(value) < 0):
            raise ValueError(f"resident_bytes={value!r} must be a size >= 0, e.g. 4GB, 0 to disable the host-memory "
                             "tier, or None for the device's default")
        return value

    @field_validator("store_size_limit")
    @classmethod
    def _size_limit_is_understood(cls, value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
        if value is not None and parse_size(value) < 1:
            raise ValueError(f"store_size_limit={value!r} must be a positive size, e.g. 2GB, or None for no bound")
        return value

    @model_validator(mode="after")
    def _validate_then_open(self) -> "CacheBlendSettings":
        # ConfigError is a ValueError, so pydantic reports it with the field, value and allowed range.
        build_strategy(self.blend_config)
        # The sampling fields, checked by GenerationConfig against the answer's length when it is set.
        self.generation_config_with(getattr(self, self._max_tokens_field, None) or max(1, self.min_new_tokens), None, {})
        self._validate_settings()
        if self.require_store_key and self.base_url is None:  # before the model loads; remote: the server's store
            self._check_store_key()
        if self.base_url is not None:  # the model is the server's: nothing is loaded here
            self._remote_announced = AnnouncedChunks(self.max_announced_chunks)
            return self
        # Only now, with every setting checked, is the model loaded (seconds) and the store opened.
        self._service = self._open_service()
        self.engine.plan(self.blend_config)  # the check layer against this model's depth
        return self

    def _validate_settings(self) -> None:
        """Checks of a subclass's own settings, run before the model is loaded."""

    def _check_store_key(self) -> None:
        if self.chunk_cache is not None:  # the cache given decides
            has_key = self.chunk_cache.tagger.authenticated
        else:
            has_key = store_key(self.store_key.get_secret_value() if self.store_key is not None else None) is not None
        require_store_key(has_key, "require_store_key=True")

    def _open_service(self) -> BlendService:
        if self.engine is None:
            self.engine = shared_engine(self.model, device=self.device, dtype=self.dtype,
                                        tokenizer=self.tokenizer_name, model_kwargs=self.model_kwargs,
                                        show_progress=self.show_progress or None)
        engine = self.engine
        if engine.adapter is None and not self.fallback_to_full_prefill:
            raise UnsupportedArchitectureError(
                f"{engine.unsupported_reason}; set fallback_to_full_prefill=True to serve this model "
                "with full prefill (no KV reuse)"
            )
        # Read once: the chunk cache's prefix follows it, and a setting must not change under a live object.
        if engine.adapter is not None and not self.model_fields_set & _CALIBRATED_CHOICES:
            # The engine's lookup: its fingerprint's setting, else its weights' measured in another dtype.
            self._calibration_lookup = engine.calibration_lookup(self.calibration_dir or engine.calibration_dir)
            self._calibration = self._calibration_lookup.setting
        if self.chunk_cache is None:
            prefix = default_conditioning_prefix(engine.tokenizer) if self.conditions_chunks else ()
            key = self.store_key.get_secret_value() if self.store_key is not None else None
            password = self.store_password.get_secret_value() if self.store_password is not None else None
            self.chunk_cache = chunk_cache_for(engine, self.store_path, prefix_ids=prefix,
                                               size_limit=self.store_size_limit, storage_dtype=self.storage_dtype,
                                               auth_key=key, resident_bytes=self.resident_bytes,
                                               store_password=password)
        prefix_cache = prefix_cache_for(engine, self.chunk_cache, parse_size(self.prefix_cache_bytes),
                                        in_store=self.prefix_cache_in_store)
        segment_cache = segment_cache_for(engine, parse_size(self.segment_cache_bytes))
        limits = {name: int(value) for name in ("max_queued_requests", "kv_budget_bytes")
                  if (value := getattr(self, name)) is not None}
        if limits:
            scheduler_for(engine).configure(**limits)
        return BlendService(engine, self.chunk_cache, AnnouncedChunks(self.max_announced_chunks), prefix_cache,
                            segment_cache, chunk_sharing=self.chunk_sharing,
                            document_special_tokens=self.document_special_tokens)

    # ------------------------------------------------------------------ configs
    @property
    def calibration(self) -> Optional[CalibratedSetting]:
        """The saved calibration in force: the model's, found when this object opened, unless a blend
        field or ``condition_chunks`` is set (then the user's setting is)."""
        return None if self.model_fields_set & _CALIBRATED_CHOICES else self._calibration

    @property
    def config_source(self) -> str:
        """Where the blend setting comes from: ``"user"``, ``"calibrated: <file>"``, ``"calibrated (shipped):
        <file>"`` (the package's own for this model), either noting ``measured in <dtype>`` when the engine
        computes in another, or ``"built-in"`` (``"built-in (<why>)"`` when a calibration cannot be used);
        with ``base_url``, ``"server: <base_url>"`` (the server's setting: each response's stats name it)."""
        if self.model_fields_set & _CALIBRATED_CHOICES:
            return "user"
        if self.base_url is not None:
            return f"server: {self.base_url}"
        return self._calibration_lookup.source

    @property
    def conditions_chunks(self) -> bool:
        """Whether chunks are computed behind a prefix: ``condition_chunks``, or the calibration's choice."""
        calibrated = self.calibration
        return calibrated.condition_chunks if calibrated is not None else self.condition_chunks

    @property
    def blend_config(self) -> BlendConfig:
        """The setting calls use: these fields, or the saved calibration's (:attr:`config_source`)."""
        config = BlendConfig(**{name: getattr(self, name) for name in BLEND_FIELDS})
        calibrated = self.calibration
        return calibrated.apply_to(config) if calibrated is not None else config

    def blend_config_with(self, overrides: dict[str, Any]) -> BlendConfig:
        """This object's blend config with per-call ``overrides`` (BlendConfig fields) applied."""
        config = self.blend_config.with_overrides(**overrides) if overrides else self.blend_config
        build_strategy(config)
        return config

    @property
    def service(self) -> BlendService:
        if self._service is None and self.base_url is not None:
            raise ConfigError(f"this {type(self).__name__} answers through the server at {self.base_url} and has "
                              "no engine here; drop base_url to load the model in process for this")
        return self._service

    # ------------------------------------------------------------------ turns
    @property
    def is_remote(self) -> bool:
        """Whether the model answers in a server (``base_url``) rather than in this process."""
        return self.base_url is not None

    @property
    def remote(self) -> RemoteChat:
        """The client of the server at ``base_url`` (made on first use, so an unpickled object makes its own)."""
        if self.base_url is None:
            raise ConfigError(f"this {type(self).__name__} has no base_url: it answers in process")
        if self._remote is None:
            key = self.api_key.get_secret_value() if self.api_key is not None else os.environ.get("CACHEBLEND_API_KEY")
            # The default name is filled in when none is given: then whatever model the server serves.
            model = None if self.model == DEFAULT_MODEL_NAME else self.model
            self._remote = RemoteChat(self.base_url, api_key=key, model=model)
        return self._remote

    @property
    def announced(self) -> AnnouncedChunks:
        """The chunk texts announced to this object (by its retriever or postprocessor)."""
        if self.base_url is not None:
            if self._remote_announced is None:  # unpickled
                self._remote_announced = AnnouncedChunks(self.max_announced_chunks)
            return self._remote_announced
        return self.service.announced

    def explicit_blend_options(self) -> dict[str, Any]:
        """The blend fields set on this object, which a server request carries (the server's own otherwise)."""
        return {name: getattr(self, name) for name in BLEND_FIELDS if name in self.model_fields_set}

    def run_turn(self, turn: ChatTurn) -> Iterator[TurnEvent]:
        """``turn`` answered in process or by the server at ``base_url``: the same events either way
        (:mod:`~cacheblend_rag.serving.chat_turn`). Remotely, the announced chunk texts found verbatim in the
        messages go as the request's documents (the server looks for those only). A turn without a
        ``cache_salt`` of its own takes this object's."""
        if turn.cache_salt is not None and not isinstance(turn.cache_salt, str):
            raise ConfigError(f"cache_salt={turn.cache_salt!r} must be a string (a tenant's name, say), '' for none")
        if turn.cache_salt is None and self.cache_salt:
            turn = replace(turn, cache_salt=self.cache_salt)
        if self.base_url is None:
            return run_turn(self, turn)
        if not turn.documents:
            turn = replace(turn, documents=[t for t in self.announced.known() if appears_in(t, turn)])
        if turn.reuse is None and "reuse_chunk_kv" in self.model_fields_set:
            turn = replace(turn, reuse=self.reuse_chunk_kv)
        return self.remote.run_turn(turn, self.explicit_blend_options())

    def stats_of(self, served: Served) -> dict[str, Any]:
        """The stats a response carries: ``served``'s, with chunks the retrieval side computed for this
        request (``precomputed_for_request``) told apart from store hits (``cache_hits``)."""
        stats = self._service.announced.account(served.stats(), served.prompt.segments)
        # The engine saw a config passed in ("user"); where it came from is known here. A call that
        # overrode the setting ran another one than this object's.
        own = stats.get("blend_setting") == describe_config(self.blend_config)
        stats["config_source"] = self.config_source if own else "user"
        stats["condition_chunks"] = bool(self._service.chunk_cache.prefix_ids)
        return stats

    def precompute_texts(self, texts: list[str], *, show_progress: bool, for_request: bool) -> WarmSummary:
        """Compute and store the KV of the chunk texts the store lacks; ``for_request``: for the coming
        request (the retrieval side at query time), whose stats then count those chunks apart."""
        if self.base_url is not None:
            counts = self.remote.warm(texts, cache_salt=self.cache_salt)
            return WarmSummary(new=int(counts.get("computed") or 0), present=int(counts.get("already_stored") or 0))
        summary = self._service.warm(texts, show_progress=show_progress, salt=self.cache_salt or "")
        if for_request:
            self._service.announced.note_computed(summary.computed)
        return summary

    def generation_config_with(self, max_new_tokens: int, stop: Optional[list], overrides: dict[str, Any]
                               ) -> GenerationConfig:
        """The generation config of one call: these fields and ``generate_kwargs``, then the call's ``overrides``."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values.update({k: v for k, v in overrides.items() if k in SAMPLING_FIELDS and v is not None})
        values.update(max_new_tokens=max_new_tokens, stop=tuple(stop or ()))
        return GenerationConfig(**with_generate_kwargs(type(self).__name__, values, self.generate_kwargs, overrides))


__all__ = ["BLEND_FIELDS", "CacheBlendSettings", "ConfigError", "SAMPLING_FIELDS", "unknown_names_error"]
