"""Damage a store the way others could: for fault trials (``benchmarks/fault_trial.py``) and tests.

Another program sharing a disk store's directory writes through diskcache's own ``Disk``, which
stores any Python value (pickling what is not bytes, str or a number) and can rewrite the SQLite
index that names each large value's file. These helpers do exactly that, knowing the store's
layout (``m:<key>`` for a manifest, ``l:<key>:<write id>:<layer>`` for a layer, tagged with the
chunk key), so faults are written once, not once per trial.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import xxhash

from cacheblend_rag.store.format import chunk_bytes as fmt
from cacheblend_rag.store.backends.disk import _layer_name, _manifest_name


def write_as_another_program(store_path: Path, name: str, value: Any, key: str) -> None:
    import diskcache

    with diskcache.Cache(str(store_path)) as other_program:
        other_program.set(name, value, tag=key)


def read_as_another_program(store_path: Path, name: str) -> Any:
    import diskcache

    with diskcache.Cache(str(store_path)) as other_program:
        return other_program.get(name)


def delete_as_another_program(store_path: Path, name: str) -> None:
    import diskcache

    with diskcache.Cache(str(store_path)) as other_program:
        other_program.delete(name)


def manifest_name(key: str) -> str:
    return _manifest_name(key)


def layer_name(key: str, write_id: str, layer: int) -> str:
    return _layer_name(key, write_id, layer)


def index_rows(store_path: Path, where: str) -> list[tuple[int, str, str | None]]:
    """``(rowid, name, filename)`` of the index rows matching the SQL condition ``where``."""
    with sqlite3.connect(store_path / "cache.db") as db:
        return db.execute(f"SELECT rowid, key, filename FROM Cache WHERE {where}").fetchall()


def set_index_filename(store_path: Path, rowid: int, filename: str) -> None:
    """Point an index row at ``filename``: what diskcache would read and, on removal, delete."""
    with sqlite3.connect(store_path / "cache.db") as db:
        db.execute("UPDATE Cache SET filename = ? WHERE rowid = ?", (filename, rowid))


def nested_manifest(depth: int = 50_000) -> bytes:
    """A manifest of ``depth`` nested JSON lists with a valid checksum: a parser that recurses dies."""
    text = ("[" * depth + "]" * depth).encode()
    body = fmt._MANIFEST_HEAD.pack(fmt.MANIFEST_MAGIC, fmt.FORMAT_VERSION, 0, 0, len(text), fmt.NO_KEY_ID) + text
    return body + xxhash.xxh3_128_digest(body)


INDEX_DAMAGE = ("garbage", "deleted", "corrupt-pages", "empty")


def damage_index(store_path: Path, how: str) -> None:
    """Break a disk store's SQLite index: overwrite it with ``garbage``, delete it, overwrite every
    page after the first (``corrupt-pages``), or leave it ``empty`` (as a full disk can)."""
    index = store_path / "cache.db"
    if how == "garbage":
        index.write_bytes(os.urandom(8192))
    elif how == "deleted":
        index.unlink()
    elif how == "corrupt-pages":
        data = bytearray(index.read_bytes())
        data[4096:] = os.urandom(len(data) - 4096)
        index.write_bytes(bytes(data))
    elif how == "empty":
        index.write_bytes(b"")
    else:
        raise ValueError(f"how={how!r}; choose one of {INDEX_DAMAGE}")
