"""One chunk's entry in the store, as :class:`~cacheblend_rag.store.chunk_cache.ChunkCache` reads and writes it.

:class:`ChunkStoreIO`, a base of the cache, holds the round trip of an entry: its key, its manifest
and layers read and checked (:class:`~cacheblend_rag.store.entries.EntryRules`), and its write in the
codec it is stored in (layers first, the manifest last). What a failure does (a miss, a warning
at most once a minute, a damaged entry removed and counted) is the cache's, which these methods
call; serving a blend and precomputing chunks are in :mod:`~cacheblend_rag.store.chunk_cache` and
:mod:`~cacheblend_rag.store.chunk_warm`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

from cacheblend_rag.kv.segments import ChunkKV
from cacheblend_rag.store.backends.base import KVStore
from cacheblend_rag.store.format.codec import Codec, float_codec
from cacheblend_rag.store.format.entries import EntryRules
from cacheblend_rag.store.errors import CorruptEntryError, StoreError, read_failure
from cacheblend_rag.store.format.chunk_bytes import ForeignKeyEntryError, Manifest, Tagger, encode_layer, encode_manifest, value_digest
from cacheblend_rag.store.format.keys import chunk_key

_FLOAT16_MAX = 65504.0


class ChunkStoreIO:
    """The store reads and writes of a :class:`~cacheblend_rag.store.chunk_cache.ChunkCache`, a base of it.

    The cache sets the attributes below and reports failures for these methods: ``_warn`` (the store
    failed), ``_discard`` (a damaged entry) and ``_skip_foreign`` (an entry under another store key, or none
    where this cache has one, or one where it has none: not used, never deleted).
    """

    engine: Any
    store: KVStore
    codec: Codec | None
    tagger: Tagger
    rules: EntryRules
    prefix_ids: tuple[int, ...]
    salt: str = ""  # a namespace of its own (a request's cache_salt): ChunkCache.salted

    # ----------------------------------------------------------------- keys
    def key_for(self, token_ids: Sequence[int], prefix_ids: Sequence[int] | None = None, engine: Any = None, *,
                fingerprint: str | None = None) -> str:
        """The store key of a chunk; pass ``fingerprint`` when keying many chunks of one request."""
        prefix = self.prefix_ids if prefix_ids is None else tuple(prefix_ids)
        tag = self.codec.tag if self.codec is not None else ""
        fingerprint = fingerprint or (engine or self.engine).fingerprint
        if self.salt:  # another salt's key is another key: salted requests share no chunk K/V
            fingerprint = f"{fingerprint}\x00salt={self.salt}"
        return chunk_key(fingerprint, token_ids, prefix, codec_tag=tag)

    def contains(self, token_ids: Sequence[int], prefix_ids: Sequence[int] | None = None, *,
                 fingerprint: str | None = None) -> bool:
        key = self.key_for(token_ids, prefix_ids, fingerprint=fingerprint)
        try:
            return self.store.contains(key)
        except CorruptEntryError as exc:  # a foreign value under the key: not a chunk, and in the way
            self._discard(key, exc)
            return False
        except (StoreError, OSError) as exc:
            self._warn("read", exc)
            return False

    # ---------------------------------------------------------------- reads
    def _fetch_manifests(self, keys: Sequence[str],
                         errors: list[str] | None = None) -> list[bytes | CorruptEntryError | None]:
        """The manifests under ``keys`` (``None``: absent, or the store failed: then what failed is added to
        ``errors``, the request's own list, for its ``store_error``)."""
        if not keys:
            return []
        try:
            return list(self.store.get_manifests(keys))
        except CorruptEntryError:
            pass  # one value the backend refused to load (say, a pickle); find out which
        except (StoreError, OSError) as exc:
            self._warn("read", exc)
            if errors is not None:
                errors.append(read_failure(exc, self.store))
            return [None] * len(keys)
        out: list[bytes | CorruptEntryError | None] = []
        for key in keys:
            try:
                out.append(self.store.get_manifest(key))
            except CorruptEntryError as exc:
                out.append(exc)
            except (StoreError, OSError) as exc:
                self._warn("read", exc)
                if errors is not None:
                    errors.append(read_failure(exc, self.store))
                out.append(None)
        return out

    def _valid_manifest(self, key: str, data: Any, num_tokens: int) -> Manifest | None:
        """The manifest if it passes :class:`EntryRules`; a damaged one is removed and counted, a foreign one (another
        store key's) skipped and counted."""
        if data is None:
            return None
        try:
            if isinstance(data, CorruptEntryError):
                raise data
            return self.rules.manifest(data, key, num_tokens)
        except ForeignKeyEntryError as exc:
            self._skip_foreign(key, exc)
        except CorruptEntryError as exc:
            self._discard(key, exc)
        return None

    def load(self, token_ids: Sequence[int], prefix_ids: Sequence[int] | None = None) -> ChunkKV | None:
        """The whole stored chunk in the engine's dtype, or ``None`` if absent (or found damaged)."""
        prefix = self.prefix_ids if prefix_ids is None else tuple(int(t) for t in prefix_ids)
        ids = tuple(int(t) for t in token_ids)
        key = self.key_for(ids, prefix)
        manifest = self._valid_manifest(key, self._fetch_manifests([key])[0], len(ids))
        if manifest is None:
            return None
        layers = self._read_layers(key, manifest, range(manifest.num_layers))
        if layers is None:
            return None
        keys = [k.to(self.engine.device, copy=True) for k, _ in layers]
        values = [v.to(self.engine.device, copy=True) for _, v in layers]
        return ChunkKV(ids, keys, values, prefix, self.engine.fingerprint)

    def _read_layers(self, key: str, manifest: Manifest,
                     layers: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """K and V of the stored chunk's ``layers``, verified, in the engine's dtype on the host (views over the
        bytes read where no conversion is needed); ``None`` if the store fails or the entry is damaged (which
        is then removed and counted)."""
        out = []
        try:
            blobs = self.store.get_layers([(key, manifest.write_id, i) for i in layers]) if layers else []
            for i, blob in zip(layers, blobs):
                if isinstance(blob, CorruptEntryError):
                    raise blob
                out.append(self.rules.layer(blob, manifest, i).unpacked(self.engine.dtype))
        except CorruptEntryError as exc:
            self._discard(key, exc)
            return None
        except (StoreError, OSError) as exc:
            self._warn("read", exc)
            return None
        return out

    # --------------------------------------------------------------- writes
    def codec_for(self, chunk: ChunkKV, *, lossless: bool = False) -> Codec:
        """The codec ``chunk`` is stored in: this cache's, or for ``"auto"`` the model's 16-bit dtype
        (float16 for a float32 model, bfloat16 if a value is beyond float16's range); with
        ``lossless``, the model's own dtype."""
        dtype = chunk.keys[0].dtype
        if lossless:
            return float_codec(dtype)
        if self.codec is not None:
            return self.codec
        if dtype in (torch.float16, torch.bfloat16):
            return float_codec(dtype)
        peak = max(float(t.abs().max()) for t in (*chunk.keys, *chunk.values) if t.numel())
        return float_codec(torch.float16 if peak <= _FLOAT16_MAX else torch.bfloat16)

    def put(self, chunk: ChunkKV, key: str | None = None, *, lossless: bool = False) -> int:
        """Write one chunk now; returns the bytes written (0 if it was already there). ``lossless``
        stores it in the model's own dtype, whatever this cache's codec (see :meth:`warm`).

        Layers go first, the manifest last. If writing fails, this write's layers are
        removed again (best effort) and :class:`StoreError` is raised; the chunk stays absent.
        """
        key = key or self.key_for(chunk.token_ids, chunk.prefix_ids)
        codec = self.codec_for(chunk, lossless=lossless)
        write_id = os.urandom(8).hex()
        digests, nbytes, written = [], 0, 0
        try:
            for layer, (k, v) in enumerate(zip(chunk.keys, chunk.values)):
                blob = encode_layer(k, v, codec, self.tagger)
                self.store.put_layer(key, write_id, layer, blob)
                written = layer + 1
                digests.append(value_digest(blob))
                nbytes += len(blob)
            kv_heads, num_tokens, head_dim = chunk.keys[0].shape
            manifest = Manifest(key=key, write_id=write_id, num_layers=chunk.num_layers, num_tokens=num_tokens,
                                kv_heads=kv_heads, head_dim=head_dim, codec=codec.name, group=codec.group,
                                layer_digests=tuple(digests), nbytes=nbytes, created=time.time())
            won = self.store.add_manifest(key, encode_manifest(manifest, self.tagger))
        except BaseException:
            self._forget_layers(key, write_id, written)
            raise
        if not won:  # another writer completed the same chunk first; its entry stands
            self._forget_layers(key, write_id, written)
            return 0
        return nbytes

    def _forget_layers(self, key: str, write_id: str, num_layers: int) -> None:
        try:
            self.store.delete_layers(key, write_id, num_layers)
        except (StoreError, OSError):
            pass  # the store is failing anyway; orphaned layers are never read and get evicted

    def _write_logged(self, key: str, chunk: ChunkKV, lossless: bool = False) -> int | None:
        try:
            return self.put(chunk, key, lossless=lossless)
        except (StoreError, OSError) as exc:
            self._warn("write", exc)
            return None

    def _record(self, **counts: int) -> None:
        try:
            self.store.record(**counts)
        except (StoreError, OSError) as exc:
            self._warn("write", exc)
