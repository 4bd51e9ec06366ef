"""Content-addressed chunk keys.

A key is the SHA-256 of the model fingerprint (architecture, config, tokenizer, weights
digest, compute dtype), the chunk's token ids, the conditioning prefix ids and the store
format version. The same text under another model or another prefix gets another key,
and keys are identical across processes and machines (no Python ``hash()``).

A lossless storage dtype (float16, bfloat16, float32) is *not* part of the key: every layer
value records its own codec, so a store written at 32 bits is readable by a reader configured
for 16 bits and vice versa. A lossy codec (int8, int4, with its group size) *is*: a reader at
16 bits never takes an int4 entry for its own, and readers of different quantizations never mix.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

from cacheblend_rag.store.format.chunk_bytes import FORMAT_VERSION

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
    codec_tag: str = "",
) -> str:
    """Hex key of one chunk's KV under one model (and one lossy codec, ``Codec.tag``)."""
    if not model_fingerprint:
        raise ValueError("model_fingerprint is empty; pass engine.fingerprint")
    h = hashlib.sha256(_DOMAIN)
    h.update(struct.pack("<I", format_version))
    fingerprint = model_fingerprint.encode()
    h.update(struct.pack("<Q", len(fingerprint)) + fingerprint)
    h.update(_ids_bytes(token_ids))
    h.update(_ids_bytes(prefix_ids))
    if codec_tag:  # empty for the lossless codecs, so their keys are what they always were
        tag = codec_tag.encode()
        h.update(struct.pack("<Q", len(tag)) + tag)
    return h.hexdigest()


# Prefix-cache blocks (cacheblend_rag.store.prefix_blocks) live in the same stores as chunks, under
# keys of their own: a block entry is never taken for a chunk entry, and inventories count them apart.
# An approximate block (an earlier blend's K/V) has a key of its own too, so its flag is part of the
# name its manifest is tagged under: no entry is read as exact unless it was written as exact.
PREFIX_BLOCK_KEY = "prefix-"
APPROXIMATE_PREFIX_BLOCK_KEY = "prefix-approx-"  # chain keys are hex: never "approx-..."


def prefix_block_key(chain_key: str, *, approximate: bool = False) -> str:
    """The store key of a prefix-cache block, from its chain key (:func:`engine.prefix_cache.block_keys`)
    and its flag."""
    return (APPROXIMATE_PREFIX_BLOCK_KEY if approximate else PREFIX_BLOCK_KEY) + chain_key


def is_prefix_block_key(key: str) -> bool:
    """Any prefix-cache block, exact or approximate."""
    return key.startswith(PREFIX_BLOCK_KEY)


def is_approximate_prefix_block_key(key: str) -> bool:
    return key.startswith(APPROXIMATE_PREFIX_BLOCK_KEY)
