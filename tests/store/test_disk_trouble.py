"""A disk store on a file system that misbehaves: full at open or during write-back, read-only, its
folder removed while open, and closed with connections on other threads. Nothing healthy is moved
aside or deleted, reads go on, writes are skipped (counted, one warning) and resume by themselves,
and a failed write leaves no file behind.

The faults are simulated where they come from (diskcache's writes, SQLite's errors), so the tests
run anywhere; the same faults on real small file systems (tmpfs mounts) are in
``benchmarks/fault_trial.py``, and in the last tests here when this process may mount one.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import diskcache
import pytest
import torch

from cacheblend_rag import BlendConfig, FreshSegment, StoredSegment
from cacheblend_rag.store import ChunkCache, DiskKVStore
from cacheblend_rag.store.backends import disk_index

from kvstore_samples import TEXTS as SAMPLES  # noqa: E402

TEXTS = [*SAMPLES, "The Nile is the longest river of Africa; it flows north into the Mediterranean Sea. " * 2]

CONFIG = BlendConfig(recompute_ratio=0.25, check_layer=1)
EXACT = dict(rtol=0, atol=1e-5)


def _sqlite_error(message: str, code: int, name: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode, exc.sqlite_errorname = code, name
    return exc


FULL = _sqlite_error("database or disk is full", 13, "SQLITE_FULL")
SHM_FULL = _sqlite_error("disk I/O error", 4874, "SQLITE_IOERR_SHMSIZE")
READ_ONLY = _sqlite_error("attempt to write a readonly database", 8, "SQLITE_READONLY")
CANT_OPEN = _sqlite_error("unable to open database file", 14, "SQLITE_CANTOPEN")


def _value_files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val")}


def _named_files(path: Path) -> set[str]:
    with sqlite3.connect(f"{(path / 'cache.db').as_uri()}?mode=ro", uri=True) as con:
        return {name for (name,) in con.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}


def _prompt(engine, texts):
    ids = [engine.tokenize(t) for t in texts]
    head, question = FreshSegment(engine.tokenize("Context:\n")), FreshSegment(engine.tokenize("Question?"))
    return [head, *map(StoredSegment, ids), question], [head, *engine.prefill_chunks(ids), question]


def _reference(engine, in_memory):
    return engine.blend(in_memory, config=CONFIG).logits


@pytest.fixture
def warmed(engine, tmp_path):
    """A closed disk store holding the first two sample chunks, in value files of their own."""
    path = tmp_path / "kv"
    with DiskKVStore(path) as store, ChunkCache(engine, store, storage_dtype="float32") as cache:
        assert cache.warm(TEXTS[:2]).new == 2
    assert _value_files(path)  # the layers are files, as a real model's are
    return path


def _refuse_writable_opens(monkeypatch, error: BaseException) -> None:
    def refuse(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(diskcache.core.Cache, "__init__", refuse)


def _warnings(caplog):
    # The store's own warnings; not the one a keyless cache gives on opening a shared store (test_store_key_required).
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name != "cacheblend_rag.store.store_key"]


# ------------------------------------------------------------------ full disk, read-only at open
@pytest.mark.parametrize("error", [FULL, SHM_FULL, READ_ONLY, CANT_OPEN, OSError(errno.ENOSPC, "No space left")],
                         ids=["SQLITE_FULL", "SQLITE_IOERR_SHMSIZE", "SQLITE_READONLY", "SQLITE_CANTOPEN", "ENOSPC"])
def test_a_store_that_cannot_be_written_at_open_keeps_every_entry_and_reads_them(engine, warmed, monkeypatch,
                                                                                 caplog, error):
    files = _value_files(warmed)
    _refuse_writable_opens(monkeypatch, error)
    stored, in_memory = _prompt(engine, TEXTS[:3])
    with caplog.at_level(logging.WARNING):
        store = DiskKVStore(warmed, retry_writes_after=60)
        with ChunkCache(engine, store, storage_dtype="float32") as cache:
            result = engine.blend(stored, store=cache, config=CONFIG)
            cache.flush()
            stats = cache.stats()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert (result.stats.cache_hits, result.stats.cache_misses) == (2, 1)  # read, from the old index
    assert stats.entries == 2 and stats.writes_skipped == 1 and stats.available
    assert stats.details["writes"].startswith("skipped")
    messages = _warnings(caplog)
    assert len(messages) == 1 and "takes no writes" in messages[0], messages  # one warning, not one per write
    assert not [n for n in os.listdir(warmed) if "broken" in n]  # nothing moved aside
    assert _value_files(warmed) == files  # nothing deleted
    store.close()


def test_a_store_full_at_open_takes_writes_again_once_there_is_room(engine, warmed, monkeypatch, caplog):
    stored, in_memory = _prompt(engine, TEXTS[:3])
    with monkeypatch.context() as full:
        _refuse_writable_opens(full, FULL)
        store = DiskKVStore(warmed, retry_writes_after=0.05)
    cache = ChunkCache(engine, store, storage_dtype="float32")
    assert cache.stats().details["writes"].startswith("skipped")
    time.sleep(0.1)  # room again, and past the retry delay
    with caplog.at_level(logging.WARNING):
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    stats = cache.stats()
    assert stats.entries == 3 and stats.details["writes"] == "ok"
    assert stats.hits == 2 and stats.misses == 1  # counted while read-mostly, written now
    assert any("takes writes again" in m for m in _warnings(caplog))
    assert engine.blend(stored, store=cache, config=CONFIG).stats.cache_hits == 3
    cache.close()
    store.close()


# ------------------------------------------------------------------ full disk during write-back
def _partial_then_enospc(fd, iterator):
    with os.fdopen(fd, "wb") as f:  # half the value, then the disk is full
        data = b"".join(iterator)
        f.write(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


def _insert_full(self, *args, **kwargs):
    raise FULL


@pytest.mark.parametrize("where", ["value file", "index row"])
def test_write_back_on_a_full_disk_leaves_no_file_and_deletes_nothing(engine, warmed, monkeypatch, caplog, where):
    stored, in_memory = _prompt(engine, TEXTS[:4])
    store = DiskKVStore(warmed, retry_writes_after=60)
    files = _value_files(warmed)
    cache = ChunkCache(engine, store, storage_dtype="float32")
    with monkeypatch.context() as full, caplog.at_level(logging.WARNING):
        if where == "value file":
            full.setattr(disk_index, "write_all", _partial_then_enospc)
        else:
            full.setattr(diskcache.core.Cache, "_row_insert", _insert_full)
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
        assert cache.warm(TEXTS[2:4]).failed == 2  # skipped, not tried again at once
        stats = cache.stats()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert stats.entries == 2 and stats.writes_skipped >= 2 and stats.details["writes"].startswith("skipped")
    assert _value_files(warmed) == files == _named_files(warmed)  # no file of a failed write, none lost
    assert sum("takes no writes" in m for m in _warnings(caplog)) == 1
    store._retry_writes_at = 0.0  # a minute later, with room again
    cache.warm(TEXTS[2:4])
    cache.flush()
    assert cache.stats().entries == 4 and _value_files(warmed) == _named_files(warmed)
    cache.close()
    store.close()


# ------------------------------------------------------------------ the folder removed while open
def test_a_store_folder_removed_while_open_is_opened_anew_not_written_into_a_deleted_index(engine, warmed):
    stored, in_memory = _prompt(engine, TEXTS[:3])
    store = DiskKVStore(warmed)
    # No host-memory tier: it would serve the chunks read before the removal, and write nothing anew.
    with ChunkCache(engine, store, storage_dtype="float32", resident_bytes=0) as cache:
        assert engine.blend(stored, store=cache, config=CONFIG).stats.cache_hits == 2
        cache.flush()
        shutil.rmtree(warmed)
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
        torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    store.close()
    with DiskKVStore(warmed) as reopened:  # what the next replica finds: the chunks written since
        assert reopened.stats().entries == 3
        assert _value_files(warmed) == _named_files(warmed)


# ------------------------------------------------------------------ close
def _open_index_files(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with_target = os.path.join("/proc/self/fd", fd)
        try:
            target = os.readlink(with_target)
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_close_releases_the_connections_of_every_thread(engine, warmed):
    stored, _ = _prompt(engine, TEXTS[:3])
    store = DiskKVStore(warmed)
    cache = ChunkCache(engine, store, storage_dtype="float32")  # its writer and loader threads stay alive
    engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    reader = threading.Thread(target=lambda: list(store.keys()))
    reader.start()
    reader.join()
    assert _open_index_files(warmed)
    store.close()
    assert _open_index_files(warmed) == []
    cache.close()


# ------------------------------------------------------------------ stats
def test_stats_never_raise_and_say_the_store_is_unavailable(engine, warmed, monkeypatch):
    store = DiskKVStore(warmed)

    def gone(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store._cache, "iterkeys", gone)
    stats = store.stats()
    assert not stats.available and "disk I/O error" in stats.error
    store.close()


# ------------------------------------------------------------------ real small file systems
def _mount_tmpfs(folder: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    folder = tmp_path / "fs"
    if not _mount_tmpfs(folder, "4m"):
        pytest.skip("this process cannot mount a tmpfs (needs root and mount permission)")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    return filler


def test_on_a_real_full_disk_nothing_is_lost_and_writes_resume(engine, small_fs, caplog):
    path = small_fs / "kv"
    with DiskKVStore(path) as store, ChunkCache(engine, store, storage_dtype="float32") as cache:
        cache.warm(TEXTS[:2])
    files = _value_files(path)
    filler = _fill(small_fs)
    stored, in_memory = _prompt(engine, TEXTS[:4])
    with caplog.at_level(logging.WARNING):
        store = DiskKVStore(path, retry_writes_after=0.05)
        # No host-memory tier: it would keep the chunks computed while the disk was full and serve them
        # from memory, so the blend after the disk clears would have nothing to write.
        cache = ChunkCache(engine, store, storage_dtype="float32", resident_bytes=0)
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
    assert result.stats.cache_hits == 2 and cache.stats().entries == 2
    assert _value_files(path) == files and not [n for n in os.listdir(path) if "broken" in n]
    filler.unlink()
    time.sleep(0.1)
    engine.blend(stored, store=cache, config=CONFIG)
    cache.flush()
    assert cache.stats().entries == 4
    cache.close()
    store.close()
    assert _value_files(path) == _named_files(path)


def test_on_a_real_read_only_file_system_entries_are_read(engine, small_fs):
    path = small_fs / "kv"
    with DiskKVStore(path) as store, ChunkCache(engine, store, storage_dtype="float32") as cache:
        cache.warm(TEXTS[:2])
    # close() released every handle, so the file system can be remounted read-only
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True).returncode == 0
    stored, in_memory = _prompt(engine, TEXTS[:3])
    with DiskKVStore(path) as store, ChunkCache(engine, store, storage_dtype="float32") as cache:
        result = engine.blend(stored, store=cache, config=CONFIG)
        cache.flush()
        assert result.stats.cache_hits == 2 and cache.stats().details["writes"].startswith("skipped")
    torch.testing.assert_close(result.logits, _reference(engine, in_memory), **EXACT)
