"""Prefix-cache blocks in a KV store, so replicas sharing the store share prompt prefixes.

A block (:mod:`cacheblend_rag.reuse.prefix_cache`) is stored as a chunk entry is: one value per
layer holding its keys (rotated, as the prefix cache keeps them) and values, in the store's safe
format (:mod:`cacheblend_rag.store.format.chunk_bytes`: bounded, tagged, never unpickled, MAC'd in
authenticated mode), and a manifest written last. Blocks are always stored losslessly, in the
model's own dtype: a prefix is reused as exact K/V, and rounded K/V would not be.

Store keys are ``prefix-`` and the block's chain key (SHA-256 of the fingerprint, the parent's key
and the block's token ids), so a block entry is never taken for a chunk entry, and ``cache stats``
counts blocks apart. An approximate block (an earlier blend's K/V,
:mod:`~cacheblend_rag.reuse.prefix_cache`) is stored under ``prefix-approx-`` and its chain key:
the flag is the entry's name, which its manifest carries under its checksum or MAC, and a reader
checks the manifest's key against the name it asked for. So an entry is only read as exact under
the exact name it was written to; an approximate one copied or renamed there fails that check (it
is counted ``corrupt`` and deleted), and one that cannot be verified is never used. Exact and
approximate versions of a block are separate entries; an exact reader asks for the exact one only,
a reader that allows approximate K/V takes the exact one where both are valid. Reads go through :class:`~cacheblend_rag.store.entries.EntryRules`, the one
validation path of the chunk cache: a damaged entry is logged, counted as ``corrupt`` and deleted,
and the prefix the reader gets stops before it, so the request computes those tokens afresh
(and writes the block again). Writes run on the chunk cache's writer thread.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cacheblend_rag.kv.segments import ChunkKV
from cacheblend_rag.store.chunk_cache import ChunkCache
from cacheblend_rag.store.format.codec import codec_for_name
from cacheblend_rag.store.errors import CorruptEntryError, StoreError
from cacheblend_rag.store.format.chunk_bytes import Manifest
from cacheblend_rag.store.format.keys import APPROXIMATE_PREFIX_BLOCK_KEY as APPROXIMATE_BLOCK_KEY_PREFIX
from cacheblend_rag.store.format.keys import PREFIX_BLOCK_KEY as BLOCK_KEY_PREFIX
from cacheblend_rag.store.format.keys import prefix_block_key


class StorePrefixBlocks:
    """A :class:`~cacheblend_rag.reuse.prefix_cache.PrefixBlockStore` over ``chunk_cache``'s store,
    its validation rules, its tags (checksum or MAC) and its writer thread."""

    def __init__(self, chunk_cache: ChunkCache) -> None:
        self.cache = chunk_cache

    def load_blocks(self, keys: Sequence[str], block_size: int, *,
                    approximate: bool = False) -> list[tuple[torch.Tensor, bool]]:
        cache, engine = self.cache, self.cache.engine
        kinds = (False, True) if approximate else (False,)
        names = [[prefix_block_key(key, approximate=flag) for flag in kinds] for key in keys]
        fetched = cache._fetch_manifests([name for per_key in names for name in per_key])
        plans: list[tuple[str, Manifest, bool]] = []
        for index, per_key in enumerate(names):
            plan = None
            for j, (name, flag) in enumerate(zip(per_key, kinds)):  # the exact entry first
                manifest = cache._valid_manifest(name, fetched[index * len(kinds) + j], block_size)  # damaged: removed
                if manifest is not None and codec_for_name(manifest.codec, manifest.group).exact_for(engine.dtype):
                    plan = (name, manifest, flag)
                    break
            if plan is None:
                break
            plans.append(plan)
        if not plans:
            return []
        try:
            blobs = cache.store.get_layers([(name, m.write_id, i) for name, m, _ in plans for i in range(m.num_layers)])
        except (StoreError, OSError) as exc:
            cache._warn("read", exc)
            return []
        blocks: list[tuple[torch.Tensor, bool]] = []
        layers = engine.num_layers
        for index, (name, manifest, flag) in enumerate(plans):
            try:
                block = self._decode(blobs[index * layers : (index + 1) * layers], manifest)
            except CorruptEntryError as exc:
                cache._discard(name, exc)
                break
            blocks.append((block, flag))
        return blocks

    def _decode(self, blobs: Sequence[object], manifest: Manifest) -> torch.Tensor:
        engine = self.cache.engine
        parts = []
        for layer, blob in enumerate(blobs):
            if isinstance(blob, CorruptEntryError):
                raise blob
            k, v = self.cache.rules.layer(blob, manifest, layer).unpacked(engine.dtype)
            parts.append(torch.stack([k, v]))
        return torch.stack(parts).to(engine.device)

    def save_block(self, key: str, token_ids: Sequence[int], kv: torch.Tensor, *, approximate: bool = False) -> None:
        cache = self.cache
        if cache.closed or not cache.write_back:
            return
        block = ChunkKV(tuple(token_ids), [kv[layer, 0] for layer in range(kv.shape[0])],
                        [kv[layer, 1] for layer in range(kv.shape[0])], approximate=approximate)
        cache._submit_write_back(prefix_block_key(key, approximate=approximate), block, True)


__all__ = ["APPROXIMATE_BLOCK_KEY_PREFIX", "BLOCK_KEY_PREFIX", "StorePrefixBlocks"]
