"""What a blend and a generation return. A leaf: imports nothing of the engine's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class BlendStats:
    mode: str  # "blend", "full_reuse" or "full_prefill"
    total_tokens: int
    cached_tokens: int  # tokens that came with cached KV
    # cached tokens whose chunk KV was kept as is (loaded, or computed for this request on a miss:
    # loaded_tokens says how many came from the store)
    reused_tokens: int
    recomputed_tokens: int  # cached tokens recomputed from the check layer on
    fresh_tokens: int  # tokens with no cached KV (template, glue, question, missed chunks)
    exact_tokens: int = 0  # cached tokens that form an exact prefix (reused as is, outside the budget)
    # tokens whose K/V came from the prefix cache (a PrefixSegment): exact ones (counted in exact_tokens
    # too) and approximate ones (an earlier blend's K/V, reused as is and outside the budget as well)
    prefix_tokens: int = 0
    approximate_prefix_tokens: int = 0  # of the prefix tokens, those that are approximate (never exact_tokens)
    # leading positions whose K/V in the result is what full prefill computes (all of them at ratio 1.0
    # or in full prefill; else up to the first blendable cached token): what a prefix cache may keep
    exact_kv_tokens: int = 0
    selected_positions: list[int] = field(default_factory=list)
    cache_hits: int = 0  # chunks whose stored KV was used
    # of the cache hits, stored chunks whose K/V the chunk cache's host-memory tier (resident) held, so no
    # store read was needed (a memory *store* is still a store read)
    memory_hits: int = 0
    cache_misses: int = 0  # chunks with no valid entry, computed for this request
    load_failures: int = 0  # chunks with an entry that could not be read whole, computed instead
    # why this request's chunks were computed when its read of the chunk store failed (the store's error,
    # passwords masked: "Redis at redis://host:6379/0 is unavailable (...); its chunks were computed fresh");
    # None when every read it made succeeded (or it read none)
    store_error: str | None = None
    loaded_tokens: int = 0  # cached tokens whose KV came from the store (or was passed in), not computed here
    timings: dict[str, float] = field(default_factory=dict)
    fallback_reason: str | None = None
    blend_setting: str | None = None  # the setting's short name, e.g. "query_profiled@0.15"
    # "built-in", "user", "calibrated: <file>", "calibrated (shipped): <file>"; "(... measured in float32)" when
    # the calibration was measured in another dtype than the engine's, "(measured on cpu in float32)" on another
    # device type; "built-in (<why>)" when one cannot be used
    config_source: str | None = None
    device: str | None = None  # the engine's device type, "cuda": calibrations measured on it come first
    dtype: str | None = None  # the engine's compute dtype, "bfloat16"
    dtype_reason: str | None = None  # why: "auto: bfloat16, 3.7x faster matmul than float32 on <cpu>", "explicit: ..."
    # the setting asked for probe tokens but the budget could not hold them: the blend ran without the
    # probes and the stale corrections they drive (the setting's name still carries them)
    probes_dropped: bool = False

    @property
    def reuse_fraction(self) -> float:
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-friendly, but ``selected_positions`` (one entry per recomputed token, not a statistic)."""
        stats = asdict(replace(self, selected_positions=[]))
        del stats["selected_positions"]
        return stats


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab], for the token after the prompt
    cache: DynamicCache  # ready for decoding at position len(input_ids)
    input_ids: list[int]
    stats: BlendStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int
    ttft_s: float  # request start to first sampled token
    total_s: float
    stats: BlendStats
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_time if len(self.token_ids) > 1 and decode_time > 0 else 0.0

    def stats_dict(self) -> dict[str, Any]:
        """Flat, JSON-friendly stats for integrations (LlamaIndex ``additional_kwargs``, LangChain metadata)."""
        return {
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            **self.stats.to_dict(),
        }

