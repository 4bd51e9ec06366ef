"""ChunkCache: what the engine and the integrations talk to.

It turns chunks (token ids, optionally behind a conditioning prefix) into store keys,
precomputes and writes chunk KV (:meth:`ChunkCache.warm`), and serves a blend
(``engine.blend(segments, store=chunk_cache)``, :meth:`ChunkCache.open_source`):

1. the manifests of every stored segment are read and checked against the model;
2. chunks without a valid entry are computed fresh, in one batch, and used directly;
   their KV is written back to the store on a background thread, so the answer waits
   only for the computation;
3. the rest is read layer by layer by a :class:`~cacheblend_rag.store.loader.PipelinedKVSource`,
   one layer ahead of the blend;
4. for a CUDA engine, chunks read (and verified) or computed are then kept in host memory
   (:mod:`~cacheblend_rag.store.resident`), and later blends copy them from there without the store.

Failures never fail a request. A damaged entry is logged, counted as ``corrupt``, deleted
and recomputed; a store that cannot be read or written is treated as empty, with a
warning (at most one a minute for the same kind of failure).

Storage dtype (the codec, :mod:`cacheblend_rag.store.format.codec`): ``"auto"`` (the default) stores 16
bits per value. If the model computes in float16 or bfloat16, that dtype is used and storage
is lossless. If it computes in float32, chunks are stored as float16 (3 more bits of mantissa
than bfloat16, so about 8x smaller rounding error), except a chunk with a value beyond
float16's range (|x| > 65504), which is stored as bfloat16 rather than overflow to infinity.
``"float32"`` stores exactly what a float32 model computed, at twice the bytes. ``"int8"`` and
``"int4"`` quantize (about 0.51 and 0.28 of the 16-bit bytes); they are part of the store key,
so they never mix with each other or with the lossless ones. Values are converted to the
compute dtype on load, quantized ones expanded by the pipelined loader.

Authenticated mode: with ``auth_key`` (or ``$CACHEBLEND_STORE_KEY``) every value carries an
HMAC-SHA256 instead of a checksum, and entries without a valid MAC are not used. The key is
never stored; each manifest names it by a key id (:mod:`~cacheblend_rag.store.format.chunk_bytes`), so an entry
under another key (or none, or one where this cache has none) is skipped, counted as
``foreign_key_entries`` and computed fresh, never deleted: only damage this reader can prove is.
Turn it on when writers you do not trust share the store (several applications or tenants on one
Redis, a shared disk).

This module holds the cache itself: its construction, serving a blend, what a failure does, the
background writer and the admin calls. An entry's reads and writes are in
:mod:`~cacheblend_rag.store.chunk_io`, precomputing chunks (:meth:`ChunkCache.warm`) in
:mod:`~cacheblend_rag.store.chunk_warm`.
"""

from __future__ import annotations

import copy

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch

from cacheblend_rag.kv.source import CachedKVSource, InMemoryKVSource
from cacheblend_rag.kv.segments import ChunkKV, StoredSegment
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import KVStore, StoreStats
from cacheblend_rag.store.chunk_io import ChunkStoreIO
from cacheblend_rag.store.chunk_warm import ChunkWarming, WarmSummary
from cacheblend_rag.store.format.codec import DEFAULT_GROUP, Codec, PackedLayer, codec_for_name, codec_named
from cacheblend_rag.store.format.entries import EntryRules, MissingLayerError
from cacheblend_rag.store.errors import CorruptEntryError, StoreError
from cacheblend_rag.store.factory import open_store
from cacheblend_rag.store.format.chunk_bytes import ForeignKeyEntryError, Manifest, Tagger, UnauthenticatedReaderError
from cacheblend_rag.store.loader import PipelinedKVSource, PlannedChunk
from cacheblend_rag.store.backends.memory_budget import default_write_back_bytes
from cacheblend_rag.store.resident import ResidentChunks, resident_budget
from cacheblend_rag.store.store_key import STORE_KEY_ENV, require_store_key, store_key, warn_if_keyless
from cacheblend_rag.store.urls import redact

logger = logging.getLogger(__name__)

_WARN_INTERVAL_S = 60.0


class ChunkCache(ChunkWarming, ChunkStoreIO):
    """Chunk KV in a :class:`KVStore` for one engine.

    ``store`` is a :class:`KVStore` or a spec for :func:`open_store` (``None``: a memory store,
    bounded by default: :mod:`~cacheblend_rag.store.backends.memory_budget`). ``prefix_ids`` is the conditioning prefix :meth:`warm` computes chunks
    behind; a :class:`StoredSegment` names its own prefix. ``storage_dtype`` is ``"auto"``,
    ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"int8"`` or ``"int4"`` (quantized in groups of
    ``storage_group``). ``auth_key`` turns on authenticated mode (module docstring); ``require_key`` refuses
    to open without a key (else a shared store opened without one is warned about once:
    :mod:`~cacheblend_rag.store.store_key`).
    ``prefetch=False`` turns off the layer read-ahead; ``write_back=False`` keeps missed chunks
    out of the store. ``resident_bytes`` bounds the host-memory tier of chunks already read and verified
    (or computed) here, which later blends copy from without touching the store
    (:mod:`~cacheblend_rag.store.resident`; ``None``: 2 GiB for a CUDA engine, 1 GiB on a CPU, at most a
    sixteenth of its memory; 0: off). ``write_back_bytes`` bounds the chunk K/V waiting to be written back
    (``None``: a thirty-second of memory, at most 512 MiB); a chunk beyond it is not written back and is
    counted as ``write_backs_dropped``, so a slow store never blocks a request nor grows the queue.
    """

    def __init__(
        self,
        engine: Any,
        store: KVStore | str | Path | None = None,
        *,
        prefix_ids: Sequence[int] = (),
        batch_size: int = 8,
        storage_dtype: str | torch.dtype = "auto",
        storage_group: int = DEFAULT_GROUP,
        auth_key: bytes | str | None = None,
        prefetch: bool = True,
        write_back: bool = True,
        resident_bytes: int | None = None,
        write_back_bytes: int | None = None,
        require_key: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
        self.codec: Codec | None = codec_named(storage_dtype, storage_group)  # None: "auto"
        key = store_key(auth_key)
        if require_key:
            require_store_key(key is not None, "require_key=True")  # before the store is opened
        self.tagger = Tagger(key)
        self.engine = engine
        self.rules = EntryRules(engine, self.codec if self.codec is not None and self.codec.lossy else None,
                                self.tagger)
        self._owns_store = not isinstance(store, KVStore)
        self.store: KVStore = open_store(store)
        self.store.bind_model(engine.fingerprint, max_value_bytes=self.rules.max_value_bytes)
        warn_if_keyless(self.store, self.tagger.authenticated)
        self.prefix_ids = tuple(int(t) for t in prefix_ids)
        self.batch_size = batch_size
        self.storage_dtype = "auto" if self.codec is None else self.codec.name
        self.prefetch = prefetch
        self.write_back = write_back
        device = torch.device(engine.device)
        budget = resident_budget(resident_bytes, device)
        self.resident = ResidentChunks(budget, pin=device.type == "cuda") if budget else None
        self.closed = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-kv-writer")
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        if write_back_bytes is not None and (isinstance(write_back_bytes, bool) or not isinstance(write_back_bytes, int)
                                             or write_back_bytes < 0):
            raise ConfigError(f"write_back_bytes={write_back_bytes!r} must be a number of bytes (0: no write-back "
                              "queue, every missed chunk is left unwritten), or None for the default bound")
        self.write_back_bytes = default_write_back_bytes() if write_back_bytes is None else write_back_bytes
        # Bytes queued and chunks dropped, under _pending_lock; a dict so that salted views share it.
        self._write_backs = {"queued_bytes": 0, "dropped": 0}
        self._last_warning: dict[str, float] = {}
        self._foreign_key_ids: set[str] = set()  # the key ids warned about; a set so that salted views share it

    def salted(self, salt: str) -> "ChunkCache":
        """This cache under ``salt``: the same store, tier, writer and counters, every chunk keyed apart
        (a request's ``cache_salt``: requests with different salts share no chunk K/V). ``""``: itself."""
        if not salt:
            return self
        view = copy.copy(self)
        view.salt = salt
        return view

    # ------------------------------------------------------------- failures
    def _skip_foreign(self, key: str, exc: ForeignKeyEntryError) -> None:
        """An entry under another store key (or none, or one where this cache has none): someone else's, so not
        used and, not being damage, never deleted; counted, and warned about once per key id."""
        self._submit(self._record, foreign_key_entries=1)  # off the request's path, as the other counts
        if exc.key_id in self._foreign_key_ids:
            logger.debug("KV store entry %s... is under another store key (%s)", key[:12], exc)
            return
        self._foreign_key_ids.add(exc.key_id)
        if isinstance(exc, UnauthenticatedReaderError):
            fix = f"pass the store key (auth_key=, store_key= or ${STORE_KEY_ENV}) to use them"
        else:
            fix = (f"give every reader and writer the same key (auth_key=, store_key= or ${STORE_KEY_ENV}); "
                   "after changing the key, clear the store (cacheblend-rag cache clear) or let the old entries "
                   "expire: they are never replaced")
        logger.warning("KV store %s holds entries that are not under this reader's store key (%s); they are not "
                       "used and not deleted, their chunks are computed fresh (counted as foreign_key_entries): %s",
                       self.store.describe(), exc, fix)

    def _discard(self, key: str, reason: CorruptEntryError | str) -> None:
        """Remove a damaged entry and count it; an entry that lost layers to eviction is removed quietly."""
        evicted = isinstance(reason, MissingLayerError)
        if evicted:
            logger.debug("KV store entry %s... lost layers to eviction (%s); recomputing it", key[:12], reason)
        else:
            self._warn_corrupt(key, str(reason))
        try:
            self.store.delete(key)
            self.store.record(**({"evictions": 1} if evicted else {"corrupt": 1}))
        except (StoreError, OSError) as exc:
            self._warn("write", exc)

    def _warn_corrupt(self, key: str, reason: str) -> None:
        logger.warning("corrupt KV store entry %s... (%s); deleting it, the chunk is recomputed", key[:12], reason)

    def _warn(self, what: str, exc: BaseException) -> None:
        # Keyed by the kind of failure only: a server that went away fails reads and writes
        # alike, and that is one event for the user.
        if getattr(exc, "warned", False):  # the store warned when this began
            logger.debug("KV store %s failed to %s (%s)", self.store.describe(), what, redact(exc))
            return
        if self._due(type(exc).__name__):  # redacted: a store's own message may quote its URL with a password
            logger.warning("KV store %s failed to %s (%s); answering by computing chunk KV fresh",
                           self.store.describe(), what, redact(exc))

    def _due(self, kind: str) -> bool:
        """Whether a warning of ``kind`` may be logged now: at most one a minute of each kind."""
        now = time.monotonic()
        if now - self._last_warning.get(kind, -_WARN_INTERVAL_S) < _WARN_INTERVAL_S:
            return False
        self._last_warning[kind] = now
        return True

    # ---------------------------------------------------------------- reads
    def _keep_stored_resident(self, key: str, manifest: Manifest, read: dict[int, PackedLayer]) -> None:
        """Keep a stored chunk a blend just read in the host-memory tier: the layers it read (checked then)
        copied, the ones it skipped read now (on the writer thread: off the blend's path)."""
        if self.resident is None or key in self.resident:
            return
        exact = codec_for_name(manifest.codec, manifest.group).exact_for(self.engine.dtype)
        capture = self.resident.capture(manifest.num_layers, manifest.layer_shape, self.engine.dtype, exact)
        if capture is None:
            return  # it could never be kept
        for i, packed in read.items():
            capture.add(i, *packed.unpacked(self.engine.dtype if packed.codec.lossy else None))
        missing = capture.missing()
        skipped = self._read_layers(key, manifest, missing)
        if skipped is None:
            return
        for i, (k, v) in zip(missing, skipped):
            capture.add(i, k, v)
        self.resident.put(key, capture.chunk())

    def _keep_computed_resident(self, key: str, chunk: ChunkKV) -> None:
        if self.resident is not None and key not in self.resident:
            kept = self.resident.host_copy(chunk.keys, chunk.values, self.engine.dtype, True)
            if kept is not None:
                self.resident.put(key, kept)

    def open_source(
        self, engine: Any, segments: Sequence[StoredSegment], *, first_layer: int | None = None
    ) -> tuple[CachedKVSource, int, int]:
        """A layer-wise source over ``segments`` (in order), plus the numbers of hits and misses.

        ``first_layer`` is the layer the blend reads first (read ahead before any other);
        by default it is derived from the engine's own config."""
        fingerprint = engine.fingerprint  # once per request: it checks the weights
        keys = [self.key_for(s.token_ids, s.prefix_ids, fingerprint=fingerprint) for s in segments]
        resident = [self.resident.get(key) if self.resident is not None else None for key in keys]
        failed: list[str] = []  # this request's failed manifest reads: its source carries them (store_error)
        unread = iter(self._fetch_manifests([key for key, held in zip(keys, resident) if held is None], failed))
        plans: list[PlannedChunk | None] = []
        missing: list[int] = []
        for i, (segment, key, held) in enumerate(zip(segments, keys, resident)):
            if held is not None:
                plans.append(PlannedChunk(segment, key, resident=held))
                continue
            manifest = self._valid_manifest(key, next(unread), len(segment.token_ids))
            if manifest is None:
                missing.append(i)
                plans.append(None)
            else:
                plans.append(PlannedChunk(segment, key, manifest=manifest))
        fresh = self._compute(engine, [segments[i] for i in missing])
        for i, chunk in zip(missing, fresh):
            plans[i] = PlannedChunk(segments[i], keys[i], fresh=chunk)
            self._submit_write(keys[i], chunk)
        hits, misses = len(segments) - len(missing), len(missing)
        planned = [p for p in plans if p is not None]
        if all(p.fresh is not None for p in planned):
            self._submit(self._record, misses=misses)
            return InMemoryKVSource(fresh, engine.device, engine.dtype, computed=True,
                                    store_error=next(iter(failed), None)), hits, misses
        if first_layer is None:
            first_layer = 0  # the engine passes the layer it reads first; without it, start at the beginning

        def count(load_failures: int, read: list[tuple[PlannedChunk, dict[int, PackedLayer]]]) -> None:
            # Once the blend is done: only then is a hit known to be one.
            self._submit(self._record, hits=hits - load_failures, misses=misses, load_failures=load_failures)
            for plan, layers in read:
                self._submit(self._keep_stored_resident, plan.key, plan.manifest, layers)

        source = PipelinedKVSource(
            self.store, engine, planned, self.rules, prefetch=self.prefetch, keep_layers=self.resident is not None,
            first_layer=first_layer, store_error=next(iter(failed), None),
            on_damaged=self._on_damaged, on_done=count,
        )
        return source, hits, misses

    def _compute(self, engine: Any, segments: Sequence[StoredSegment]) -> list[ChunkKV]:
        """Fresh KV of ``segments``, batched per distinct prefix, in the order given."""
        out: dict[int, ChunkKV] = {}
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(segments):
            by_prefix.setdefault(s.prefix_ids, []).append(i)
        for prefix, indexes in by_prefix.items():
            chunks = engine.prefill_chunks([segments[i].token_ids for i in indexes], prefix_ids=prefix,
                                           batch_size=self.batch_size)
            out.update(zip(indexes, chunks))
        return [out[i] for i in range(len(segments))]

    def _on_damaged(self, chunk: PlannedChunk, reason: CorruptEntryError, fresh: ChunkKV) -> None:
        # Runs on the loader thread; the slow parts go to the writer thread.
        self._submit(self._replace, chunk.key, reason, fresh)

    def _replace(self, key: str, reason: CorruptEntryError, fresh: ChunkKV) -> None:
        self._discard(key, reason)
        if self.write_back:
            self._write_logged(key, fresh)

    # --------------------------------------------------------------- writes
    def _submit_write(self, key: str, chunk: ChunkKV) -> None:
        if self.write_back:
            self._submit_write_back(key, chunk)
        if self.resident is not None:
            self._submit(self._keep_computed_resident, key, chunk)

    def _submit_write_back(self, key: str, chunk: ChunkKV, lossless: bool = False) -> bool:
        """Queue ``chunk``'s write unless the queue already holds ``write_back_bytes`` of K/V (then it is dropped
        and counted: its next request computes it again); whether it was queued."""
        nbytes = sum(t.nelement() * t.element_size() for t in (*chunk.keys, *chunk.values))
        with self._pending_lock:
            queued = self._write_backs["queued_bytes"] + nbytes <= self.write_back_bytes
            if queued:
                self._write_backs["queued_bytes"] += nbytes
            else:
                self._write_backs["dropped"] += 1
        if not queued:
            if self._due("write-back queue full"):
                logger.warning("the write-back queue to KV store %s holds its bound of %d bytes (the store is slower "
                               "than the misses): missed chunks are not written back, and are computed again when "
                               "next needed (counted as write_backs_dropped; write_back_bytes= raises the bound)",
                               self.store.describe(), self.write_back_bytes)
            return False

        def write() -> None:
            try:
                self._write_logged(key, chunk, lossless)
            finally:
                with self._pending_lock:
                    self._write_backs["queued_bytes"] -= nbytes
        self._submit(write)
        return True

    def _submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        future = self._writer.submit(fn, *args, **kwargs)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("background KV store work failed", exc_info=future.exception())

    def flush(self, timeout: float | None = None) -> None:
        """Wait for background write-backs and counter updates to finish."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                return
            for future in pending:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                future.exception(timeout=remaining)

    # --------------------------------------------------------------- admin
    def stats(self) -> StoreStats:
        """The store's stats once background writes are done; never raises (``available=False`` and
        ``error`` say that the store could not be asked). With a host-memory tier, ``details["resident"]``
        holds its entries, bytes held, bound and hits."""
        self.flush()
        try:
            stats = self.store.stats()
        except (StoreError, OSError) as exc:
            stats = StoreStats(available=False, error=str(exc), details={"store": self.store.describe()})
        if self.resident is not None:  # the host-memory tier; its hits are also among the store's ``hits``
            stats.details["resident"] = self.resident.stats()
        with self._pending_lock:
            stats.write_backs_dropped = self._write_backs["dropped"]
        return stats

    def close(self) -> None:
        """Finish background writes; close the store if this cache opened it from a spec."""
        self.closed = True
        self.flush()
        self._writer.shutdown(wait=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "ChunkCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        auth = ", authenticated" if self.tagger.authenticated else ""
        return f"ChunkCache({self.store.describe()}, storage_dtype={self.codec or 'auto'!r}{auth})"


__all__ = ["ChunkCache", "WarmSummary"]
