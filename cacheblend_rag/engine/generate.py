"""Decoding from a blended cache with the model's own forward: the decoding cache, stop strings,
streaming. The next token is :mod:`~cacheblend_rag.engine.sampling`'s (:class:`TokenSampler`, here too
for the code that imports it from here)."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Generic, Iterable, Iterator, Protocol, TypeVar


from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine.decode import Decoding, DecodingModel, decode_logits
from cacheblend_rag.kv.source import KVSourceProvider
from cacheblend_rag.engine.results import BlendResult, GenerationResult
from cacheblend_rag.engine.sampling import TokenSampler
from cacheblend_rag.kv.segments import SegmentLike
from cacheblend_rag.errors import BlendInputError

R = TypeVar("R")


class BlendingModel(DecodingModel, Protocol):
    """What generation needs of an engine: decoding's needs, and a blend of the prompt to decode from
    (the engine's ``generate`` hands itself in; naming the engine here would import it back)."""

    def blend(
        self, segments: Iterable[SegmentLike], *, config: BlendConfig | None = None,
        store: KVSourceProvider | None = None, room: int = 0,
    ) -> BlendResult: ...


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
    eos = set(gen.eos_token_id) if gen.eos_token_id is not None else eos_token_ids(engine)
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
        if decoding.done:
            decoding.settle()
        else:
            decoding.release()  # a stream closed early frees its KV now, not when it is collected
    holder["result"] = decoding.result()


__all__ = ["BlendingModel", "GenerationStream", "TextStream", "TokenSampler", "eos_token_ids",
           "run_generation", "start_decoding"]
