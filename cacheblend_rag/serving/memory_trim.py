"""Freed heap memory given back to the system when the scheduler goes idle (glibc's ``malloc_trim``).

A CPU server allocates each request's activations and K/V at its own prompt length. glibc keeps freed
blocks in its heaps for reuse, and requests of ever new lengths leave them fragmented: a ten-minute
soak (docs/operations.md, "Soak") grew RSS by 16% with Python objects, caches, open files and threads
flat. Trimming when the last request finishes gave 70-180 MB back each time on SmolLM2 in 3-12 ms, and
the next prefill was no slower. A fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``) bounds it too but
made every prefill twice as slow (each large tensor mapped and faulted in afresh), so it is not used.
Elsewhere (macOS, musl) there is no ``malloc_trim`` and this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional


def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system; whether this platform can."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
