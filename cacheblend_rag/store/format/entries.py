"""The one path every value read from a store takes before it is used.

Whatever the backend (memory, disk, Redis, tiers of them) and whoever reads (a blend's
pipelined loader, :meth:`ChunkCache.load`), a manifest and each of its layers pass
:class:`EntryRules`: the value is bytes, of a size the model allows, carries the right tag
(checksum, or MAC in authenticated mode), decodes within bounded JSON, names this key, this
model's shapes and an acceptable codec, and holds only finite numbers. Anything else is a
:class:`~cacheblend_rag.store.errors.CorruptEntryError`, which the chunk cache logs, counts,
deletes and answers by computing the chunk afresh; no request fails because of what a store holds.
"""

from __future__ import annotations

from typing import Any

from cacheblend_rag.store.format.codec import Codec, PackedLayer, codec_for_name
from cacheblend_rag.store.errors import CorruptEntryError
from cacheblend_rag.store.format.chunk_bytes import (
    CHECKSUM_SIZE,
    MAC_SIZE,
    Manifest,
    Tagger,
    decode_layer,
    decode_manifest,
    value_digest,
)

_LAYER_OVERHEAD = 32 + MAC_SIZE  # header and the larger tag


def _codec_of(manifest: Manifest) -> Codec:
    try:
        return codec_for_name(manifest.codec, manifest.group)
    except KeyError:
        raise CorruptEntryError(f"manifest names an unknown codec {manifest.codec!r}") from None


class EntryRules:
    """What a store entry must be for ``engine``: its shapes, the codecs this cache accepts
    (any lossless float codec, and ``codec`` for a quantized cache) and its tags."""

    def __init__(self, engine: Any, codec: Codec | None, tagger: Tagger) -> None:
        adapter = engine.adapter
        self.num_layers = engine.num_layers
        self.kv_heads, self.head_dim = adapter.num_kv_heads, adapter.head_dim
        self.max_tokens = engine.context_window
        self.codec = codec
        self.tagger = tagger

    @property
    def max_value_bytes(self) -> int:
        """No layer value of this model is larger: the longest chunk, stored at 32 bits."""
        return 2 * self.kv_heads * self.max_tokens * self.head_dim * 4 + _LAYER_OVERHEAD

    def manifest(self, data: Any, key: str, num_tokens: int) -> Manifest:
        manifest = decode_manifest(data, expected_key=key, tagger=self.tagger)
        expected = (self.num_layers, num_tokens, self.kv_heads, self.head_dim)
        got = (manifest.num_layers, manifest.num_tokens, manifest.kv_heads, manifest.head_dim)
        if got != expected:
            raise CorruptEntryError(f"manifest describes (layers, tokens, kv_heads, head_dim)={got}, "
                                    f"this model and chunk need {expected}")
        codec = _codec_of(manifest)
        # A lossless codec is always acceptable (a lead stored at the model's own dtype, say); a lossy
        # one only under the key of exactly that codec.
        if codec.lossy and codec != self.codec:
            raise CorruptEntryError(f"manifest names codec {codec!r}, this cache stores {self.codec or 'lossless floats'!r}")
        tag = MAC_SIZE if self.tagger.authenticated else CHECKSUM_SIZE
        if manifest.nbytes != self.num_layers * (32 + codec.payload_bytes(manifest.layer_shape) + tag):
            raise CorruptEntryError(f"manifest counts {manifest.nbytes} bytes of layers, its shapes and codec make "
                                    f"{self.num_layers * (32 + codec.payload_bytes(manifest.layer_shape) + tag)}")
        return manifest

    def layer(self, data: Any, manifest: Manifest, index: int) -> PackedLayer:
        if data is None:
            raise MissingLayerError(f"layer {index} is missing")
        if value_digest(data) != manifest.layer_digests[index]:
            raise CorruptEntryError(f"layer {index} is not the value its manifest names")
        return decode_layer(data, manifest.layer_shape, tagger=self.tagger, codec=_codec_of(manifest))


class MissingLayerError(CorruptEntryError):
    """A layer a manifest names is gone: evicted since the manifest was read (or deleted by hand).
    Not damage: the chunk is recomputed and written again, quietly, and counted as an eviction."""
