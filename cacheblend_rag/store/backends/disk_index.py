"""The disk store's SQLite index as diskcache keeps it, and what to do when the file system misbehaves.

* :class:`BytesOnlyDisk`: diskcache's serialization, storing bytes raw, never unpickling, touching
  only value files diskcache itself would have made inside the store directory, and leaving no
  file behind when a write fails (a partial file on ``ENOSPC``, or a whole one whose row was never
  committed).
* :class:`TrackedCache`: a ``diskcache.Cache`` whose :meth:`close` closes the connection of every
  thread that used it (diskcache keeps one per thread and closes only the caller's), so a closed
  store holds no file open and its file system can be unmounted or remounted read-only.
* :class:`ReadOnlyIndex`: reads of an index that cannot be opened for writing (a full disk, a
  read-only file system), through a read-only SQLite connection.
* :func:`is_damage` tells a damaged index (which may be moved aside) from a file system that cannot
  take writes now (which never is: its entries are healthy); :func:`write_trouble` says which.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import diskcache
from diskcache.core import MODE_PICKLE, MODE_RAW

from cacheblend_rag.store.errors import CorruptEntryError

logger = logging.getLogger(__name__)

# The only value file names diskcache makes: two levels of folders, then 28 hex digits.
VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
INDEX_FILES = ("cache.db", "cache.db-wal", "cache.db-shm")

# SQLite's primary result codes that mean the file holds no valid database (its pages are damaged,
# or it is not SQLite at all). Every other failure (SQLITE_FULL, SQLITE_READONLY, SQLITE_IOERR_*,
# SQLITE_CANTOPEN, SQLITE_BUSY, ...) is about the file system or another process, not the index.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
_DAMAGE_WORDS = ("malformed", "not a database", "file is encrypted")
# Below this many free bytes a file system counts as full (SQLite needs room for its WAL and -shm).
_FULL_BELOW = 1 << 20


# A store's folders are made 0o700 and its files 0o600, whatever the umask (diskcache follows it: 0o755 and
# 0o644 under the usual 022): layer 0's K/V gives a chunk's text back, so the store must be as private as the
# documents. SQLite makes an index's -wal and -shm files with the index's own mode.
PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600


def private_folder(folder: str | Path) -> None:
    """Create ``folder`` (its parent exists) for its owner alone; one that exists is left as it is."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, PRIVATE_FOLDER)


def private_index(folder: Path) -> None:
    """``folder`` and an empty ``cache.db`` in it (SQLite takes an empty file for a new database), both private,
    before diskcache opens them; an index that exists keeps its mode (and is never opened for writing here:
    on a read-only file system it is read, not created)."""
    private_folder(folder)
    index = folder / "cache.db"
    if not index.exists():
        with contextlib.suppress(FileExistsError):
            os.close(os.open(index, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc``, raised opening or reading an index, says the index itself is damaged."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    return any(word in str(exc).lower() for word in _DAMAGE_WORDS)


def write_trouble(folder: Path, exc: BaseException) -> str:
    """Why writes to ``folder`` fail, in words: the file system is read-only, full, or the folder is gone;
    else what the error says."""
    try:
        info = os.statvfs(folder)
    except FileNotFoundError:
        return "the store folder was removed"
    except OSError:
        info = None
    number = getattr(exc, "errno", None)
    name = getattr(exc, "sqlite_errorname", "") or ""
    if number == errno.EROFS or (info is not None and info.f_flag & os.ST_RDONLY):
        return "the file system is read-only"
    if number in (errno.ENOSPC, errno.EDQUOT) or name == "SQLITE_FULL" or \
            (info is not None and info.f_bavail * info.f_frsize < _FULL_BELOW):
        return "the disk is full"
    if name.startswith("SQLITE_READONLY") or number in (errno.EACCES, errno.EPERM):
        return "the store folder is not writable"
    return f"{type(exc).__name__}: {exc}"


def write_all(fd: int, iterator: Any) -> int:
    """Write the chunks of ``iterator`` to the file ``fd`` and close it; the bytes written."""
    with os.fdopen(fd, "wb") as writer:
        size = 0
        for chunk in iterator:
            size += len(chunk)
            writer.write(chunk)
    return size


class BytesOnlyDisk(diskcache.Disk):
    """diskcache serialization that stores bytes (and counter ints) raw, never unpickles, and reads or
    deletes only value files diskcache itself would have made inside the store directory."""

    max_value_bytes: int | None = None  # set by DiskKVStore.bind_model

    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self._written = threading.local()
        # Resolved once: a value file is checked against the folder as it was opened, and a blend reads
        # hundreds of them (a second realpath each cost a 3,000-token blend ~12 ms on a CPU).
        self._root = os.path.realpath(self._directory)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN):
        if type(value) not in (bytes, int):
            raise TypeError(f"the KV store stores bytes only, got {type(value).__name__}")
        self._written.filename = None
        stored = super().store(value, read, key=key)
        self._written.filename = stored[2]
        return stored

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: str | None = None) -> int:
        """diskcache's ``_write`` (make the folders, open the new file, ten tries: another process may remove an
        empty folder meanwhile), with private folders and files. Only bytes reach here (:meth:`store`)."""
        if mode != "xb":
            raise TypeError(f"the KV store writes value files in binary only, not mode {mode!r}")
        folder = os.path.dirname(full_path)
        for attempt in range(1, 11):
            try:
                private_folder(os.path.dirname(folder))
                private_folder(folder)
                fd = os.open(full_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                             PRIVATE_FILE)
                break
            except FileNotFoundError:
                if attempt == 10:
                    raise
        try:
            return write_all(fd, iterator)
        except BaseException:
            # Created here (O_EXCL): this write's own file, partly written (ENOSPC, say).
            with contextlib.suppress(OSError):
                os.remove(full_path)
            raise

    def discard_uncommitted(self, *, committed: bool = False) -> None:
        """Remove the value file this thread's last ``store`` wrote, whose row was never committed
        (``committed=True``: it was; only forget it)."""
        filename, self._written.filename = getattr(self._written, "filename", None), None
        if filename is not None and not committed:
            with contextlib.suppress(OSError, CorruptEntryError):
                os.remove(self._checked_path(filename))

    def _checked_path(self, filename: str) -> str:
        """The full path of ``filename``, if the index names a file this store could have written."""
        root = self._root
        full = os.path.realpath(os.path.join(self._directory, filename))
        if not isinstance(filename, str) or not VALUE_FILE.fullmatch(filename.replace(os.sep, "/")) \
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


class _Connection(sqlite3.Connection):
    """A connection that can be referred to weakly, and knows the process that opened it."""

    pid: int = 0


class TrackedCache(diskcache.Cache):
    """A ``diskcache.Cache`` that remembers each thread's connection, so :meth:`close` closes them all.

    diskcache keeps one SQLite connection per thread and closes only the caller's; the chunk cache's
    writer thread and the layer loader's would stay open (and keep the file system busy) until
    their threads end. These connections may be closed from any thread; each is still used by its
    own thread only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Weak: a thread that ends still frees its connection, as with diskcache's own.
        self._connections: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    @property
    def _con(self) -> sqlite3.Connection:
        pid = os.getpid()
        if getattr(self._local, "pid", None) != pid:
            self._local.con = None  # a forked child never uses its parent's connection
            self._local.pid = pid
        con = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(os.path.join(self._directory, diskcache.core.DBNAME), timeout=self._timeout,
                                  isolation_level=None, check_same_thread=False, factory=_Connection)
            con.pid = pid
            with self._connections_lock:
                self._connections.add(con)
            self._local.con = con
            # Per-connection pragmas, as diskcache sets them (the table is absent in a new index).
            with contextlib.suppress(sqlite3.OperationalError):
                for key, value in con.execute("SELECT key, value FROM Settings").fetchall():
                    if key.startswith("sqlite_"):
                        self.reset(key, value, update=False)
        return con

    def close(self) -> None:
        pid = os.getpid()
        with self._connections_lock:
            mine = [con for con in self._connections if con.pid == pid]
            self._connections = weakref.WeakSet()
        for con in mine:
            with contextlib.suppress(sqlite3.Error):
                con.close()
        self._local.con = None


class ReadOnlyIndex:
    """What the store reads of a diskcache index that cannot be opened for writing.

    SQLite opens a WAL database read-only only if its ``-shm`` file can be mapped; on a full disk or
    a read-only file system it often cannot, and the index is then read as immutable (the state of
    its last checkpoint: whatever was written after that is not seen, and a row whose value file is
    gone reads as absent)."""

    why: str = ""  # why the index could not be opened for writing
    cause: BaseException | None = None

    def __init__(self, folder: Path, disk: BytesOnlyDisk) -> None:
        self.directory = str(folder)
        self.disk = disk
        self._lock = threading.Lock()
        self._con: sqlite3.Connection | None = None
        index = folder / "cache.db"
        if index.exists() and index.stat().st_size:
            self._con = self._connect(index)

    @staticmethod
    def _connect(index: Path) -> sqlite3.Connection:
        error: sqlite3.Error | None = None
        for options in ("mode=ro", "immutable=1"):
            try:
                con = sqlite3.connect(f"{index.as_uri()}?{options}", uri=True, check_same_thread=False,
                                      isolation_level=None)
                con.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()
                return con
            except sqlite3.Error as exc:
                error = exc
                with contextlib.suppress(UnboundLocalError, sqlite3.Error):
                    con.close()
        assert error is not None
        raise error

    def _rows(self, query: str, args: tuple = ()) -> list[tuple]:
        if self._con is None:
            return []
        with self._lock:
            return self._con.execute(query, args).fetchall()

    def get(self, key: str, default: Any = None, retry: bool = False) -> Any:
        rows = self._rows("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1 AND "
                          "(expire_time IS NULL OR expire_time > ?)", (key, time.time()))
        if not rows:
            return default
        mode, filename, value = rows[0]
        try:
            return self.disk.fetch(mode, filename, value, False)
        except OSError:
            return default  # the value file is gone: read as a miss, as diskcache does

    def __contains__(self, key: str) -> bool:
        return bool(self._rows("SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (key,)))

    def iterkeys(self) -> Iterator[Any]:
        return iter([key for (key,) in self._rows("SELECT key FROM Cache WHERE raw = 1 ORDER BY rowid")])

    def volume(self) -> int:
        pages = self._rows("PRAGMA page_count")
        page_size = self._rows("PRAGMA page_size")
        size = self._rows("SELECT value FROM Settings WHERE key = 'size'")
        if not pages:
            return 0
        return int(pages[0][0]) * int(page_size[0][0]) + int(size[0][0] if size else 0)

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None
