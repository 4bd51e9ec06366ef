"""The chunk texts prompts will contain, in their one normal form (:func:`cacheblend_rag.reuse.prompt.chunk_text`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

from cacheblend_rag.kv.segments import Segment, StoredSegment
from cacheblend_rag.reuse.prompt import chunk_texts


def chunk_tiers(stats: dict[str, Any]) -> dict[str, int]:
    """``{"memory", "store", "computed"}``: a request's stored chunks by where their K/V came from
    (:meth:`~cacheblend_rag.serving.service.Served.stats`), from ``stats`` once segment-cache spans are out
    of its ``cache_hits``."""
    hits = int(stats.get("cache_hits") or 0)
    memory = min(hits, int(stats.get("memory_hits") or 0))  # memory_hits counts stored chunks only: within hits
    computed = int(stats.get("cache_misses") or 0) + int(stats.get("load_failures") or 0)
    return {"memory": memory, "store": hits - memory, "computed": computed}


class AnnouncedChunks:
    """Chunk texts that upcoming prompts are expected to contain: a bounded LRU.

    Every prompt is searched for all remembered texts (a chunk announced for one
    query can be reused by the next), while :meth:`latest` holds the texts of the
    most recent announcement, so a prompt can report which of them it lacks.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._latest: tuple[str, ...] = ()
        self._announcements = 0  # empty ones too: a retriever that found nothing announced nothing
        self._computed: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    def announce(self, texts: Iterable[str]) -> list[str]:
        """Remember ``texts`` (in :func:`chunk_text` form, empty ones dropped) and return them in order."""
        kept = chunk_texts(texts)
        with self._lock:
            for text in kept:
                self._texts[text] = None
                self._texts.move_to_end(text)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
            self._latest = tuple(kept)
            self._announcements += 1
        return kept

    def known(self) -> list[str]:
        """Every remembered text, least recently announced first."""
        with self._lock:
            return list(self._texts)

    def unannounced(self, texts: Iterable[str]) -> list[str]:
        """``texts`` (in :func:`chunk_text` form, empty ones dropped) that are not remembered, in order:
        what a caller that finds chunks in a conversation (tool results) still has to warm and announce."""
        kept = chunk_texts(texts)
        with self._lock:
            return [text for text in dict.fromkeys(kept) if text not in self._texts]

    def latest(self) -> tuple[str, ...]:
        with self._lock:
            return self._latest

    def announcements(self) -> int:
        """How many announcements were made since the last :meth:`clear`, empty ones included."""
        with self._lock:
            return self._announcements

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._latest = ()
            self._announcements = 0
            self._computed.clear()

    # A chunk the retrieval side computes at query time (the postprocessor, CacheBlendRetriever) is in
    # the store when the blend reads it, yet it was no store hit: the stats count it apart.
    def note_computed(self, token_ids: Iterable[Sequence[int]]) -> None:
        """The chunks (token ids) the retrieval side just computed for the coming request; replaces
        the previous request's, so a chunk noted once is counted apart by one request at most."""
        with self._lock:
            self._computed = {tuple(int(t) for t in ids) for ids in token_ids}

    def account(self, stats: dict[str, Any], segments: Sequence[Segment]) -> dict[str, Any]:
        """``stats`` with the store hits split: ``cache_hits`` counts chunks loaded as they were stored
        before this request, ``precomputed_for_request`` those the retrieval side computed for it (also
        moved to ``chunk_tiers["computed"]``)."""
        stored = [tuple(s.token_ids) for s in segments if isinstance(s, StoredSegment)]
        with self._lock:
            noted = [ids for ids in stored if ids in self._computed]
            self._computed.difference_update(noted)
        computed = min(len(noted), int(stats.get("cache_hits") or 0))  # a full-prefill answer loaded none
        stats["cache_hits"] = int(stats.get("cache_hits") or 0) - computed
        stats["precomputed_for_request"] = computed
        tiers = stats.get("chunk_tiers")
        if computed and isinstance(tiers, dict):
            # Computed for this request, then read back: "computed", not a hit of either tier. Warming writes
            # to the store, not the host-memory tier, so they were store reads, unless the tier held them.
            from_store = min(computed, tiers["store"])
            tiers.update(store=tiers["store"] - from_store, memory=tiers["memory"] - (computed - from_store),
                         computed=tiers["computed"] + computed)
        return stats

    def __len__(self) -> int:
        return len(self._texts)
