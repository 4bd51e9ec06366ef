"""One timed request per method: prefill (or blend) to the first greedy token, then decoding.

Every method goes through :func:`run_request`, so TTFT means the same everywhere: from the
request's start to the first sampled token, as in :attr:`GenerationResult.ttft_s`. The same run
also yields the decoded answer (gold F1, exact match) and, after rolling the cache back to the
prompt, the teacher-forced logits along full prefill's answer (fidelity). One blend per method
and question therefore serves TTFT, decoding and quality.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.kv.segments import Segment


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [vocab], next-token logits after the prompt
    cache: DynamicCache  # KV of the whole prompt
    prompt_length: int
    stats: dict[str, Any] = field(default_factory=dict)


class Request:
    """A prompt processed one way. :meth:`prepare` is untimed set-up, :meth:`prefill` is timed."""

    def prepare(self) -> None:
        pass

    def prefill(self) -> PrefillOutput:
        raise NotImplementedError


class FullPrefillRequest(Request):
    def __init__(self, engine: CacheBlendEngine, input_ids: Sequence[int]) -> None:
        self.engine = engine
        self.input_ids = list(input_ids)

    def prefill(self) -> PrefillOutput:
        result = self.engine.full_prefill(self.input_ids)
        return PrefillOutput(result.logits, result.cache, len(self.input_ids), result.stats.to_dict())


class BlendRequest(Request):
    """Full reuse or a blend, reading chunk KV from ``store`` (a ChunkCache)."""

    def __init__(self, engine: CacheBlendEngine, segments: list[Segment], config: BlendConfig, store: Any) -> None:
        self.engine = engine
        self.segments = segments
        self.config = config
        self.store = store

    def prefill(self) -> PrefillOutput:
        result = self.engine.blend(self.segments, config=self.config, store=self.store)
        stats = result.stats.to_dict()
        # Not part of the stats a run reports (one entry per recomputed token), but the diagnostics need them.
        stats["selected_positions"] = list(result.stats.selected_positions)
        return PrefillOutput(result.logits, result.cache, len(result.input_ids), stats)


class PrefixCachingRequest(Request):
    """Prefix caching as vLLM/SGLang do it: the KV of the longest cached prefix, computed at its true
    positions, is reused exactly; the rest of the prompt is computed on top of it.

    ``prefix`` is the cached prefix's prefill (computed once per question; never modified).
    With ``prefix=None`` (the cold pass) the prefix is computed inside the timed part.

    A serving engine computes the rest's queries against all keys with a bottom-right causal
    kernel. On a CPU, scaled-dot-product attention has a fast kernel only for the plain causal
    mask; an explicit mask (what the model's own forward builds on top of a cache) computes every
    masked score and made prefix caching slower than full prefill. So the rest's queries are
    padded in front to the full length and run through the causal kernel; the padding costs
    ``prefix²/2`` extra scores, about 1% with ten passages. Models without a layer-wise adapter,
    and sliding-window layers, use the model's own forward instead.
    """

    def __init__(
        self, engine: CacheBlendEngine, input_ids: Sequence[int], prefix_length: int, prefix: PrefillOutput | None
    ) -> None:
        self.engine = engine
        self.input_ids = list(input_ids)
        self.prefix_length = prefix_length
        self.prefix = prefix

    @torch.inference_mode()
    def prefill(self) -> PrefillOutput:
        engine, p, n = self.engine, self.prefix_length, len(self.input_ids)
        prefix = self.prefix or FullPrefillRequest(engine, self.input_ids[:p]).prefill()
        adapter = engine.adapter
        windowed = adapter is not None and any(
            (w := adapter.sliding_window(layer)) is not None and n > w for layer in range(adapter.num_layers)
        )
        if adapter is None or windowed:
            logits, cache = self._model_forward(prefix.cache)
        else:
            logits, cache = self._padded_causal_forward(adapter, prefix.cache)
        stats = {"mode": "prefix_caching", "total_tokens": n, "cached_tokens": p, "reused_tokens": p,
                 "recomputed_tokens": 0, "fresh_tokens": n - p}
        return PrefillOutput(logits, cache, n, stats)

    def _model_forward(self, prefix_cache: DynamicCache) -> tuple[torch.Tensor, DynamicCache]:
        engine, p = self.engine, self.prefix_length
        cache = copy.deepcopy(prefix_cache)  # the model's forward appends to the cache it is given
        rest = torch.tensor([self.input_ids[p:]], dtype=torch.long, device=engine.device)
        positions = torch.arange(p, len(self.input_ids), device=engine.device).unsqueeze(0)
        out = engine.model(input_ids=rest, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], cache

    def _padded_causal_forward(self, a: Any, prefix_cache: DynamicCache) -> tuple[torch.Tensor, DynamicCache]:
        engine, p, n = self.engine, self.prefix_length, len(self.input_ids)
        dev = engine.device
        rest = torch.tensor([self.input_ids[p:]], dtype=torch.long, device=dev)
        hidden = a.embed(rest)
        cos, sin = a.rope_cos_sin(hidden, torch.arange(p, n, device=dev).unsqueeze(0))
        gqa = a.num_heads != a.num_kv_heads
        cache = DynamicCache(config=engine.model.config)
        last = a.num_layers - 1
        for layer in range(a.num_layers):
            q, k, v = a.qkv(layer, a.input_norm(layer, hidden))
            cached = prefix_cache.layers[layer]  # keys are stored rotated, at positions 0..p-1
            keys = torch.cat([cached.keys, a.apply_rope(k, cos, sin)], dim=2)
            values = torch.cat([cached.values, v], dim=2)
            cache.update(keys, values, layer)
            q = a.apply_rope(q, cos, sin)
            scale = a.attention_scale(layer)
            if layer == last:
                # Only the last token's output is needed, and it sees every key.
                hidden = hidden[:, -1:]
                attn = F.scaled_dot_product_attention(q[:, :, -1:], keys, values, scale=scale, enable_gqa=gqa)
            else:
                padded = torch.cat([q.new_zeros(q.shape[0], q.shape[1], p, q.shape[3]), q], dim=2)
                attn = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, scale=scale,
                                                      enable_gqa=gqa)[:, :, p:]
            hidden = a.mlp_block(layer, hidden + a.attention_output(layer, attn))
        return a.final_logits(hidden)[0, -1], cache


@dataclass
class RequestRun:
    ttft_s: float
    total_s: float
    token_ids: list[int]  # generated, without the end-of-sequence token
    text: str
    stopped_by: int | None  # the end-of-sequence token that ended decoding, if any
    stats: dict[str, Any]
    teacher_logits: torch.Tensor | None = None  # [k, vocab] float32 along the teacher tokens
    # The prompt's K/V per layer (keys after RoPE), each [kv_heads, tokens, head_dim], when asked for.
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        decode_time = self.total_s - self.ttft_s
        if len(self.token_ids) < 2 or decode_time <= 0:
            return None
        return (len(self.token_ids) - 1) / decode_time

    def answer_tokens(self, limit: int) -> list[int]:
        """The first ``limit`` answer tokens, ending with the end-of-sequence token if decoding stopped there."""
        tokens = self.token_ids[:limit]
        if len(tokens) < limit and self.stopped_by is not None:
            tokens.append(self.stopped_by)
        return tokens


def time_to_first_token(request: Request) -> float:
    """TTFT alone: prefill and the first greedy token, nothing else."""
    request.prepare()
    start = time.perf_counter()
    out = request.prefill()
    int(out.logits.argmax())
    return time.perf_counter() - start


@torch.inference_mode()
def run_request(
    engine: CacheBlendEngine,
    request: Request,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    ignore_eos: bool = False,
    teacher_tokens: Sequence[int] | None = None,
    teacher_limit: int = 16,
    keep_prompt_kv: bool = False,
) -> RequestRun:
    """Prefill, greedy-decode up to ``max_new_tokens``, then teacher-force.

    ``teacher_tokens=None`` teacher-forces along this run's own answer (what full prefill,
    the reference, does); pass ``teacher_limit=0`` to skip teacher forcing. ``keep_prompt_kv``
    keeps the prompt's K/V (the cache rolled back to the prompt) in :attr:`RequestRun.prompt_kv`.
    """
    request.prepare()
    start = time.perf_counter()
    out = request.prefill()
    token = int(out.logits.argmax())
    ttft = time.perf_counter() - start

    # The cache is rolled back to the prompt after decoding; one that cannot be cropped is copied now.
    snapshot = None if (teacher_limit <= 0 and not keep_prompt_kv) or out.cache.is_croppable \
        else copy.deepcopy(out.cache)
    decode_start = time.perf_counter()
    cache, position = out.cache, out.prompt_length
    tokens: list[int] = []
    stopped_by = None
    while True:
        if token in eos_ids and not ignore_eos:
            stopped_by = token
            break
        tokens.append(token)
        if len(tokens) >= max_new_tokens:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=engine.device)
        pos = torch.tensor([[position]], dtype=torch.long, device=engine.device)
        token = int(engine.model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True).logits[0, -1].argmax())
        position += 1
    total = ttft + time.perf_counter() - decode_start
    run = RequestRun(
        ttft_s=ttft, total_s=total, token_ids=tokens,
        text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
        stopped_by=stopped_by, stats=out.stats,
    )
    if teacher_limit > 0 or keep_prompt_kv:
        if snapshot is not None:
            cache = snapshot
        else:
            extra = cache.get_seq_length() - out.prompt_length
            if extra > 0:
                cache.crop(-extra)
        if keep_prompt_kv:
            # Cloned: teacher forcing appends to this cache, and a cropped layer may be a view of it.
            run.prompt_kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
    if teacher_limit > 0:
        forced = run.answer_tokens(teacher_limit) if teacher_tokens is None else list(teacher_tokens)
        run.teacher_logits = teacher_forced_logits(engine, out.logits, cache, out.prompt_length, forced)
    return run


@torch.inference_mode()
def teacher_forced_logits(
    engine: CacheBlendEngine, first_logits: torch.Tensor, cache: DynamicCache, prompt_length: int, tokens: Sequence[int]
) -> torch.Tensor:
    """Logits predicting each of ``tokens`` in turn, ``[len(tokens), vocab]`` in float32.

    The first comes from the prefill itself; the rest from one forward over ``tokens[:-1]``
    on top of the method's own prompt cache.
    """
    rows = [first_logits.float().unsqueeze(0)]
    if len(tokens) > 1:
        ids = torch.tensor([list(tokens[:-1])], dtype=torch.long, device=engine.device)
        positions = torch.arange(prompt_length, prompt_length + ids.shape[1], device=engine.device).unsqueeze(0)
        out = engine.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=0)
        rows.append(out.logits[0].float())
    return torch.cat(rows, dim=0).cpu()
