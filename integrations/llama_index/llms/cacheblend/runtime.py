"""Plumbing shared by the LLM, the node postprocessor and the ingestion transform.

- :class:`AnnouncedChunks`: the chunk texts the retrieval side said prompts will contain.
- :func:`engine_lock`: one lock per engine, because a torch model is not re-entrant.
- :func:`open_chunk_cache` and :func:`node_chunk_text`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Iterable, Sequence

from llama_index.core.schema import BaseNode, MetadataMode

from cacheblend_rag.store import ChunkCache, DiskKVStore, open_store, parse_size

def node_chunk_text(node: BaseNode, metadata_mode: MetadataMode = MetadataMode.LLM) -> str:
    """The text of ``node`` as the query engine will render it into the prompt.

    Stripped, because some LlamaIndex components strip chunk text before joining it
    (compact mode, CondensePlusContextChatEngine) while others do not; a stripped
    text is found verbatim in both, and the whitespace around it becomes fresh glue.
    """
    return node.get_content(metadata_mode=metadata_mode).strip()


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
        self._lock = threading.Lock()

    def announce(self, texts: Iterable[str]) -> list[str]:
        """Remember ``texts`` (stripped, empty ones dropped) and return them in order."""
        kept = [t.strip() for t in texts if t and t.strip()]
        with self._lock:
            for text in kept:
                self._texts[text] = None
                self._texts.move_to_end(text)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
            self._latest = tuple(kept)
        return kept

    def known(self) -> list[str]:
        with self._lock:
            return list(self._texts)

    def latest(self) -> tuple[str, ...]:
        with self._lock:
            return self._latest

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._latest = ()

    def __len__(self) -> int:
        return len(self._texts)


_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_ENGINE_LOCKS_GUARD = threading.Lock()


def engine_lock(engine: Any) -> threading.RLock:
    """The lock serialising every use of ``engine``, shared by all LLMs built on it."""
    with _ENGINE_LOCKS_GUARD:
        lock = _ENGINE_LOCKS.get(engine)
        if lock is None:
            lock = _ENGINE_LOCKS[engine] = threading.RLock()
        return lock


def open_chunk_cache(
    engine: Any, store_path: str | None, size_limit: int | str | None = None, *, prefix_ids: Sequence[int] = ()
) -> ChunkCache:
    """Chunk KV kept in memory (``store_path=None``) or in a persistent disk store at ``store_path``,
    computed behind ``prefix_ids``."""
    if store_path is None:
        store = open_store(None, size_limit=size_limit)
    else:
        store = DiskKVStore(store_path, size_limit=None if size_limit is None else parse_size(size_limit))
    return ChunkCache(engine, store, prefix_ids=prefix_ids)

