"""The settings both integrations share, in groups: which model and how it loads, where chunk K/V lives, which
prompt K/V is reused and by whom, the engine's scheduler, the blend, sampling.

Each group is a pydantic model of its own, validated field by field, the way vLLM's ``EngineArgs`` builds its
``ModelConfig``, ``CacheConfig`` and ``SchedulerConfig``. :class:`~cacheblend_rag.serving.settings.CacheBlendSettings`
is made of all of them, so the flat names users write (``recompute_ratio=0.2``, ``store_path=...``) are its
fields, and each group is also a property of it (``llm.storage.store_path``) and an argument
(``ChatCacheBlend(storage=StorageSettings(store_path=...))``). ``cacheblend-rag serve``'s settings flags are made
from the groups' :data:`~SettingsGroup.server_flags` (:func:`~cacheblend_rag.server.commands.register`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Literal, Optional, Union

from pydantic import BaseModel, ByteSize, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from cacheblend_rag.calibration.lookup import CALIBRATED_FIELDS, DEFAULT_CONDITION_CHUNKS
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.serving.arguments import BLEND_FIELDS, checked_as_given
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.serving.thinking import checked_template_kwargs
from cacheblend_rag.store import parse_size
from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.urls import password_apart, redact, split_password

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


@dataclass(frozen=True)
class ServerFlag:
    """How a field is a flag of ``cacheblend-rag serve``: its name, its help where the server's reading differs
    from the field's description (else the description), and ``store_true``/``store_false`` for a switch."""

    flag: str
    help: Optional[str] = None
    metavar: Optional[str] = None
    action: Optional[Literal["store_true", "store_false"]] = None


class SettingsGroup(BaseModel):
    """A group of settings; ``title`` heads its flags in ``cacheblend-rag serve --help``."""

    # hide_input_in_errors: pydantic's message of a failed check would quote every argument, store_password,
    # store_key and api_key among them; each check here names the value it refuses itself.
    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), hide_input_in_errors=True)

    title: ClassVar[str] = ""
    # The fields that are flags of `cacheblend-rag serve`; the others are the Python API's only.
    server_flags: ClassVar[Dict[str, ServerFlag]] = {}

    @model_validator(mode="before")
    @classmethod
    def _blend_and_sampling_as_given(cls, values: Any) -> Any:
        # BlendConfig's and GenerationConfig's checks, on the values as written (before pydantic coerces "0.15").
        if isinstance(values, dict):
            checked_as_given(values)
        return values


class LoadingSettings(SettingsGroup):
    """Which model, and how it loads: in process, or the server at ``base_url``."""

    title: ClassVar[str] = "model"
    server_flags: ClassVar[Dict[str, ServerFlag]] = {
        "model": ServerFlag("--model", metavar="NAME", help="the embedded SmolLM2-135M-Instruct (default), a catalog name "
                            "(qwen2.5-coder-1.5b), a model folder, a .gguf file, a hub id, or "
                            "tiny-<llama|mistral|qwen2|qwen3> (tests)"),
        "dtype": ServerFlag("--dtype", metavar="DTYPE", help="float32, bfloat16 or float16 (default: the loader's choice)"),
        "device": ServerFlag("--device", metavar="DEVICE", help="torch device, e.g. cuda:0 (default: cuda if available)"),
    }

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


class StorageSettings(SettingsGroup):
    """Where chunk K/V lives, how it is stored and who may write it."""

    title: ClassVar[str] = "chunk K/V store"
    server_flags: ClassVar[Dict[str, ServerFlag]] = {
        # The server's default is a disk folder in the package's cache (server.options.default_store_path).
        "store_path": ServerFlag("--store", metavar="URL|PATH", help="where chunk K/V lives: a folder, memory, "
                                 "tiered:PATH[,SPEC] or redis://... (default: a disk store in the package's cache "
                                 "folder, ~/.cache/cacheblend-rag/chunks)"),
        "require_store_key": ServerFlag("--require-store-key", action="store_true",
                                        help="refuse to start without a store key ($CACHEBLEND_STORE_KEY): without "
                                        "one, anyone who can write the store can plant chunk K/V that steers the "
                                        "answers (a warning says so)"),
        # The memory tier's size decides how much of a corpus each replica answers without a store read, so a
        # benchmark of the replicas' routing (benchmarks/bench_replicas.py) has to set it below the corpus.
        "resident_bytes": ServerFlag("--resident-bytes", metavar="SIZE",
                                     help="host-memory tier of chunk K/V in front of the store, e.g. 1GB; 0 turns it "
                                     "off (default: 1 GiB on a CPU, at most a sixteenth of its memory; 2 GiB on a "
                                     "GPU)"),
    }

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
        "4 GiB at most (cacheblend_rag.store.backends.memory_budget); a disk store is unbounded."
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

    @model_validator(mode="before")
    @classmethod
    def _store_password_apart(cls, values: Any) -> Any:
        # Before any field is validated, so that no field's check sees (or can show) the password in store_path.
        # On CacheBlendSettings it runs after the argument check (which shows names, never values), on its output.
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

    @field_validator("storage_dtype")
    @classmethod
    def _storage_dtype_is_known(cls, value: str) -> str:
        codec_named(value)  # ConfigError names the choices
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


class CacheSettings(SettingsGroup):
    """Which prompt K/V is reused (chunks, prefixes, segments), how much is kept, and what requests of
    different tenants (``cache_salt``) share."""

    title: ClassVar[str] = "prompt K/V reuse"
    server_flags: ClassVar[Dict[str, ServerFlag]] = {
        "reuse_chunk_kv": ServerFlag("--no-blend", action="store_false",
                                     help="answer every request by full prefill of its whole prompt (a baseline on "
                                     "the same server)"),
        "chunk_sharing": ServerFlag("--chunk-sharing", help="whether requests of different cache_salt share the "
                                    "chunk store: shared (default: a corpus is warmed once; another salt learns only "
                                    "that a chunk was seen) or per_salt (each salt's chunks keyed apart, so no hit "
                                    "tells one tenant of another's documents)"),
        # The prompt caches grow until full: a soak reading RSS idle to idle (benchmarks/soak_replicas.py) fills
        # them in its warm-up, as the in-process soak does, which needs them bounded below their defaults.
        "prefix_cache_bytes": ServerFlag("--prefix-cache-bytes", metavar="SIZE", help="host memory of the "
                                         "prompt-prefix K/V cache, e.g. 256MB; 0 turns it off (default: 256MB)"),
        "segment_cache_bytes": ServerFlag("--segment-cache-bytes", metavar="SIZE", help="host memory of the "
                                          "segment cache of prompt spans, e.g. 32MB; 0 turns it off (default: 64MB)"),
        "document_special_tokens": ServerFlag("--document-special-tokens", help="special-token strings "
                                              "(<|im_end|>, say) in documents and chunks: text (default: tokenized as "
                                              "the characters they spell, so a document cannot open a turn or end "
                                              "the text) or control (as control tokens, for trusted documents only); "
                                              "warm with the same"),
    }

    reuse_chunk_kv: bool = Field(
        default=True, description="False answers every prompt by full prefill of the whole prompt (a baseline)."
    )
    document_special_tokens: Literal["text", "control"] = Field(
        default="text",
        description="How special-token strings (<|im_end|>, <|endoftext|>) in chunk and document text are "
        "tokenized: 'text' as the plain characters they spell, so a retrieved document cannot close a turn, open "
        "a system turn or end the text; 'control' as control tokens, the tokenizer's way, for trusted text. The "
        "template and question are tokenized as the tokenizer does either way. Warm chunks with the same setting "
        "(cacheblend-rag warm --document-special-tokens). In process only: a server has its own flag.",
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

    @field_validator("prefix_cache_bytes", "segment_cache_bytes")
    @classmethod
    def _cache_size_is_understood(cls, value: Union[int, str], info: ValidationInfo) -> Union[int, str]:
        if isinstance(value, bool) or parse_size(value) < 0:
            raise ValueError(f"{info.field_name}={value!r} must be a size >= 0, e.g. 256MB, or 0 to disable it")
        return value


class SchedulingSettings(SettingsGroup):
    """The engine's request scheduler, shared by every object on one engine (the last one set wins)."""

    title: ClassVar[str] = "scheduler"
    server_flags: ClassVar[Dict[str, ServerFlag]] = {
        "max_queued_requests": ServerFlag("--max-queued-requests", metavar="N", help="requests that may wait "
                                          "beyond the running ones; one more gets 429 (default: 256)"),
        "kv_budget_bytes": ServerFlag("--kv-budget", metavar="SIZE", help="KV memory the running requests may "
                                      "hold together, e.g. 4GB (default: sized from the free memory)"),
    }

    max_queued_requests: Optional[int] = Field(
        default=None, ge=1, description="Requests that may wait beyond the running ones; one more is refused at once "
        "(SchedulerFullError). None: the scheduler's own (256). docs/operations.md, 'Sizing'.",
    )
    kv_budget_bytes: Optional[ByteSize] = Field(
        default=None, gt=0, description="KV memory the running requests may hold together, in bytes or with a unit "
        "('4GB'): a request that does not fit waits, one that never could is refused (KVBudgetError). None: sized "
        "from the memory free when the scheduler starts (half on a CPU, 80% on a GPU).",
    )


class BlendingSettings(SettingsGroup):
    """How prompts are blended: every :class:`~cacheblend_rag.config.BlendConfig` field (its docs have their
    full meaning), how chunks are precomputed, and where saved calibrations are read. Setting any of
    :data:`CALIBRATED_CHOICES` leaves the setting to the user: a saved calibration is then not used."""

    title: ClassVar[str] = "blend settings (default: the model's saved calibration, else the built-in; each flag given overrides it)"
    server_flags: ClassVar[Dict[str, ServerFlag]] = {name: ServerFlag("--" + name.replace("_", "-")) for name in BLEND_FIELDS}

    condition_chunks: bool = Field(
        default=DEFAULT_CONDITION_CHUNKS,
        description="Precompute chunks behind the chat template's lead and a stand-in passage (measured better "
        "than computing each alone, docs/quality.md); False computes each chunk on its own.",
    )
    calibration_dir: Optional[str] = Field(
        default=None,
        description="Folder of `cacheblend-rag calibrate` results; None: $CACHEBLEND_CALIBRATION_DIR, else "
        "~/.cache/cacheblend-rag/calibration. The model's result there is used unless a blend field or "
        "condition_chunks is set.",
    )
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


class SamplingSettings(SettingsGroup):
    """How answers are sampled (their length is each framework's own field: ``max_new_tokens``,
    ``max_tokens``); a request of the server carries its own."""

    title: ClassVar[str] = "sampling"

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


GROUPS: dict[str, type[SettingsGroup]] = {
    "loading": LoadingSettings, "storage": StorageSettings, "caches": CacheSettings, "scheduling": SchedulingSettings,
    "blending": BlendingSettings, "sampling": SamplingSettings,
}
# Setting any of these leaves the blend setting to the user: a saved calibration is then not used.
CALIBRATED_CHOICES = frozenset({*CALIBRATED_FIELDS, "condition_chunks"})

__all__ = ["BlendingSettings", "CacheSettings", "CALIBRATED_CHOICES", "DEFAULT_PREFIX_CACHE_BYTES",
           "DEFAULT_SEGMENT_CACHE_BYTES", "GROUPS", "LoadingSettings", "SamplingSettings", "SchedulingSettings",
           "ServerFlag", "SettingsGroup", "StorageSettings"]
