"""Plumbing shared by the LLM, the node postprocessor and the ingestion transform.

- :class:`AnnouncedChunks`: the chunk texts the retrieval side said prompts will contain.
- :func:`engine_lock`: one lock per engine, because a torch model is not re-entrant.
- :func:`iterate_in_thread`: drive a blocking iterator from a worker thread, so async
  streaming never blocks the event loop.
- :func:`open_chunk_cache` and :func:`node_chunk_text`.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, TypeVar

from llama_index.core.schema import BaseNode, MetadataMode

from cacheblend_rag.store import ChunkCache, DiskKVStore, open_store, parse_size

T = TypeVar("T")


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


def open_chunk_cache(engine: Any, store_path: str | None, size_limit: int | str | None = None) -> ChunkCache:
    """Chunk KV kept in memory (``store_path=None``) or in a persistent disk store at ``store_path``."""
    if store_path is None:
        return ChunkCache(engine, open_store(None, size_limit=size_limit))
    return ChunkCache(engine, DiskKVStore(store_path, size_limit=None if size_limit is None else parse_size(size_limit)))


_ITEM, _ERROR, _DONE = "item", "error", "done"


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield the items of a blocking iterator that runs entirely in one worker thread.

    One thread for the whole iteration (not one per item) so that locks taken inside
    the iterator are acquired and released by the same thread.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def send(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def produce() -> None:
        iterator = make_iterator()
        try:
            for item in iterator:
                send(_ITEM, item)
                if stop.is_set():
                    break
        except BaseException as exc:  # handed to the awaiting side, which re-raises it
            send(_ERROR, exc)
        else:
            send(_DONE, None)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name="cacheblend-stream", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        stop.set()
