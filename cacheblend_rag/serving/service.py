"""BlendService: a rendered prompt in, a blended answer out. What both integrations call.

Frameworks hand a model one rendered prompt string. The retrieval side has told the service
which chunk texts prompts will contain (:meth:`BlendService.announce`); the service finds
them verbatim in the prompt, turns the prompt into segments (chunks looked up in the chunk
cache, everything else fresh), blends and decodes. All of that runs on the engine's
:class:`~cacheblend_rag.serving.scheduler.RequestScheduler` worker, which decodes concurrent
requests together; callers on any thread only wait for their deltas.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, FreshSegment, GenerationResult
from cacheblend_rag.engine.decode import Decoding
from cacheblend_rag.engine.generate import start_decoding
from cacheblend_rag.engine.segments import Segment
from cacheblend_rag.prompting import split_prompt, to_segments_in_context
from cacheblend_rag.serving.chunks import AnnouncedChunks, chunk_texts
from cacheblend_rag.serving.registry import scheduler_for
from cacheblend_rag.serving.scheduler import RequestHandle
from cacheblend_rag.store import ChunkCache, WarmSummary
from cacheblend_rag.store.chunk_cache import with_progress

logger = logging.getLogger(__name__)


@dataclass
class PreparedPrompt:
    """A prompt as segments, with what was found of the announced chunks."""

    segments: list[Segment]
    chunks_found: int
    chunks_missing: int  # texts of the latest announcement the prompt lacks verbatim
    reason: str | None  # why no chunk KV is reused, when none is


@dataclass
class Served:
    """A finished request: the engine's result and the prompt it answered."""

    result: GenerationResult
    prompt: PreparedPrompt
    model: str
    recompute_ratio: float

    def stats(self) -> dict[str, Any]:
        """Flat, JSON-friendly stats (LlamaIndex ``additional_kwargs``, LangChain ``response_metadata``)."""
        stats = self.result.stats_dict()
        stats.update(chunks_found=self.prompt.chunks_found, chunks_missing=self.prompt.chunks_missing,
                     recompute_ratio=self.recompute_ratio, model=self.model)
        if stats.get("fallback_reason") is None and stats["mode"] == "full_prefill":
            stats["fallback_reason"] = self.prompt.reason
        return stats


# Text deltas of one request, as the scheduler's worker decodes them; ``result()`` after the last one.
ServedStream = RequestHandle[Served]

# A prompt this long that reuses nothing is worth a warning: it is a RAG prompt by its size
# (shorter ones are often a chat engine's own calls, or no RAG at all).
LONG_PROMPT_TOKENS = 200


def _escaped(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii", "replace").replace("'", "\\'")


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


class BlendService:
    """One engine, its chunk cache and the chunk texts announced to one integration object."""

    def __init__(self, engine: CacheBlendEngine, chunk_cache: ChunkCache, announced: AnnouncedChunks) -> None:
        if chunk_cache.engine is not engine:
            raise ValueError("chunk_cache belongs to another engine; build it with ChunkCache(this engine, ...)")
        self.engine = engine
        self.chunk_cache = chunk_cache
        self.announced = announced
        self.scheduler = scheduler_for(engine)
        self._warned: set[str] = set()

    # ------------------------------------------------------------- chunks
    def announce(self, texts: Iterable[str]) -> list[str]:
        """Tell the service that coming prompts may contain these chunk texts verbatim."""
        return self.announced.announce(texts)

    def warm(self, texts: Iterable[str], *, show_progress: bool = False) -> WarmSummary:
        """Compute and store the KV of each chunk text the store lacks, on the scheduler's worker, a
        batch of chunks between two decode steps."""
        steps = self.chunk_cache.warm_steps(chunk_texts(texts))
        return self.scheduler.run_job(with_progress(steps, show_progress)).result()

    # ------------------------------------------------------------- prompts
    def prepare(self, prompt: str, *, reuse: bool = True) -> PreparedPrompt:
        """``prompt`` as segments: announced chunk texts found verbatim become stored chunks (computed
        behind the cache's prefix), everything else fresh text, with the ids the whole prompt
        tokenizes to where the tokenizer allows (so ratio 1.0 reproduces the plain model)."""
        if not reuse:
            return PreparedPrompt([FreshSegment(self.engine.tokenize(prompt))], 0, 0,
                                  "chunk KV reuse is off (reuse_chunk_kv=False)")
        split = split_prompt(prompt, self.announced.known())
        segments = to_segments_in_context(split, self.engine.tokenizer, self.chunk_cache.prefix_ids)
        found = set(split.found)
        return PreparedPrompt(
            segments=segments,
            chunks_found=len(split.found),
            # Chunks of the latest announcement that this prompt lacks verbatim (changed by a template,
            # truncated, or, in refine mode, simply handled by another call).
            chunks_missing=sum(1 for text in self.announced.latest() if text not in found),
            reason=None if split.found else self._no_reuse(prompt, sum(len(s.token_ids) for s in segments)),
        )

    def _no_reuse(self, prompt: str, tokens: int) -> str:
        """Why a prompt reuses no chunk KV, warned once per cause: the retrieval side announced
        nothing, or the prompt holds the announced chunks changed, escaped or cut."""
        latest = self.announced.latest()
        if not self.announced.known():
            cause, quiet = "none-announced", tokens < LONG_PROMPT_TOKENS  # a short prompt may well be no RAG prompt
            reason = ("no chunk text was announced to this model, so nothing can be reused: add "
                      "CacheBlendNodePostprocessor(llm=llm) to the query engine (LlamaIndex) or wrap the retriever "
                      "in CacheBlendRetriever (LangChain)")
        elif any(_escaped(text) in prompt for text in latest if _escaped(text) != text):
            cause, quiet = "escaped", False
            reason = ("the prompt holds the announced chunks escaped, as a Python list's repr (LlamaIndex's "
                      "response_mode='simple_summarize' renders them so), and escaped text has other KV: use "
                      "response_mode='compact' (the default), 'refine' or 'tree_summarize'")
        elif any(_normalized(text) in _normalized(prompt) for text in latest):
            cause, quiet = "changed", False
            reason = ("the prompt holds the announced chunks with their text changed (whitespace, case, or a "
                      "template rewriting them), so their KV is computed fresh")
        elif any(len(text) > 80 and text[: len(text) // 2] in prompt for text in latest):
            cause, quiet = "cut", False
            reason = ("the prompt holds only part of an announced chunk (compact repacking split it to fit the "
                      "context window, or it was truncated); the part is computed fresh")
        else:
            return "no announced chunk text appears verbatim in the prompt"
        if not quiet and cause not in self._warned:
            self._warned.add(cause)
            logger.warning("chunk KV reuse dropped to zero: %s", reason)
        return reason

    # ------------------------------------------------------------- answers
    def stream(
        self, prompt: str, generation: GenerationConfig, blend: BlendConfig, *, reuse: bool = True
    ) -> ServedStream:
        """Submit ``prompt``: its text deltas as the scheduler decodes them; ``close()`` drops it.
        Raises :class:`~cacheblend_rag.serving.scheduler.SchedulerFullError` when the queue is full."""
        submitted = time.perf_counter()
        prepared: list[PreparedPrompt] = []

        def start() -> Decoding:  # on the worker: the tokenizer and the model are its alone
            prepared.append(self.prepare(prompt, reuse=reuse))
            return start_decoding(self.engine, prepared[0].segments, generation, blend, self.chunk_cache,
                                  started=submitted)

        def finish(result: GenerationResult) -> Served:
            return Served(result, prepared[0], self.engine.model_name, blend.recompute_ratio)

        return self.scheduler.submit(start, finish)

    def generate(self, prompt: str, generation: GenerationConfig, blend: BlendConfig, *, reuse: bool = True) -> Served:
        stream = self.stream(prompt, generation, blend, reuse=reuse)
        try:
            return stream.result()
        finally:
            stream.close()  # interrupted while waiting: the request leaves the scheduler too
