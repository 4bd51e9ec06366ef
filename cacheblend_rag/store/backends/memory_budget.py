"""How much memory the package's in-process stores may hold when nobody said: bounds by default.

An engine serving many users must not grow without limit. With no ``store_path`` chunk K/V goes to an
in-memory store, a ``tiered:`` store keeps a memory tier in front of its disk, and missed chunks wait in
the write-back queue while a slow store takes them. Each is bounded by default, as a share of the memory
this process may use (the machine's, or its cgroup's limit in a container, whichever is lower), with a byte
figure on top so that a large machine does not hand a cache most of itself:

* an in-memory store or memory tier: an eighth, at most 4 GiB (LMCache's CPU tier defaults to 5 GB; this
  process also holds the model, the prefix cache and up to 1 GiB of resident chunks, ``store/resident.py``);
* the write-back queue: a thirty-second, at most 512 MiB of K/V waiting to be written. A chunk beyond it is
  not written back (counted as ``write_backs_dropped``): the next request that needs it computes it again,
  so a stalled store costs recomputation, never memory or a blocked request.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_STORE_SHARE, MEMORY_STORE_CAP = 8, 4 << 30
WRITE_BACK_SHARE, WRITE_BACK_CAP = 32, 512 << 20
_FLOOR = 64 << 20  # a bound below this would make the default store useless on a small machine


def usable_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit where lower (as if 16 GiB
    where the platform says neither)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        total = 16 << 30
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, then v1
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number, v2 with "max"
            return int(text)
    return None


def default_memory_store_bytes() -> int:
    """The bound of an in-memory store or memory tier nobody sized (module docstring)."""
    return max(_FLOOR, min(MEMORY_STORE_CAP, usable_memory() // MEMORY_STORE_SHARE))


def default_write_back_bytes() -> int:
    """The bound of the K/V waiting in the write-back queue (module docstring)."""
    return max(_FLOOR, min(WRITE_BACK_CAP, usable_memory() // WRITE_BACK_SHARE))


__all__ = ["default_memory_store_bytes", "default_write_back_bytes", "usable_memory"]
