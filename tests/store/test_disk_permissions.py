"""A disk store is as private as the documents whose K/V it holds: layer 0 gives a chunk's text back, so its
folders are made 0o700 and its files (diskcache's SQLite index, its -wal and -shm, every value file) 0o600,
whatever the umask."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from cacheblend_rag.store import ChunkCache, DiskKVStore

from kvstore_samples import TEXTS  # noqa: E402


def _modes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    folders, files = {}, {}
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        (folders if path.is_dir() else files)[str(path.relative_to(root))] = mode
    return folders, files


@pytest.fixture
def loose_umask():
    old = os.umask(0o002)  # what many desktops use: group-writable, world-readable
    yield
    os.umask(old)


def test_folders_are_0o700_and_files_0o600_under_any_umask(engine, tmp_path, loose_umask):
    root = tmp_path / "deep" / "kv"  # its parents are not the store's: left to the umask
    long_text = " ".join(TEXTS) * 4  # a layer value over 4 KiB goes to a value file of its own
    with ChunkCache(engine, DiskKVStore(root), storage_dtype="float32") as cache:
        cache.warm([*TEXTS, long_text])
        cache.store.record(hits=1)  # the counters' own index
        cache.flush()
        folders, files = _modes(root)
    assert any(name.endswith(".val") for name in files), "no value file was written; the test proves nothing"
    assert {"cache.db", "cache.db-wal", "cache.db-shm", "counters/cache.db"} <= set(files)
    assert {name: mode for name, mode in folders.items() if mode != 0o700} == {}
    assert {name: mode for name, mode in files.items() if mode != 0o600} == {}


def test_an_existing_folder_others_can_read_is_left_alone_with_a_warning(engine, tmp_path, caplog):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o755)  # made by an older version, or by hand
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.backends.disk"):
        DiskKVStore(root).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755  # the operator's choice, not changed behind their back
    assert "other users of this machine can read it" in caplog.text and "chmod -R go-rwx" in caplog.text
    caplog.clear()
    root.chmod(0o750)  # shared with a group on purpose: no warning
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.backends.disk"):
        DiskKVStore(root).close()
    assert "other users" not in caplog.text
