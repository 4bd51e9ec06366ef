"""ChunkCache: what the engine and the integrations talk to.

PROVISIONAL in-memory implementation; the KV store issue replaces the internals
with KVStore backends (memory, disk, tiered) and a pipelined loader while keeping
this public surface:

- ``ChunkCache(engine, store=None, *, prefix_ids=(), batch_size=8)``
- ``open_source(engine, segments) -> (CachedKVSource, hits, misses)``  (engine.blend(store=...))
- ``warm(items, *, show_progress=False) -> WarmSummary``  (texts or token lists)
- ``contains(token_ids, prefix_ids=None) -> bool``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tqdm.auto import tqdm

from cacheblend_rag.engine.kv_source import CachedKVSource, InMemoryKVSource
from cacheblend_rag.engine.segments import ChunkKV, StoredSegment


@dataclass
class WarmSummary:
    new: int = 0
    present: int = 0
    bytes_written: int = 0


class ChunkCache:
    def __init__(self, engine: Any, store: Any = None, *, prefix_ids: Sequence[int] = (), batch_size: int = 8) -> None:
        self.engine = engine
        self.store = store
        self.prefix_ids = tuple(int(t) for t in prefix_ids)
        self.batch_size = batch_size
        self._chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkKV] = {}

    def _ids(self, item: str | Sequence[int]) -> tuple[int, ...]:
        return tuple(self.engine.tokenize(item)) if isinstance(item, str) else tuple(int(t) for t in item)

    def contains(self, token_ids: Sequence[int], prefix_ids: Sequence[int] | None = None) -> bool:
        prefix = self.prefix_ids if prefix_ids is None else tuple(prefix_ids)
        return (tuple(token_ids), prefix) in self._chunks

    def warm(self, items: Iterable[str | Sequence[int]], *, show_progress: bool = False) -> WarmSummary:
        summary = WarmSummary()
        todo: list[tuple[int, ...]] = []
        for item in items:
            ids = self._ids(item)
            if not ids:
                continue
            if self.contains(ids) or ids in todo:
                summary.present += 1
            else:
                todo.append(ids)
        bar = tqdm(total=len(todo), desc="precompute chunk KV", unit="chunk", disable=not show_progress)
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start : start + self.batch_size]
            for chunk in self.engine.prefill_chunks(batch, prefix_ids=self.prefix_ids, batch_size=self.batch_size):
                self._chunks[(chunk.token_ids, chunk.prefix_ids)] = chunk
                summary.new += 1
                summary.bytes_written += chunk.nbytes
            bar.update(len(batch))
        bar.close()
        return summary

    def open_source(self, engine: Any, segments: Sequence[StoredSegment]) -> tuple[CachedKVSource, int, int]:
        hits = misses = 0
        chunks: list[ChunkKV] = []
        missing = [s for s in segments if (s.token_ids, s.prefix_ids) not in self._chunks]
        for s in missing:
            if (s.token_ids, s.prefix_ids) not in self._chunks:
                self._chunks[(s.token_ids, s.prefix_ids)] = engine.prefill_chunk(s.token_ids, prefix_ids=s.prefix_ids)
        for s in segments:
            chunks.append(self._chunks[(s.token_ids, s.prefix_ids)])
        misses = len(missing)
        hits = len(segments) - misses
        return InMemoryKVSource(chunks, engine.device, engine.dtype), hits, misses
