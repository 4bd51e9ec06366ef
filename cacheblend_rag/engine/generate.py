"""Decoding from a blended cache with the model's own forward: the decoding cache, sampling, stop
strings, streaming."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Generic, Iterable, Iterator, Protocol, Sequence, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine.decode import Decoding, DecodingModel, decode_logits
from cacheblend_rag.engine.kv_source import KVSourceProvider
from cacheblend_rag.engine.results import BlendResult, GenerationResult
from cacheblend_rag.engine.segments import SegmentLike
from cacheblend_rag.errors import BlendInputError

R = TypeVar("R")


class BlendingModel(DecodingModel, Protocol):
    """What generation needs of an engine: decoding's needs, and a blend of the prompt to decode from
    (the engine's ``generate`` hands itself in; naming the engine here would import it back)."""

    def blend(
        self, segments: Iterable[SegmentLike], *, config: BlendConfig | None = None,
        store: KVSourceProvider | None = None, room: int = 0,
    ) -> BlendResult: ...


def decoding_cache(model_config: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A transformers cache holding each layer's merged K (rotated) and V, for the model's own forward."""
    cache = DynamicCache(config=model_config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        slot = cache.layers[layer] if layer < len(getattr(cache, "layers", ())) else None
        if type(slot) is DynamicLayer and not slot.is_initialized:
            # A plain layer's first update concatenates onto an empty tensor, which copies the
            # whole merged layer (docs/design.md, "Blend", step 5, has its cost), and even an empty
            # update makes two tensors and two copies a layer. The merged tensors are ours to hand
            # over: the layer is left as its first update would leave it (a test holds the two equal).
            slot.device, slot.keys, slot.values, slot.is_initialized = k.device, k, v, True
        else:  # sliding-window and other layer kinds keep their own bookkeeping
            cache.update(k, v, layer)
    return cache


class TokenSampler:
    """The next token from logits, as ``model.generate`` would pick it: repetition penalty over the
    prompt and the answer so far, then greedy, or temperature with top-k, top-p and min-p, seeded
    for reproducibility. A :class:`~cacheblend_rag.engine.constraints.JsonConstraint` first removes
    every token that would break the answer's JSON, and ``eos`` ids are removed until the answer holds
    ``cfg.min_new_tokens`` tokens. ``cfg`` must be :meth:`GenerationConfig.resolved`.

    All of it runs where the logits are (:meth:`sample`): nothing of the vocabulary's size crosses to the
    host, and nothing is read back but the chosen id (by the caller). The draw is torch's own for one
    sample (``multinomial`` draws exponential noise ``q`` of the vocabulary's size and takes
    ``argmax(probs / q)``), written out so that it makes no host sync (``multinomial`` checks its input
    on the host). On a CPU it draws the same noise from the same seeded generator as before, so a seed
    gives the same tokens; on a GPU the noise comes from a generator on the GPU seeded alike: a seed
    still gives the same tokens every time there, not the ones the host's generator would have drawn."""

    def __init__(self, cfg: GenerationConfig, prompt_ids: Sequence[int] = (), constraint: Any = None,
                 eos: Iterable[int] = ()) -> None:
        self.cfg = cfg
        self.constraint = constraint
        self.eos = sorted(eos) if cfg.min_new_tokens else []
        self.seen = set(prompt_ids) if cfg.repetition_penalty != 1.0 else set()
        self.seed = cfg.seed if cfg.seed is not None else int(time.time_ns() % (2**63))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._eos_index: torch.Tensor | None = None
        self._seen_mask: torch.Tensor | None = None  # self.seen as a mask over the vocabulary, on the device

    @property
    def generator(self) -> torch.Generator | None:
        """The host's generator (``None`` when greedy)."""
        return None if self.cfg.greedy else self._generator(torch.device("cpu"))

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> int:
        return int(self.sample(logits, generated))

    def sample(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> torch.Tensor:
        """The next token's id, a 0-d ``long`` tensor on ``logits``' device (read it back when needed)."""
        cfg = self.cfg
        if self.constraint is not None:
            logits = self.constraint.mask(logits, generated)
        if self.eos and len(generated) < cfg.min_new_tokens:
            if self._eos_index is None or self._eos_index.device != logits.device:
                self._eos_index = torch.tensor(self.eos, device=logits.device)
            held = logits.index_fill(-1, self._eos_index, float("-inf"))
            # A finished JSON answer allows only end-of-sequence: then it ends, min_new_tokens or not.
            logits = torch.where(torch.isfinite(held).any(), held, logits)
        if cfg.repetition_penalty != 1.0:
            logits = self._penalise(logits, generated)
        if cfg.greedy:
            return torch.argmax(logits)
        scores = logits.float() / cfg.temperature
        if cfg.top_k > 0:
            kth = torch.topk(scores, min(cfg.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_scores.softmax(-1) >= cfg.top_p  # keep the token that crosses top_p
            # The dropped tokens in the vocabulary's order (a scatter: indexing by a mask would sync).
            scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        if cfg.min_p > 0.0:
            probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
        noise = torch.empty_like(probs).exponential_(1, generator=self._generator(probs.device))
        return torch.argmax(probs / noise)

    def _penalise(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """``logits`` with every token of the prompt and the answer so far penalised (divided by the
        penalty where positive, multiplied where not), through a mask kept on the device."""
        self.seen.update(generated[-1:])
        if not self.seen:
            return logits
        size = logits.shape[-1]
        mask = self._seen_mask
        if mask is None or mask.device != logits.device:
            mask = torch.zeros(size, dtype=torch.bool, device=logits.device)
            known = [t for t in sorted(self.seen) if t < size]  # ids past the output rows (added tokens) never come
            mask[torch.tensor(known, dtype=torch.long, device=logits.device)] = True  # the prompt's, uploaded once
            self._seen_mask = mask
        elif generated:
            mask[generated[-1]] = True
        penalty = self.cfg.repetition_penalty
        return torch.where(mask, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def eos_token_ids(engine: DecodingModel) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (either may list several)."""
    ids: set[int] = set()
    for source in (getattr(engine.model, "generation_config", None), engine.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids


class TextStream(Generic[R]):
    """Iterates over text deltas as tokens are decoded; :meth:`result` drains it and returns the totals,
    which the producing generator leaves in ``holder["result"]`` once it is done. :meth:`close`
    stops the producer early (a decode stops at its next token)."""

    def __init__(self, iterator: Iterator[str], holder: dict[str, R]) -> None:
        self._iterator = iterator
        self._holder = holder

    def __iter__(self) -> Iterator[str]:
        return self._iterator

    def __next__(self) -> str:
        return next(self._iterator)

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def result(self) -> R:
        for _ in self._iterator:
            pass
        return self._holder["result"]


GenerationStream = TextStream[GenerationResult]


def _merge_generation(generation: GenerationConfig | None, overrides: dict[str, Any]) -> GenerationConfig:
    base = generation or GenerationConfig()
    known = {f.name for f in fields(GenerationConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise BlendInputError(f"unknown generation option(s) {unknown}; allowed: {sorted(known)}")
    if not overrides:
        return base
    values = {f.name: getattr(base, f.name) for f in fields(GenerationConfig)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GenerationConfig(**values)


def run_generation(
    engine: BlendingModel,
    segments: Iterable[SegmentLike],
    generation: GenerationConfig | None,
    config: BlendConfig | None,
    store: KVSourceProvider | None,
    overrides: dict[str, Any],
) -> GenerationStream:
    gen = _merge_generation(generation, overrides)
    segments = list(segments)
    holder: dict[str, GenerationResult] = {}
    return GenerationStream(_decode(engine, segments, gen, config, store, holder), holder)


def start_decoding(
    engine: BlendingModel,
    segments: list[SegmentLike],
    gen: GenerationConfig,
    config: BlendConfig | None,
    store: KVSourceProvider | None,
    started: float | None = None,
) -> Decoding:
    """Blend ``segments`` and sample the answer's first token: a request ready to decode.
    ``started`` (default: now) is when the request began, for its TTFT (a server passes the
    time it was submitted, so waiting in its queue counts)."""
    if engine.tokenizer is None:
        raise BlendInputError("generation needs a tokenizer to turn tokens into text")
    started = time.perf_counter() if started is None else started
    gen = gen.resolved(getattr(engine.model, "generation_config", None))
    eos = eos_token_ids(engine)
    constraint = None
    if gen.json_schema is not None:
        from cacheblend_rag.engine.constraints import JsonConstraint

        constraint = JsonConstraint.from_text(engine, gen.json_schema, sorted(eos), budget=gen.max_new_tokens,
                                              optional=not gen.json_only)
    # Room for the answer's tokens after the first, as the decoding KV will want it (Decoding.room).
    blended = engine.blend(segments, config=config, store=store, room=max(1, gen.max_new_tokens - 1))
    return Decoding(engine, gen, blended, TokenSampler(gen, blended.input_ids, constraint, eos), eos, started)


def _decode(
    engine: BlendingModel,
    segments: list[SegmentLike],
    gen: GenerationConfig,
    config: BlendConfig | None,
    store: KVSourceProvider | None,
    holder: dict[str, GenerationResult],
) -> Iterator[str]:
    decoding = start_decoding(engine, segments, gen, config, store)
    try:
        while True:
            delta = decoding.accept()
            if delta:
                yield delta
            if decoding.done:
                break
            decoding.advance(decode_logits(engine, [decoding])[0])
    finally:
        decoding.release()  # a stream closed early frees its KV now, not when it is collected
    holder["result"] = decoding.result()
