"""BlendService: a rendered prompt in, a blended answer out. What both integrations call.

Frameworks hand a model one rendered prompt string. The retrieval side has told the service which chunk texts
prompts will contain (:meth:`BlendService.announce`); one call (:meth:`BlendService.prepare`, that is
:meth:`~cacheblend_rag.reuse.plan.PromptReuse.plan`) learns for each span of the prompt where its K/V comes from
(the prefix cache, a chunk, the segment cache, or computed), the engine blends and decodes, and the request's
K/V is kept for the next (:mod:`~cacheblend_rag.reuse.plan` has the rules: exact and approximate blocks, cache
salts). All of that runs on the engine's :class:`~cacheblend_rag.serving.scheduler.RequestScheduler` worker, which
decodes concurrent requests together; callers on any thread only wait for their deltas.

The chunk store is shared across cache salts unless ``chunk_sharing="per_salt"``: a chunk's K/V is computed from
its text alone, so sharing it tells another tenant only that the chunk was seen. A response's stats are its
request's own; the caches' counters over all requests are :meth:`BlendService.stats` (the server's
``/metrics``), never in an answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.engine import CacheBlendEngine, GenerationResult
from cacheblend_rag.engine.decode import Decoding
from cacheblend_rag.engine.generate import start_decoding
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.reuse.announced import AnnouncedChunks, chunk_texts, chunk_tiers
from cacheblend_rag.reuse.plan import PreparedPrompt, PromptReuse
from cacheblend_rag.reuse.prefix_cache import PrefixCache
from cacheblend_rag.reuse.segment_cache import SegmentCache
from cacheblend_rag.serving.registry import scheduler_for
from cacheblend_rag.serving.scheduler import RequestHandle
from cacheblend_rag.store import ChunkCache, WarmSummary
from cacheblend_rag.store.chunk_warm import with_progress

logger = logging.getLogger(__name__)
# Whether the chunk store is shared across cache salts ("shared") or keyed apart per salt ("per_salt").
CHUNK_SHARING = ("shared", "per_salt")


@dataclass
class Served:
    """A finished request: the engine's result and the prompt it answered."""

    result: GenerationResult
    prompt: PreparedPrompt
    model: str
    recompute_ratio: float

    def stats(self) -> dict[str, Any]:
        """Flat, JSON-friendly stats (LlamaIndex ``additional_kwargs``, LangChain ``response_metadata["cacheblend"]``):
        the blend's and what was found of the chunks, this request's own counts only. What the caches hold
        and their counters over all requests are :meth:`BlendService.stats`: in every answer, they would let
        one user watch another's requests (a hit count that grows is someone's prompt).

        ``chunk_tiers`` counts this request's stored chunks by where their K/V came from: ``memory`` the chunk
        cache's host-memory tier, ``store`` a read of the store (disk, Redis, a memory store...), ``computed``
        computed for this request (a miss, or an entry that failed mid-read; the integrations then move chunks
        the retrieval side computed for it, ``precomputed_for_request``, here too). So ``memory + store`` is
        ``cache_hits`` and ``computed`` is ``cache_misses + load_failures`` (+ ``precomputed_for_request``).
        Segment-cache spans and the prefix cache's tokens are not chunks and are not counted
        (``segment_tokens``, ``prefix_tokens``). A ``full_prefill`` answer (reuse off, no chunk found, a
        fallback) used no chunk's K/V: all zeros, its chunks' tokens are among its ``fresh_tokens``."""
        stats = self.result.stats_dict()
        stats.update(chunks_found=self.prompt.chunks_found, chunks_missing=self.prompt.chunks_missing,
                     recompute_ratio=self.recompute_ratio, model=self.model)
        stats["segment_tokens"] = self.prompt.segment_tokens
        if self.prompt.segment_hits and stats["mode"] != "full_prefill":
            stats["cache_hits"] = max(0, int(stats.get("cache_hits") or 0) - self.prompt.segment_hits)
        if stats.get("fallback_reason") is None and stats["mode"] in ("full_prefill", "prefix_cached"):
            stats["fallback_reason"] = self.prompt.reason  # why no chunk K/V was reused, if none was found
        stats["chunk_tiers"] = chunk_tiers(stats)
        return stats


# Text deltas of one request, as the scheduler's worker decodes them; ``result()`` after the last one.
ServedStream = RequestHandle[Served]


class BlendService:
    """One engine, its chunk cache and the chunk texts announced to one integration object."""

    def __init__(self, engine: CacheBlendEngine, chunk_cache: ChunkCache, announced: AnnouncedChunks,
                 prefix_cache: PrefixCache | None = None, segment_cache: SegmentCache | None = None, *,
                 chunk_sharing: str = "shared", document_special_tokens: str = "text") -> None:
        """``document_special_tokens``: how special-token strings in chunk text are tokenized, when warmed
        and when found in a prompt: ``"text"`` as plain text, ``"control"`` as control tokens (trusted text;
        :func:`~cacheblend_rag.reuse.text.document_ids`)."""
        if chunk_cache.engine is not engine:
            raise ValueError("chunk_cache belongs to another engine; build it with ChunkCache(this engine, ...)")
        if chunk_sharing not in CHUNK_SHARING:
            raise ConfigError(f"chunk_sharing={chunk_sharing!r} must be one of {list(CHUNK_SHARING)}: 'shared' (one "
                              "chunk store for every cache salt) or 'per_salt' (each salt's chunks keyed apart)")
        self.chunk_sharing = chunk_sharing
        self.engine = engine
        self.chunk_cache = chunk_cache
        self.reuse = PromptReuse(engine, chunk_cache, announced, prefix_cache, segment_cache,
                                 document_special_tokens=document_special_tokens)
        self.scheduler = scheduler_for(engine)

    # The prompt-reuse state is the planner's; these read it there, so there is one of each.
    @property
    def announced(self) -> AnnouncedChunks:
        return self.reuse.announced

    @property
    def document_special_tokens(self) -> str:
        return self.reuse.document_special_tokens

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.reuse.prefix_cache

    @property
    def segment_cache(self) -> SegmentCache | None:
        return self.reuse.segment_cache

    # ------------------------------------------------------------- chunks
    def announce(self, texts: Iterable[str]) -> list[str]:
        """Tell the service that coming prompts may contain these chunk texts verbatim."""
        return self.announced.announce(texts)

    def warm(self, texts: Iterable[str], *, show_progress: bool = False, salt: str = "") -> WarmSummary:
        """Compute and store the KV of each chunk text the store lacks, on the scheduler's worker, a
        batch of chunks between two decode steps (``salt``: for that cache salt's requests, into the shared
        store unless ``chunk_sharing="per_salt"``)."""
        steps = self.chunks_for(salt).warm_steps(chunk_texts(texts), special_tokens=self.document_special_tokens)
        return self.scheduler.run_job(with_progress(steps, show_progress)).result()

    def chunks_for(self, salt: str) -> ChunkCache:
        """The chunk cache a request of cache salt ``salt`` reads and fills: the shared one, or with
        ``chunk_sharing="per_salt"`` the salt's own keys (no hit tells one tenant what another's documents are)."""
        return self.chunk_cache.salted(salt) if self.chunk_sharing == "per_salt" else self.chunk_cache

    # ------------------------------------------------------------- prompts
    def prepare(self, prompt: str, *, reuse: bool = True, blend: BlendConfig | None = None,
                chunks: Sequence[str] | None = None, salt: str = "", document_texts: Sequence[str] = ()
                ) -> PreparedPrompt:
        """``prompt`` as segments, each span's K/V from where it can come (:meth:`PromptReuse.plan
        <cacheblend_rag.reuse.plan.PromptReuse.plan>` has the arguments)."""
        return self.reuse.plan(prompt, reuse=reuse, blend=blend, chunks=chunks, salt=salt,
                               document_texts=document_texts)

    # ------------------------------------------------------------- answers
    def stream(
        self, prompt: str, generation: GenerationConfig, blend: BlendConfig, *, reuse: bool = True,
        chunks: Sequence[str] | None = None, salt: str = "", document_texts: Sequence[str] = (),
    ) -> ServedStream:
        """Submit ``prompt``: its text deltas as the scheduler decodes them; ``close()`` drops it.
        Raises :class:`~cacheblend_rag.serving.scheduler.SchedulerFullError` when the queue is full; the
        stream ends with :class:`~cacheblend_rag.serving.admission.KVBudgetError` when the prompt and
        ``max_new_tokens`` need more KV memory than the scheduler's whole budget. ``chunks``, ``salt`` and
        ``document_texts``: as :meth:`prepare` takes them."""
        submitted = time.perf_counter()
        prepared: list[PreparedPrompt] = []

        def start() -> Decoding:  # on the worker: the tokenizer and the model are its alone
            prepared.append(self.prepare(prompt, reuse=reuse, blend=blend, chunks=chunks, salt=salt,
                                         document_texts=document_texts))
            decoding = start_decoding(self.engine, prepared[0].segments, generation, blend,
                                      self.chunks_for(salt), started=submitted)
            if reuse and self.reuse.keeps:
                decoding.on_finish = lambda done: self.reuse.keep(done, prepared[0])
            return decoding

        def finish(result: GenerationResult) -> Served:
            return Served(result, prepared[0], self.engine.model_name, blend.recompute_ratio)

        def kv_tokens() -> int:  # on the worker, once queued: the KV it will hold, for the scheduler's budget
            # Counted as prepare will tokenize it: a document's special-token strings as text are more tokens.
            tokens = len(self.reuse.prompt_ids(prompt, self.reuse.known(chunks), document_texts))
            # The prompt and room for the answer, as Decoding sizes its buffers (the last token is never fed).
            return tokens + max(1, min(generation.max_new_tokens - 1, self.engine.context_window - tokens))

        return self.scheduler.submit(start, finish, kv_tokens=kv_tokens)

    def stats(self) -> dict[str, Any]:
        """Counters over every request, for an operator (the server's ``/metrics``), never in an answer: the
        prefix cache's and segment cache's state and hits (``None`` when off), the chunk store's
        (``ChunkCache.stats()``, as ``cacheblend-rag cache stats`` prints them) and the scheduler's."""
        return {"prefix_cache": self.prefix_cache.stats().to_dict() if self.prefix_cache is not None else None,
                "segment_cache": self.segment_cache.stats().to_dict() if self.segment_cache is not None else None,
                "store": self.chunk_cache.stats().to_dict(), "scheduler": self.scheduler.stats()}

    def generate(self, prompt: str, generation: GenerationConfig, blend: BlendConfig, *, reuse: bool = True) -> Served:
        stream = self.stream(prompt, generation, blend, reuse=reuse)
        try:
            return stream.result()
        finally:
            stream.close()  # interrupted while waiting: the request leaves the scheduler too
