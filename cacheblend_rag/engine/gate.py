"""The correctness gate: before a model's first blend, check that the layer-wise path reproduces it.

No reference implementation checks this (LMCache issue 4666), and an adapter that misses one
detail of an architecture would blend wrong answers without a sign. So on first use of a
model (per fingerprint and device) a short synthetic prompt of two chunks is blended at ratio
1.0 and compared with the model's own forward. The result is remembered per process.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Protocol, Sequence

import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.results import BlendResult
from cacheblend_rag.kv.segments import ChunkKV, SegmentLike
from cacheblend_rag.errors import CorrectnessGateError

logger = logging.getLogger(__name__)

# fingerprint/device -> (passed, relative error)
RESULTS: dict[tuple[str, str], tuple[bool, float]] = {}


class GatedModel(Protocol):
    """What the gate needs of an engine: the model's identity (the key it remembers results by) and
    the engine's own precompute, blend and full prefill, which it compares. The engine calls the gate
    before it blends, so the gate names these instead of importing the engine."""

    model: torch.nn.Module
    model_name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def fingerprint(self) -> str: ...

    @property
    def num_layers(self) -> int: ...

    def prefill_chunks(self, chunks: Sequence[Sequence[int]]) -> list[ChunkKV]: ...

    def blend(self, segments: Iterable[SegmentLike], *, config: BlendConfig | None = None) -> BlendResult: ...

    def full_prefill(self, token_ids: Sequence[int]) -> BlendResult: ...

    def run_gate(self, cfg: BlendConfig) -> tuple[bool, float]: ...


def tolerance(engine: GatedModel, cfg: BlendConfig) -> float:
    """``cfg.gate_tolerance``, else what the compute dtype can hold: a relative error of 1e-3 in
    float32 and 5e-2 in 16-bit (bfloat16 keeps 8 bits of mantissa, a relative step of 0.4%,
    and a 30-layer model accumulates several such roundings per logit)."""
    if cfg.gate_tolerance is not None:
        return cfg.gate_tolerance
    return 1e-3 if engine.dtype == torch.float32 else 5e-2


def _key(engine: GatedModel) -> tuple[str, str]:
    # The fingerprint stamps every tensor (0.7 ms for SmolLM2): read once per call below.
    return engine.fingerprint, f"{engine.device}"


def pending(engine: GatedModel) -> bool:
    """Whether this process has not yet run the gate for ``engine``'s model and device (its next blend will)."""
    return _key(engine) not in RESULTS


def remember(engine: GatedModel, outcome: tuple[bool, float]) -> tuple[bool, float]:
    """Keep ``outcome`` (of ``engine.run_gate``) as this process's gate result for its model and device."""
    RESULTS[_key(engine)] = outcome
    return outcome


def passed(engine: GatedModel, cfg: BlendConfig) -> tuple[bool, float]:
    """Whether ``engine`` may blend, and the seconds this call spent running the gate (0.0 once this process
    has run it for the model and device). A failed gate raises :class:`CorrectnessGateError`, or, with
    ``cfg.fallback_to_full_prefill``, logs a warning and returns ``False``."""
    key, spent = _key(engine), 0.0
    if key not in RESULTS:
        started = time.perf_counter()
        RESULTS[key] = engine.run_gate(cfg)
        spent = time.perf_counter() - started
    ok, err = RESULTS[key]
    if ok:
        return True, spent
    message = (
        f"correctness gate failed for {engine.model_name}: blending at ratio 1.0 differs from full "
        f"prefill by {err:.3g} (tolerance {tolerance(engine, cfg):.3g}). Blending would give wrong "
        "answers; use BlendConfig(fallback_to_full_prefill=True) to serve with full prefill"
    )
    if cfg.fallback_to_full_prefill:
        logger.warning(message)
        return False, spent
    raise CorrectnessGateError(message)


def run(engine: GatedModel, cfg: BlendConfig, check_layer: int) -> tuple[bool, float]:
    """Blend a short synthetic prompt at ratio 1.0 and compare with the model's own prefill."""
    vocab = engine.model.config.get_text_config(decoder=True).vocab_size
    ids = [(17 + 7919 * i) % vocab for i in range(48)]
    prefix, chunk_a, chunk_b, suffix = ids[:6], ids[6:22], ids[22:40], ids[40:]
    chunks = engine.prefill_chunks([chunk_a, chunk_b])
    # min_blend_tokens=0: the prompt's 34 cached tokens are fewer than an engine's default 128, under which a
    # blend falls back to full prefill, and the gate would compare full prefill with itself (it did: a broken
    # layer passed with error 0.0 on every model loaded with the default).
    exact = BlendConfig(recompute_ratio=1.0, check_layer=min(check_layer, engine.num_layers - 1), gate=False,
                        min_blend_tokens=0)
    result = engine.blend([prefix, chunks[0], chunks[1], suffix], config=exact)
    if result.stats.mode == "full_prefill":  # nothing blended, nothing checked: a failed gate, not a pass
        logger.warning("correctness gate for %s: its blend fell back to full prefill (%s)", engine.model_name,
                       result.stats.fallback_reason)
        return False, float("inf")
    blended = result.logits.float()
    reference = engine.full_prefill(ids).logits.float()
    err = float((blended - reference).abs().max() / reference.abs().max().clamp(min=1.0))
    ok = err <= tolerance(engine, cfg)
    logger.info("correctness gate for %s: relative error %.3g, passed=%s", engine.model_name, err, ok)
    return ok, err
