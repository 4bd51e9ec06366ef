"""Content-addressed chunk keys.

A key is the SHA-256 of the model fingerprint (architecture, config, tokenizer, weights
digest, compute dtype), the chunk's token ids, the conditioning prefix ids and the store
format version. The same text under another model or another prefix gets another key,
and keys are identical across processes and machines (no Python ``hash()``).

The storage dtype is *not* part of the key: every layer value records its own dtype, so a
store written at 32 bits is readable by a reader configured for 16 bits and vice versa.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

from cacheblend_rag.store.format import FORMAT_VERSION

_DOMAIN = b"cacheblend-rag/chunk-kv\x00"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    # Length-prefixed so that (chunk, prefix) pairs can never be re-split into another pair.
    array = np.asarray(list(ids), dtype="<i8")
    return struct.pack("<Q", array.size) + array.tobytes()


def chunk_key(
    model_fingerprint: str,
    token_ids: Sequence[int],
    prefix_ids: Sequence[int] = (),
    *,
    format_version: int = FORMAT_VERSION,
) -> str:
    """Hex key of one chunk's KV under one model."""
    if not model_fingerprint:
        raise ValueError("model_fingerprint is empty; pass engine.fingerprint")
    h = hashlib.sha256(_DOMAIN)
    h.update(struct.pack("<I", format_version))
    fingerprint = model_fingerprint.encode()
    h.update(struct.pack("<Q", len(fingerprint)) + fingerprint)
    h.update(_ids_bytes(token_ids))
    h.update(_ids_bytes(prefix_ids))
    return h.hexdigest()
