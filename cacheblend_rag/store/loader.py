"""Layer-pipelined loading of stored chunk KV into a blend.

The engine asks a :class:`CachedKVSource` for layer ``l`` of all cached tokens exactly when
it needs it, in increasing ``l``. :class:`PipelinedKVSource` uses that order: while layer
``l`` computes, one background thread already reads layer ``l + 1`` of every chunk from the
store, checks it (:class:`~cacheblend_rag.store.entries.EntryRules`) and decodes it. A
quantized layer (int8, int4) is expanded here, off the blend's critical path: on a CPU into
the compute dtype; on CUDA the compact bytes of every chunk's layer are staged in one pinned
buffer, copied at once on a side stream and expanded on the device there, and the engine's
stream waits on an event instead of the whole device.

A chunk whose layer turns out missing or damaged in the middle of a blend cannot be
re-fetched: the blend has already used its earlier layers. Those layers passed their
checksums, so they are right; the loader recomputes the chunk (``engine.prefill_chunk``)
and serves this and every later layer from the fresh KV. The answer stays correct and
the damaged entry is deleted, counted and written anew (see ``ChunkCache``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cacheblend_rag.kv.source import CachedKVSource
from cacheblend_rag.kv.segments import ChunkKV, StoredSegment
from cacheblend_rag.store.backends.base import KVStore
from cacheblend_rag.store.format.codec import PackedLayer, codec_for_name, staged
from cacheblend_rag.store.format.entries import EntryRules, MissingLayerError
from cacheblend_rag.store.errors import CorruptEntryError, StoreError, read_failure
from cacheblend_rag.store.format.chunk_bytes import Manifest
from cacheblend_rag.store.resident import ResidentChunk

logger = logging.getLogger(__name__)

_read_ahead = threading.local()


def _read_ahead_thread() -> ThreadPoolExecutor:
    """The read-ahead thread of the calling thread (an engine's scheduler worker), started on its first blend
    and kept for its life: one started per blend cost a thread start every request, and each new thread
    opened its own SQLite connection to a disk store (a soak saw open files drift by 30 in two minutes).
    Blends on one thread run one at a time, so they never wait on each other's reads. A forked child
    starts its own: its parent's thread does not exist there."""
    pid = os.getpid()
    if getattr(_read_ahead, "pid", None) != pid:
        _read_ahead.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-kv-loader")
        _read_ahead.pid = pid
    return _read_ahead.executor


@dataclass
class PlannedChunk:
    """One chunk of the prompt: read from the store (``manifest``), already computed (``fresh``), or
    verified earlier and kept in host memory (``resident``)."""

    segment: StoredSegment
    key: str
    manifest: Manifest | None = None
    fresh: ChunkKV | None = None
    resident: ResidentChunk | None = None
    damaged: str | None = field(default=None)  # why the stored copy was abandoned mid-load

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.manifest, self.fresh, self.resident)) != 1:
            raise ValueError("a planned chunk needs exactly one of manifest (stored), fresh (computed) "
                             "or resident (kept in host memory)")

    @property
    def stored(self) -> bool:
        """Still to be read from the store (not computed, not resident)."""
        return self.fresh is None and self.resident is None


# Called with (chunk, what was wrong, fresh ChunkKV) when a stored chunk had to be recomputed mid-load.
DamageHandler = Callable[[PlannedChunk, CorruptEntryError, ChunkKV], None]
# Called once when the blend is done, with the number of stored chunks that had to be recomputed and (with
# ``keep_layers``) each stored chunk read without damage, with the checked layers read of it.
DoneHandler = Callable[[int, list[tuple["PlannedChunk", dict[int, PackedLayer]]]], None]


class PipelinedKVSource(CachedKVSource):
    """Layer ``l`` of the planned chunks, concatenated in order, with layer ``l + 1`` read ahead.

    ``prefetch=False`` reads each layer only when asked (the baseline the benchmark compares
    against). ``first_layer`` is the layer the blend will ask for first (its check layer, or 0
    for full reuse); reading starts there as soon as the source is made. With ``keep_layers``
    every stored layer read and checked is also kept (a reference to the bytes read, no copy)
    and handed to ``on_done``, for the host-memory tier.
    """

    def __init__(
        self,
        store: KVStore,
        engine: Any,
        chunks: Sequence[PlannedChunk],
        rules: EntryRules,
        *,
        prefetch: bool = True,
        first_layer: int = 0,
        depth: int = 1,
        on_damaged: DamageHandler | None = None,
        on_done: DoneHandler | None = None,
        keep_layers: bool = False,
        store_error: str | None = None,
    ) -> None:
        self.store = store
        self.store_error = store_error  # open_source's failed manifest read; a failed layer read sets it too
        self.engine = engine
        self.rules = rules
        self.chunks = list(chunks)
        self.prefetch = prefetch
        self.depth = max(1, depth)
        self.on_damaged = on_damaged
        self.on_done = on_done
        self.keep_layers = keep_layers
        self._kept: dict[int, dict[int, PackedLayer]] = {}  # id(chunk) -> layer -> what was read and checked
        self.device = torch.device(engine.device)
        self.dtype = engine.dtype
        self.num_layers = engine.num_layers
        self.wait_seconds = 0.0
        self.recompute_seconds = 0.0  # spent computing chunks whose stored copy could not be read
        self.bytes_read = 0
        self._futures: dict[int, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._fresh_ready = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._fresh_ready = self._mark_fresh_ready()
        if prefetch and any(c.stored for c in self.chunks):
            self._executor = _read_ahead_thread()
            self._schedule(first_layer)

    # ------------------------------------------------------------ engine side
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._parts(index)
        k = torch.cat([t.to(self.dtype) for t in keys], dim=1) if len(keys) > 1 else keys[0].to(self.dtype)
        v = torch.cat([t.to(self.dtype) for t in values], dim=1) if len(values) > 1 else values[0].to(self.dtype)
        return k, v

    def layer_parts(self, index: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk, without concatenating. On a CPU the parts stay in their storage dtype, over
        the bytes read: the engine converts them while rotating them into its cache, so each
        layer is copied once instead of three times (private copy, dtype conversion, concatenation)."""
        keys, values = self._parts(index)
        return list(zip(keys, values))

    def _parts(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} is out of range for a model with {self.num_layers} layers")
        start = time.perf_counter()
        if self._executor is None:
            keys, values, event = self._load(index)
        else:
            for stale in [i for i in self._futures if i < index]:
                self._futures.pop(stale).cancel()  # read ahead but never asked for
            self._schedule(index)
            future = self._futures.pop(index)
            for ahead in range(index + 1, min(index + 1 + self.depth, self.num_layers)):
                self._schedule(ahead)
            keys, values, event = future.result()
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in (*keys, *values):
                t.record_stream(current)
        self.wait_seconds += time.perf_counter() - start
        return keys, values

    def lossless(self) -> list[bool]:
        # Fresh chunks are what the engine computed; stored ones are exact only in a codec that keeps
        # the compute dtype's values (a float32 model's KV stored at 16 bits is not).
        return [c.fresh is not None or (c.resident.exact if c.resident is not None else
                                        codec_for_name(c.manifest.codec, c.manifest.group).exact_for(self.dtype))
                for c in self.chunks]

    @property
    def load_failures(self) -> int:
        return sum(c.manifest is not None and c.fresh is not None for c in self.chunks)

    @property
    def computed_tokens(self) -> int:
        return sum(len(c.segment.token_ids) for c in self.chunks if c.fresh is not None)

    @property
    def memory_hits(self) -> int:
        # Counted from the plan open_source made: a resident chunk is copied from host memory and never
        # fails mid-read (it was verified when kept), so every one planned is a hit.
        return sum(c.resident is not None for c in self.chunks)

    def close(self) -> None:
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            # Copies: a read-ahead still in flight may add a layer while the writer thread reads these.
            kept = [(c, dict(self._kept[id(c)])) for c in self.chunks
                    if c.manifest is not None and c.fresh is None and id(c) in self._kept]
            done(self.load_failures, kept)
        if self._executor is not None:
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._executor = None  # the thread stays, for this thread's next blend

    def _mark_fresh_ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ------------------------------------------------------------ loader side
    def _schedule(self, index: int) -> None:
        if self._executor is not None and index not in self._futures and 0 <= index < self.num_layers:
            self._futures[index] = self._executor.submit(self._load, index)

    def _load(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """Layer ``index`` of every chunk, on the engine's device (in its dtype on CUDA; a float codec
        as stored on a CPU, where the engine converts while rotating). Runs on the loader thread."""
        stored = [c for c in self.chunks if c.stored]
        blobs = self._fetch(stored, index)
        decoded: dict[int, PackedLayer] = {}
        unusable: list[tuple[PlannedChunk, CorruptEntryError]] = []
        for chunk, blob in zip(stored, blobs):
            if chunk.fresh is not None:
                continue
            try:
                if isinstance(blob, CorruptEntryError):
                    raise blob
                self.bytes_read += len(blob) if isinstance(blob, (bytes, bytearray, memoryview)) else 0
                decoded[id(chunk)] = self.rules.layer(blob, chunk.manifest, index)
            except CorruptEntryError as exc:
                unusable.append((chunk, exc))
        if unusable:  # in one batch: keys flushed or evicted mid-read take every chunk at once
            self._recompute(unusable, index, damaged=True)
        if self.keep_layers:
            for chunk in stored:
                if chunk.fresh is None:
                    self._kept.setdefault(id(chunk), {})[index] = decoded[id(chunk)]
        layers: list[PackedLayer | tuple[torch.Tensor, torch.Tensor]] = []
        for chunk in self.chunks:
            if chunk.fresh is not None:
                layers.append((chunk.fresh.keys[index], chunk.fresh.values[index]))
            elif chunk.resident is not None:
                layers.append((chunk.resident.keys[index], chunk.resident.values[index]))
            else:
                layers.append(decoded[id(chunk)])
        return self._to_device(layers)

    def _fetch(self, stored: list[PlannedChunk], index: int) -> list[bytes | CorruptEntryError | None]:
        """Layer ``index`` of each stored chunk. A failing store recomputes them all (that is not damage)."""
        if not stored:
            return []
        requests = [(c.key, c.manifest.write_id, index) for c in stored]
        try:
            return list(self.store.get_layers(requests))
        except CorruptEntryError:
            pass  # the backend refused to load one value (say, a planted pickle); find out which
        except (StoreError, OSError) as exc:
            # One warning for the whole read, not one per chunk (none if the store warned already).
            log = logger.info if getattr(exc, "warned", False) else logger.warning
            log("KV store failed to read layer %d (%s); recomputing %d stored chunks", index, exc, len(stored))
            self.store_error = self.store_error or read_failure(exc, self.store)  # this request's own source
            self._recompute_all(stored)
            return [None] * len(stored)
        out: list[bytes | CorruptEntryError | None] = []
        failed: list[tuple[PlannedChunk, str]] = []
        for chunk, request in zip(stored, requests):
            try:
                out.append(self.store.get_layer(*request))
            except CorruptEntryError as exc:
                out.append(exc)
            except (StoreError, OSError) as exc:
                failed.append((chunk, str(exc)))
                self.store_error = self.store_error or read_failure(exc, self.store)
                out.append(None)
        if failed:
            self._recompute(failed, index, damaged=False)
        return out

    def _recompute_all(self, chunks: list[PlannedChunk]) -> None:
        """Fresh KV for ``chunks`` in one batch per prefix (the store failed; nothing is damaged)."""
        started = time.perf_counter()
        by_prefix: dict[tuple[int, ...], list[PlannedChunk]] = {}
        for chunk in chunks:
            by_prefix.setdefault(chunk.segment.prefix_ids, []).append(chunk)
        for prefix, group in by_prefix.items():
            fresh = self.engine.prefill_chunks([c.segment.token_ids for c in group], prefix_ids=prefix)
            for chunk, kv in zip(group, fresh):
                chunk.fresh = kv
        if self._stream is not None:
            self._fresh_ready = self._mark_fresh_ready()
        self.recompute_seconds += time.perf_counter() - started

    def _recompute(self, unusable: list[tuple[PlannedChunk, CorruptEntryError | str]], index: int, *,
                   damaged: bool) -> None:
        """Recompute chunks whose stored copy failed at layer ``index``; damaged ones are reported."""
        for chunk, reason in unusable:
            log = logger.debug if isinstance(reason, MissingLayerError) else logger.warning
            log("stored KV of chunk %s... unusable at layer %d (%s); recomputing it", chunk.key[:12], index, reason)
        self._recompute_all([chunk for chunk, _ in unusable])
        for chunk, reason in unusable:
            chunk.damaged = str(reason) if damaged else None
            if self.on_damaged is not None and damaged:
                self.on_damaged(chunk, reason if isinstance(reason, CorruptEntryError) else CorruptEntryError(reason),
                                chunk.fresh)

    def _to_device(
        self, layers: list[PackedLayer | tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """K and V of each chunk's layer on the engine's device. ``layers`` holds a stored chunk's
        :class:`PackedLayer`, or a fresh chunk's (K, V) on the device or a resident one's in host memory."""
        if self._stream is None:
            keys, values = [], []
            for layer in layers:
                if isinstance(layer, PackedLayer):
                    # A float codec stays as stored (the engine converts while rotating); a quantized
                    # one is expanded here, on this thread, into the compute dtype.
                    layer = layer.unpacked(self.dtype if layer.codec.lossy else None)
                keys.append(layer[0].to(self.device))
                values.append(layer[1].to(self.device))
            return keys, values, None
        # CUDA: copy the stored bytes (16 bits, or 8 or 4 and their scales) from pinned memory on a
        # side stream and expand or convert on the device. Freshly computed chunks are already
        # there; the side stream waits for exactly their kernels (an event), never for the blend's
        # own work, or the overlap would be lost. Resident chunks are copied from page-locked memory.
        if any(not isinstance(layer, PackedLayer) for layer in layers):
            self._stream.wait_event(self._fresh_ready)
        keys, values = [], []
        with torch.cuda.stream(self._stream):
            packed = [layer for layer in layers if isinstance(layer, PackedLayer)]
            moved = iter(staged(packed, self.device, pin=True) if packed else [])
            for layer in layers:
                if isinstance(layer, PackedLayer):
                    layer = next(moved).unpacked(self.dtype)
                keys.append(layer[0].to(self.device, self.dtype, non_blocking=True))
                values.append(layer[1].to(self.device, self.dtype, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        return keys, values, event
