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
value; anything else is a corrupt entry, and no file outside the directory is ever touched. An
index that cannot be opened (sqlite page corruption, a deleted or truncated ``cache.db``, a disk
that filled up mid-write) is moved aside and the store starts empty, with one warning, so a
restarting replica always has a store; value files no index names any more are removed.

Counters (hits, misses, evictions, corrupt) live in a small second cache, ``<path>/counters``,
so every process adds to the same totals and ``cacheblend-rag cache stats`` can show them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

import diskcache
from diskcache.core import MODE_PICKLE, MODE_RAW

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.base import COUNTERS, KVStore, StoreStats
from cacheblend_rag.store.errors import CorruptEntryError, StoreError

logger = logging.getLogger(__name__)

_IO_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
# diskcache's own size limit is disabled; this store enforces ``size_limit`` chunk by chunk.
_NO_LIMIT = 2**62
# Layer values above this size go to their own files, whose space is returned when they are
# evicted; values inside SQLite leave free pages behind and the database file never shrinks.
_MIN_FILE_SIZE = 4096


# The only value file names diskcache makes: two levels of folders, then 28 hex digits.
_VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_INDEX_FILES = ("cache.db", "cache.db-wal", "cache.db-shm")


class _BytesOnlyDisk(diskcache.Disk):
    """diskcache serialization that stores bytes (and counter ints) raw, never unpickles, and reads or
    deletes only value files diskcache itself would have made inside the store directory."""

    max_value_bytes: int | None = None  # set by DiskKVStore.bind_model

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN):
        if type(value) not in (bytes, int):
            raise TypeError(f"the KV store stores bytes only, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def _checked_path(self, filename: str) -> str:
        """The full path of ``filename``, if the index names a file this store could have written."""
        root = os.path.realpath(self._directory)
        full = os.path.realpath(os.path.join(self._directory, filename))
        if not isinstance(filename, str) or not _VALUE_FILE.fullmatch(filename.replace(os.sep, "/")) \
                or os.path.commonpath([root, full]) != root:
            raise CorruptEntryError(f"the store's index names the file {filename!r}, which is not a value file "
                                    "of this store (the index was altered?)")
        return full

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool):
        if mode == MODE_PICKLE:
            raise CorruptEntryError("a value in the store directory is pickled; refusing to unpickle it")
        limit = self.max_value_bytes
        if filename is not None:
            size = os.path.getsize(self._checked_path(filename))  # OSError: the file is gone (read as a miss)
            if limit is not None and size > limit:
                raise CorruptEntryError(f"a value file has {size:,} bytes, more than any layer of this model "
                                        f"({limit:,}); not reading it")
        elif mode == MODE_RAW and limit is not None and isinstance(value, (bytes, str)) and len(value) > limit:
            raise CorruptEntryError(f"a value has {len(value):,} bytes, more than any layer of this model ({limit:,})")
        return super().fetch(mode, filename, value, read)

    def remove(self, file_path: str) -> None:
        try:
            self._checked_path(file_path)
        except CorruptEntryError as exc:
            logger.warning("not deleting %s: %s", file_path, exc)
            return
        super().remove(file_path)

    def get(self, key: Any, raw: bool):
        if not raw:
            return None  # a pickled key was written by another program; never unpickle it
        return super().get(key, raw)


def _manifest_name(key: str) -> str:
    return f"m:{key}"


def _layer_name(key: str, write_id: str, layer: int) -> str:
    return f"l:{key}:{write_id}:{layer}"


class DiskKVStore(KVStore):
    """Chunk KV under ``path``; at most about ``size_limit`` bytes (``None``: unbounded).

    The limit is enforced after each chunk is written, so the volume can pass it by at most
    the chunks being written at that moment.
    """

    def __init__(self, path: str | Path, *, size_limit: int | None = None, timeout: float = 60.0) -> None:
        super().__init__()
        if size_limit is not None and (isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit < 1):
            raise ConfigError(f"size_limit={size_limit!r} must be a positive number of bytes, or None for no limit")
        self.path = Path(path).expanduser()
        self.size_limit = size_limit
        self._timeout = timeout
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot open the disk KV store at {self.path}: {exc}. Check that the directory can be "
                             "created and written, or pass another path") from exc
        self._cache = self._open_entries()
        self._counter_cache = self._open_index(self.path / "counters")

    def _open_entries(self) -> diskcache.Cache:
        """The index of the chunks' manifests and layers, reading no value larger than the model allows."""
        cache = self._open_index(self.path, tag_index=True, disk_min_file_size=_MIN_FILE_SIZE)
        cache.disk.max_value_bytes = self.max_value_bytes
        return cache

    def _open_index(self, folder: Path, **settings: Any) -> diskcache.Cache:
        """A diskcache on ``folder``; an index that cannot be opened is moved aside and started anew."""
        def open_() -> diskcache.Cache:
            return diskcache.Cache(str(folder), disk=_BytesOnlyDisk, size_limit=_NO_LIMIT, eviction_policy="none",
                                   statistics=False, timeout=self._timeout, **settings)

        try:
            cache = open_()
            if next(cache.iterkeys(), None) is None:  # reads the Cache table: a damaged index fails here
                self._reclaim_orphans(folder)  # an empty index (a deleted cache.db, say) names no value file
            return cache
        except (sqlite3.DatabaseError, diskcache.Timeout, OSError) as exc:
            logger.warning("the disk KV store's index %s could not be opened (%s: %s); it is moved aside and the "
                           "store starts empty (its chunks are computed again)", folder / "cache.db",
                           type(exc).__name__, exc)
        self._move_index_aside(folder)
        try:
            cache = open_()
        except (sqlite3.Error, diskcache.Timeout, OSError) as exc:
            raise StoreError(f"cannot open the disk KV store at {folder}, even empty: {exc}. Check free space and "
                             "permissions of the directory") from exc
        self._reclaim_orphans(folder)
        return cache

    @staticmethod
    def _move_index_aside(folder: Path) -> None:
        aside = f"cache.db.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for name in _INDEX_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder / name, folder / (aside + name[len("cache.db"):]))

    @staticmethod
    def _reclaim_orphans(folder: Path) -> None:
        """Delete the value files of an index that is gone: nothing names them any more."""
        removed = 0
        for file in folder.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val"):
            if _VALUE_FILE.fullmatch(file.relative_to(folder).as_posix()) and not file.is_symlink():
                with contextlib.suppress(OSError):
                    file.unlink()
                    removed += 1
        if removed:
            logger.warning("removed %d value files of the old index of %s", removed, folder)

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except _IO_ERRORS as exc:
            raise StoreError(f"disk KV store at {self.path}: cannot {what}: {exc}") from exc

    # ------------------------------------------------------------ layers
    def get_layer(self, key: str, write_id: str, layer: int) -> bytes | None:
        with self._io("read a layer"):
            return self._cache.get(_layer_name(key, write_id, layer), default=None, retry=True)

    def put_layer(self, key: str, write_id: str, layer: int, data: bytes) -> None:
        with self._io("write a layer"):
            self._cache.set(_layer_name(key, write_id, layer), bytes(data), tag=key, retry=True)

    def delete_layers(self, key: str, write_id: str, num_layers: int) -> None:
        with self._io("delete layers"):
            for layer in range(num_layers):
                self._cache.delete(_layer_name(key, write_id, layer), retry=True)

    # --------------------------------------------------------- manifests
    def get_manifest(self, key: str) -> bytes | None:
        with self._io("read a manifest"):
            return self._cache.get(_manifest_name(key), default=None, retry=True)

    def add_manifest(self, key: str, data: bytes) -> bool:
        with self._io("write a manifest"):
            added = self._cache.add(_manifest_name(key), bytes(data), tag=key, retry=True)
        if added:
            self._evict_to_limit()
        return added

    def contains(self, key: str) -> bool:
        with self._io("look up a manifest"):
            return _manifest_name(key) in self._cache

    def delete(self, key: str) -> bool:
        with self._io("delete a chunk"):
            removed = self._cache.delete(_manifest_name(key), retry=True)
            self._cache.evict(key, retry=True)  # every value tagged with the key: all writes' layers
        return removed

    def keys(self) -> Iterator[str]:
        with self._io("list keys"):
            names = list(self._cache.iterkeys())
        return (name[2:] for name in names if isinstance(name, str) and name.startswith("m:"))

    # ----------------------------------------------------------- eviction
    def volume(self) -> int:
        with self._io("measure its size"):
            return self._cache.volume()

    def _evict_to_limit(self) -> None:
        if self.size_limit is None:
            return
        with self._io("evict"):
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
                    self._cache.delete(name, retry=True)

    def _drop_oldest_row(self) -> None:
        """Delete the oldest row of the index, whatever its key and value, by its row id.

        This is the one place that speaks SQL to diskcache's index (its ``Cache`` table and row ids,
        stable since diskcache 4): a row whose key or value cannot be loaded has no other handle."""
        with self._cache.transact(retry=True):
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
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known counters are {COUNTERS}")
        with self._io("update its counters"):
            for name, n in counts.items():
                if n:
                    self._counter_cache.incr(name, int(n), default=0, retry=True)

    def counters(self) -> dict[str, int]:
        with self._io("read its counters"):
            return {name: int(self._counter_cache.get(name, default=0, retry=True)) for name in COUNTERS}

    def reset_counters(self) -> None:
        with self._io("reset its counters"):
            self._counter_cache.clear(retry=True)

    def stats(self) -> StoreStats:
        entries = sum(1 for _ in self.keys())
        return StoreStats(
            entries=entries, bytes=self.volume(), **self.counters(),
            details={"path": str(self.path), "size_limit": self.size_limit},
        )

    def clear(self) -> None:
        """Remove every entry and reset the counters. An index too damaged to clear is replaced by an
        empty one (and its value files removed), so clearing always works."""
        try:
            with self._io("clear"):
                self._cache.clear(retry=True)
        except StoreError as exc:
            logger.warning("could not clear %s entry by entry (%s); starting it empty instead", self.path, exc)
            self._cache.close()
            self._move_index_aside(self.path)
            self._cache = self._open_entries()  # empty, so its orphaned value files are reclaimed
        self.reset_counters()

    def close(self) -> None:
        self._cache.close()
        self._counter_cache.close()

    def describe(self) -> str:
        limit = "" if self.size_limit is None else f", size_limit={self.size_limit}"
        return f"DiskKVStore({str(self.path)!r}{limit})"
