"""How fast the store's loader reads chunk KV cold, beside how fast the disk under it reads, in one run.

A blend that reads chunk KV from a disk store is bound by the disk once its arithmetic is small (a GPU, a
short prompt): the loader's share of the disk's sequential bandwidth says how much of that bound it reaches.
Both are measured cold: the files are dropped from the page cache (``posix_fadvise(DONTNEED)``, no root
needed for clean pages) before each read. Where the kernel keeps them anyway (some container file systems),
the numbers are warm reads, and ``evicted`` says how many bytes were asked to go.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable

BLOCK = 16 << 20  # the disk's sequential read: 16 MiB a read, as a large-file copy reads


def evict(folder: Path) -> int:
    """Ask the kernel to drop every file under ``folder`` from the page cache; the bytes asked."""
    asked = 0
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        with open(path, "rb") as handle:
            with contextlib.suppress(OSError):  # dirty pages are not dropped: write them out first
                os.fsync(handle.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        asked += path.stat().st_size
    return asked


def value_bytes(folder: Path) -> int:
    """Bytes of the store's value files (``*.val``: one per chunk layer): what a blend of every chunk reads."""
    return sum(p.stat().st_size for p in folder.rglob("*.val"))


def disk_sequential(folder: Path, nbytes: int) -> float:
    """Bytes a second of one cold sequential read of a ``nbytes`` file written in ``folder`` (removed after)."""
    path = folder / "bandwidth-probe.bin"
    block = os.urandom(min(BLOCK, max(nbytes, 1)))
    try:
        with open(path, "wb") as handle:
            written = 0
            while written < nbytes:
                written += handle.write(block[: nbytes - written])
            handle.flush()
            os.fsync(handle.fileno())
        evict(folder)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            while handle.read(BLOCK):
                pass
        return nbytes / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def loader_and_disk(folder: Path, read_every_layer: Callable[[], Any]) -> dict[str, Any]:
    """``read_every_layer`` (reads each stored chunk's every layer through the loader, computing nothing) timed
    cold, and the disk's sequential read of as many bytes, in the same run."""
    nbytes = value_bytes(folder)
    evicted = evict(folder)
    start = time.perf_counter()
    read_every_layer()
    loader = nbytes / (time.perf_counter() - start)
    disk = disk_sequential(folder, max(nbytes, 64 << 20))
    return {"bytes": nbytes, "evicted_bytes": evicted, "loader_MBps": round(loader / 1e6, 1),
            "disk_sequential_MBps": round(disk / 1e6, 1), "loader_share_of_disk": round(loader / disk, 3)}
