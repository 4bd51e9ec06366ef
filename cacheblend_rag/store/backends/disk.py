"""DiskKVStore: chunk KV in a local directory, on diskcache (SQLite index + one file per large value).

diskcache gives process-safe, atomic reads and writes: several processes may warm and read
the same directory at once. Two things are done here instead of by diskcache:

* **Eviction is per chunk.** diskcache would evict single values, leaving chunks with holes;
  this store evicts the oldest whole chunks (manifest first, then its layers, found by tag)
  once the volume passes ``size_limit``, and counts each eviction.
* **Nothing is ever unpickled.** Only ``bytes`` are stored, and a custom ``Disk`` refuses to
  load a pickled value that some other program may have put in the directory.

The SQLite index is not trusted either: whoever can write it could name any file. A value file
is read or deleted only if its name is one diskcache makes (``ab/cd/<28 hex>.val``) and it lies
inside the store directory, and read only if it is no larger than the model's largest layer
value; anything else is a corrupt entry, and no file outside the directory is ever touched.

A damaged index (SQLite reports corrupt pages, or the file is not a database) is moved aside and
the store starts empty, with one warning, so a restarting replica always has a store; value
files no index names any more are removed. A file system that cannot take writes is not a
damaged index: on a full disk, a read-only file system or a folder that is not writable, the store
opens *read-mostly* (its entries are read, through a read-only connection if need be; writes
are skipped and counted, with one warning) and tries writing again every ``retry_writes_after``
seconds, so it recovers by itself once there is room. Nothing healthy is moved aside or deleted
for it, and a failed write leaves no value file behind. A store folder removed (or replaced) while
the store is open is noticed and opened anew rather than written into a deleted index.

Counters (hits, misses, load failures, evictions, corrupt) live in a small second cache,
``<path>/counters``, so every process adds to the same totals and ``cacheblend-rag cache stats``
can show them; counts that cannot be written while writes are skipped are kept and written later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import diskcache

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import COUNTERS, KVStore, StoreStats
from cacheblend_rag.store.backends.disk_index import (
    INDEX_FILES,
    PRIVATE_FOLDER,
    VALUE_FILE,
    BytesOnlyDisk,
    ReadOnlyIndex,
    TrackedCache,
    is_damage,
    private_index,
    write_trouble,
)
from cacheblend_rag.store.errors import CorruptEntryError, StoreError

logger = logging.getLogger(__name__)

_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
# diskcache's own size limit is disabled; this store enforces ``size_limit`` chunk by chunk.
_NO_LIMIT = 2**62
# Layer values above this size go to their own files, whose space is returned when they are
# evicted; values inside SQLite leave free pages behind and the database file never shrinks.
_MIN_FILE_SIZE = 4096
# Reads look whether the store folder was removed at most this often (writes look every time).
_FOLDER_CHECK_S = 1.0

Index = Any  # a TrackedCache, or a ReadOnlyIndex while the file system takes no writes


def _manifest_name(key: str) -> str:
    return f"m:{key}"


def _layer_name(key: str, write_id: str, layer: int) -> str:
    return f"l:{key}:{write_id}:{layer}"


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _warn_if_others_can_read(path: Path) -> None:
    """A store folder made before folders were private (or by hand) is left as it is, with a warning if every
    user of the machine may look into it: its layer-0 K/V gives the chunks' text back."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o007:
        logger.warning("the disk KV store folder %s has mode %o: other users of this machine can read it, and its "
                       "chunk K/V gives the documents' text back; run `chmod -R go-rwx %s` (new stores are made "
                       "0o700, their files 0o600)", path, mode, path)


class WritesSkippedError(StoreError):
    """The store takes no writes for now (read-mostly); it warned once when that began."""

    warned = True


class DiskKVStore(KVStore):
    """Chunk KV under ``path``; at most about ``size_limit`` bytes (``None``: unbounded).

    The limit is enforced after each chunk is written, so the volume can pass it by at most
    the chunks being written at that moment. ``timeout`` bounds the wait for another process's
    write lock; ``retry_writes_after`` is how often a read-mostly store tries writing again.
    """

    def __init__(self, path: str | Path, *, size_limit: int | None = None, timeout: float = 60.0,
                 retry_writes_after: float = 5.0) -> None:
        super().__init__()
        if size_limit is not None and (isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit < 1):
            raise ConfigError(f"size_limit={size_limit!r} must be a positive number of bytes, or None for no limit")
        if isinstance(retry_writes_after, bool) or not isinstance(retry_writes_after, (int, float)) \
                or not retry_writes_after > 0:
            raise ConfigError(f"retry_writes_after={retry_writes_after!r} must be a positive number of seconds")
        self.path = Path(path).expanduser()
        self.size_limit = size_limit
        self.retry_writes_after = float(retry_writes_after)
        self._timeout = timeout
        self._state_lock = threading.RLock()
        self._skipping: str | None = None  # why writes are skipped, while they are
        self._retry_writes_at = 0.0
        self._writes_skipped = 0
        self._unsaved: dict[str, int] = {}  # counts not yet in the counters index
        self._unfinished: list[tuple[str, str, int]] = []  # layers of failed writes, removed once writes work
        self._folder_checked_at = 0.0
        try:
            existed = self.path.is_dir()
            self.path.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot open the disk KV store at {self.path}: {exc}. Check that the directory can be "
                             "created and written, or pass another path") from exc
        if existed:
            _warn_if_others_can_read(self.path)
        self._cache, self._counter_cache = self._open_indexes()

    # ------------------------------------------------------------- opening
    def _open_indexes(self) -> tuple[Index, Index]:
        entries = self._open_index(self.path, tag_index=True, disk_min_file_size=_MIN_FILE_SIZE)
        entries.disk.max_value_bytes = self.max_value_bytes
        counters = self._open_index(self.path / "counters")
        self._index_id = _identity(self.path / "cache.db")
        for index in (entries, counters):
            if isinstance(index, ReadOnlyIndex):
                self._skip_writes(index.why, index.cause)
        return entries, counters

    def _open_entries(self) -> TrackedCache:
        """A writable index of the chunks' manifests and layers (raises when it cannot be had)."""
        cache = self._writable_index(self.path, tag_index=True, disk_min_file_size=_MIN_FILE_SIZE)
        cache.disk.max_value_bytes = self.max_value_bytes
        return cache

    def _writable_index(self, folder: Path, **settings: Any) -> TrackedCache:
        private_index(folder)
        return TrackedCache(str(folder), disk=BytesOnlyDisk, size_limit=_NO_LIMIT, eviction_policy="none",
                            statistics=False, timeout=self._timeout, **settings)

    def _open_index(self, folder: Path, **settings: Any) -> Index:
        """A diskcache on ``folder``. A damaged index is moved aside and started anew; one the file system
        will not let be written is opened read-only, its entries intact."""
        try:
            cache = self._writable_index(folder, **settings)
            if next(cache.iterkeys(), None) is None:  # reads the Cache table: a damaged index fails here
                self._reclaim_orphans(folder)  # an empty index (a deleted cache.db, say) names no value file
            return cache
        except _IO_ERRORS as exc:
            if not is_damage(exc):
                return self._read_only_index(folder, exc)
            logger.warning("the disk KV store's index %s is damaged (%s: %s); it is moved aside and the store "
                           "starts empty (its chunks are computed again)", folder / "cache.db", type(exc).__name__, exc)
        self._move_index_aside(folder)
        try:
            cache = self._writable_index(folder, **settings)
        except _IO_ERRORS as exc:
            return self._read_only_index(folder, exc)
        self._reclaim_orphans(folder)
        return cache

    def _read_only_index(self, folder: Path, cause: BaseException) -> ReadOnlyIndex:
        disk = BytesOnlyDisk(str(folder))
        try:
            index = ReadOnlyIndex(folder, disk)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the disk KV store at {folder}: {cause}, and reading it failed too: {exc}. "
                             "Check free space and permissions of the directory") from exc
        index.why, index.cause = write_trouble(folder, cause), cause
        return index

    @staticmethod
    def _move_index_aside(folder: Path) -> None:
        aside = f"cache.db.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for name in INDEX_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder / name, folder / (aside + name[len("cache.db"):]))

    @staticmethod
    def _reclaim_orphans(folder: Path) -> None:
        """Delete the value files of an index that is gone: nothing names them any more."""
        removed = 0
        for file in folder.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val"):
            if VALUE_FILE.fullmatch(file.relative_to(folder).as_posix()) and not file.is_symlink():
                with contextlib.suppress(OSError):
                    file.unlink()
                    removed += 1
        if removed:
            logger.warning("removed %d value files of the old index of %s", removed, folder)

    def _check_folder(self, *, now: bool = False) -> None:
        """Open the store anew if its index was removed or replaced since it was opened (``rm -r`` of the
        folder, or another process that moved a damaged index aside): never write into a deleted index."""
        clock = time.monotonic()
        if not now and clock - self._folder_checked_at < _FOLDER_CHECK_S:
            return
        self._folder_checked_at = clock
        if _identity(self.path / "cache.db") == self._index_id:
            return
        with self._state_lock:
            if _identity(self.path / "cache.db") == self._index_id:
                return
            logger.warning("the disk KV store's index %s was removed or replaced while the store was open; "
                           "opening the store anew there", self.path / "cache.db")
            old = (self._cache, self._counter_cache)
            with contextlib.suppress(OSError):
                self.path.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
            self._cache, self._counter_cache = self._open_indexes()
            self._unfinished.clear()  # their index is gone
        for index in old:
            with contextlib.suppress(*_IO_ERRORS):
                index.close()

    # --------------------------------------------------------- read-mostly
    def _skip_writes(self, why: str, cause: BaseException | None = None) -> None:
        with self._state_lock:
            first = self._skipping is None
            self._skipping = why
            self._retry_writes_at = time.monotonic() + self.retry_writes_after
        if first:
            logger.warning("the disk KV store at %s takes no writes (%s%s); it is read-mostly: its entries are read, "
                           "new chunks are computed but not stored, and writing is tried again every %gs",
                           self.path, why, "" if cause is None else f": {type(cause).__name__}: {cause}",
                           self.retry_writes_after)

    def _writable(self, what: str, *, chunk_write: bool = False, deleting: bool = False) -> None:
        """Return if writes may be tried now; raise :class:`WritesSkippedError` while they are skipped.
        Deletes are always tried: they free space, and on a file system that is full they often work."""
        self._check_folder(now=True)
        with self._state_lock:
            if self._skipping is None or deleting and not isinstance(self._cache, ReadOnlyIndex):
                return
            if time.monotonic() < self._retry_writes_at:
                self._writes_skipped += chunk_write
                raise WritesSkippedError(f"disk KV store at {self.path}: cannot {what} ({self._skipping}); "
                                         "writes are skipped for now")
            self._retry_writes_at = time.monotonic() + self.retry_writes_after  # one thread tries at a time
            if isinstance(self._cache, ReadOnlyIndex) or isinstance(self._counter_cache, ReadOnlyIndex):
                self._reopen_writable(what)

    def _reopen_writable(self, what: str) -> None:
        try:
            entries = self._open_entries()
            counters = self._writable_index(self.path / "counters")
        except _IO_ERRORS as exc:
            self._skip_writes(write_trouble(self.path, exc), exc)
            raise WritesSkippedError(f"disk KV store at {self.path}: cannot {what} ({self._skipping})") from exc
        old = (self._cache, self._counter_cache)
        self._cache, self._counter_cache = entries, counters
        self._index_id = _identity(self.path / "cache.db")
        for index in old:
            index.close()

    @contextlib.contextmanager
    def _writing(self, what: str, *, chunk_write: bool = False, deleting: bool = False) -> Iterator[None]:
        """A write: skipped while the store is read-mostly; a failure that is not damage makes it so."""
        self._writable(what, chunk_write=chunk_write, deleting=deleting)
        try:
            yield
        except _IO_ERRORS as exc:
            if isinstance(exc, StoreError):
                raise
            if not is_damage(exc):
                self._skip_writes(write_trouble(self.path, exc), exc)
            error = StoreError(f"disk KV store at {self.path}: cannot {what}: {exc}")
            error.warned = not is_damage(exc)
            raise error from exc
        if self._skipping is not None and not deleting:
            self._writes_work_again()

    def _writes_work_again(self) -> None:
        with self._state_lock:
            if self._skipping is None:
                return
            logger.warning("the disk KV store at %s takes writes again (it could not: %s)", self.path, self._skipping)
            self._skipping = None
            unfinished, self._unfinished = self._unfinished, []
        for key, write_id, num_layers in unfinished:
            with contextlib.suppress(StoreError):
                self.delete_layers(key, write_id, num_layers)
        with contextlib.suppress(StoreError):
            self.record()  # the counts kept meanwhile

    def _set(self, name: str, data: bytes, tag: str) -> None:
        try:
            self._cache.set(name, data, tag=tag, retry=False)
        except BaseException:
            self._cache.disk.discard_uncommitted()  # a value file whose row was never committed
            raise
        self._cache.disk.discard_uncommitted(committed=True)

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except _IO_ERRORS as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"disk KV store at {self.path}: cannot {what}: {exc}") from exc

    def _reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        self._check_folder()
        return self._io(what)

    # ------------------------------------------------------------ layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        with self._reading("read a layer"):
            return self._cache.get(_layer_name(key, write_id, layer), default=None, retry=True)

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        with self._writing("write a layer", chunk_write=layer == 0):
            self._set(_layer_name(key, write_id, layer), bytes(data), key)

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        if num_layers < 1:
            return
        try:
            with self._writing("delete layers", deleting=True):
                for layer in range(num_layers):
                    self._cache.delete(_layer_name(key, write_id, layer), retry=False)
        except StoreError:
            # Never read (no manifest names them); removed once writes work again.
            with self._state_lock:
                self._unfinished.append((key, write_id, num_layers))
            raise

    # --------------------------------------------------------- manifests
    def get_manifest(self, key: str) -> bytes | None:
        return self.get_manifests([key])[0]

    def get_manifests(self, keys: Sequence[str]) -> list[bytes | None]:
        self._check_folder(now=True)  # once per request: a removed folder is not read as a full store
        with self._io("read a manifest"):
            return [self._cache.get(_manifest_name(key), default=None, retry=True) for key in keys]

    def add_manifest(self, key: str, data: bytes) -> bool:
        with self._writing("write a manifest", chunk_write=True):
            added = self._cache.add(_manifest_name(key), bytes(data), tag=key, retry=False)
        if added:
            try:
                self._evict_to_limit()
            except StoreError as exc:  # the chunk is stored; the store is over its limit until a later write
                logger.debug("could not evict in %s: %s", self.path, exc)
        return added

    def contains(self, key: str) -> bool:
        with self._reading("look up a manifest"):
            return _manifest_name(key) in self._cache

    def delete(self, key: str) -> bool:
        with self._writing("delete a chunk", deleting=True):
            removed = self._cache.delete(_manifest_name(key), retry=False)
            self._cache.evict(key, retry=False)  # every value tagged with the key: all writes' layers
        return removed

    def keys(self) -> Iterator[str]:
        with self._reading("list keys"):
            names = list(self._cache.iterkeys())
        return (name[2:] for name in names if isinstance(name, str) and name.startswith("m:"))

    # ----------------------------------------------------------- eviction
    def volume(self) -> int:
        with self._reading("measure its size"):
            return self._cache.volume()

    def _evict_to_limit(self) -> None:
        if self.size_limit is None:
            return
        with self._writing("evict"):
            while self._cache.volume() > self.size_limit:
                try:
                    (name, _), tag = self._cache.peekitem(last=False, tag=True, retry=True)
                except KeyError:
                    return  # empty: what is left is SQLite's own pages
                except CorruptEntryError as exc:
                    # A row another program wrote (a pickle, say) must not stop eviction for good.
                    logger.warning("evicting an entry the store cannot read (%s)", exc)
                    self._drop_oldest_row()
                    self.record(corrupt=1)
                    continue
                if not isinstance(name, str):
                    self._drop_oldest_row()  # a key written by another program: never unpickled
                elif tag:
                    if self.delete(tag):
                        self.record(evictions=1)
                else:
                    self._cache.delete(name, retry=False)

    def _drop_oldest_row(self) -> None:
        """Delete the oldest row of the index, whatever its key and value, by its row id.

        This is the one place that writes SQL to diskcache's index (its ``Cache`` table and row ids,
        stable since diskcache 4): a row whose key or value cannot be loaded has no other handle."""
        with self._cache.transact(retry=False):
            rows = self._cache._sql("SELECT rowid, filename FROM Cache ORDER BY rowid LIMIT 1").fetchall()
            if rows:
                self._cache._sql("DELETE FROM Cache WHERE rowid = ?", (rows[0][0],))
        if rows and rows[0][1]:
            self._cache.disk.remove(rows[0][1])  # only a value file of this store (checked)

    def bind_model(self, fingerprint: str, *, max_value_bytes: int | None = None) -> None:
        super().bind_model(fingerprint, max_value_bytes=max_value_bytes)
        self._cache.disk.max_value_bytes = self.max_value_bytes

    # ------------------------------------------------------------- admin
    def record(self, **counts: int) -> None:
        """Add to the shared counters; while writes are skipped the counts are kept and written later."""
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known counters are {COUNTERS}")
        with self._state_lock:
            for name, n in counts.items():
                if n:
                    self._unsaved[name] = self._unsaved.get(name, 0) + int(n)
            if not self._unsaved or (self._skipping is not None and time.monotonic() < self._retry_writes_at):
                return
        try:
            with self._writing("update its counters"):
                for name in list(self._unsaved):
                    with self._state_lock:
                        n = self._unsaved.pop(name, 0)
                    try:
                        self._counter_cache.incr(name, n, default=0, retry=False)
                    except BaseException:
                        with self._state_lock:
                            self._unsaved[name] = self._unsaved.get(name, 0) + n
                        raise
        except StoreError as exc:
            if not exc.warned:
                raise  # else kept in memory; the store warned when it began skipping writes

    def counters(self) -> dict[str, int]:
        with self._reading("read its counters"):
            stored = {name: int(self._counter_cache.get(name, default=0, retry=True)) for name in COUNTERS}
        with self._state_lock:
            return {name: stored[name] + self._unsaved.get(name, 0) for name in COUNTERS}

    def reset_counters(self) -> None:
        with self._state_lock:
            self._unsaved.clear()
        with self._writing("reset its counters"):
            self._counter_cache.clear(retry=False)

    def stats(self) -> StoreStats:
        """Entries, bytes and counters; never raises (a store that cannot be read says so in ``error``)."""
        details = {"path": str(self.path), "size_limit": self.size_limit,
                   "writes": "ok" if self._skipping is None else f"skipped: {self._skipping}"}
        try:
            entries = sum(1 for _ in self.keys())
            return StoreStats(entries=entries, bytes=self.volume(), **self.counters(),
                              writes_skipped=self._writes_skipped, details=details)
        except StoreError as exc:
            with self._state_lock:
                kept = {name: self._unsaved.get(name, 0) for name in COUNTERS}
            return StoreStats(**kept, available=False, error=str(exc), writes_skipped=self._writes_skipped,
                              details=details)

    def clear(self) -> None:
        """Remove every entry and reset the counters. An index too damaged to clear is replaced by an
        empty one (and its value files removed), so clearing a damaged store always works; a store on a
        file system that takes no writes raises :class:`StoreError` and keeps its entries."""
        try:
            with self._writing("clear"):
                self._cache.clear(retry=False)
        except StoreError as exc:
            if exc.__cause__ is None or not is_damage(exc.__cause__):
                raise
            logger.warning("could not clear %s entry by entry (%s); starting it empty instead", self.path, exc)
            self._cache.close()
            self._move_index_aside(self.path)
            self._cache = self._open_entries()  # empty, so its orphaned value files are reclaimed
            self._reclaim_orphans(self.path)
            self._index_id = _identity(self.path / "cache.db")
        self.reset_counters()

    def close(self) -> None:
        """Close every SQLite connection of the store, those of other threads too."""
        self._cache.close()
        self._counter_cache.close()

    def describe(self) -> str:
        limit = "" if self.size_limit is None else f", size_limit={self.size_limit}"
        return f"DiskKVStore({str(self.path)!r}{limit})"
