"""What a store holds, by codec: entries, tokens, bytes, and bytes per token (``cache stats``); prefix-cache
blocks (:mod:`cacheblend_rag.store.prefix_blocks`) apart from chunks, approximate ones apart from exact ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cacheblend_rag.store.backends.base import KVStore
from cacheblend_rag.store.errors import CorruptEntryError
from cacheblend_rag.store.format.chunk_bytes import peek_manifest
from cacheblend_rag.store.format.keys import is_approximate_prefix_block_key, is_prefix_block_key


@dataclass
class CodecShare:
    entries: int = 0
    tokens: int = 0
    bytes: int = 0  # layer values, as their manifests count them

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": round(self.bytes_per_token, 1)}


def inventory(store: KVStore) -> dict[str, CodecShare]:
    """Chunks of ``store`` grouped by codec (``"int8 (group 64)"``; ``"unreadable"`` for manifests that
    do not parse), prefix-cache blocks as ``"prefix blocks, <codec>"`` (approximate ones as
    ``"prefix blocks (approximate), <codec>"``). Reads every manifest once; tags
    are not checked (nothing here is used to answer)."""
    shares: dict[str, CodecShare] = {}
    for key, data in store.manifests():
        try:
            if isinstance(data, CorruptEntryError):
                raise data
            manifest = peek_manifest(data)
            label = manifest.codec + (f" (group {manifest.group})" if manifest.group else "")
            if is_approximate_prefix_block_key(key):  # an earlier blend's K/V, never read as exact
                label = f"prefix blocks (approximate), {label}"
            elif is_prefix_block_key(key):
                label = f"prefix blocks, {label}"
        except CorruptEntryError:
            shares.setdefault("unreadable", CodecShare()).entries += 1
            continue
        share = shares.setdefault(label, CodecShare())
        share.entries += 1
        share.tokens += manifest.num_tokens
        share.bytes += manifest.nbytes
    return dict(sorted(shares.items()))
