"""The byte format of stored chunk KV: one self-describing, tagged value per layer, plus a manifest.

A **layer value** holds K and V of one layer of one chunk, each ``[kv_heads, tokens, head_dim]``,
in a codec (:mod:`cacheblend_rag.store.format.codec`: float32, float16, bfloat16, int8, int4)::

    offset  size   field
    0       4      magic b"CBKV"
    4       2      format version (little-endian u16)
    6       1      codec code
    7       1      flags (bit 0: the tag is a keyed MAC)
    8       2      group size (quantized codecs; 0 otherwise)
    10      2      reserved, 0
    12      12     kv_heads, tokens, head_dim (u32 each)
    24      8      payload length in bytes (u64)
    32      ...    payload: the codec's tensors, in order, C order, little-endian
    ...     16|32  tag: XXH3-128 of everything before it, or HMAC-SHA256 keyed by the store key

A **manifest** says a chunk is complete. Writers store it last, so a reader that finds a
manifest finds every layer it names (unless the layers were evicted or damaged since, which
the loader detects through the tags the manifest records)::

    b"CBKM", version (u16), flags (u8), reserved (u8), JSON length (u32), key id (8 bytes), UTF-8 JSON, tag

The **key id** names the store key the manifest's MAC is keyed by (:attr:`Tagger.key_id`: 8 bytes of an
HMAC of a fixed label under the key, never the key), zeros for a checksum. It tells a reader whose entry
it is before any tag is checked: an entry under another key, or written without one where this reader
has one, or with one where it has none, is *foreign* (:class:`ForeignKeyEntryError`): not used, and not
damage either, so never deleted. Only what the reader can prove damaged is: a checksum that fails, a
MAC under its own key id that fails, a header, size or JSON no writer makes. Layers need no key id: a
reader reads only the layers its own (checked) manifest names by their tags.

Without a store key the tag detects damage (torn writes, bit rot, truncation), not forgery:
whoever can write the store can write a consistent value. With a key (authenticated mode,
:class:`Tagger`) every tag is an HMAC-SHA256 over the value, and a manifest's MAC covers the
MAC of each of its layers, so no one without the key can make an entry a reader accepts. XXH3
checks at about 10 GB/s on the machine docs/performance.md reports from, SHA-256 at about 1 GB/s
(with the CPU's SHA extensions), which is why the keyed MAC is a choice, not the default.

Decoding never unpickles, never trusts a length it has not checked against the data, and
accepts only ``bytes``-like values: anything else (another type, a short or padded value, a
wrong magic, version, codec or tag, a manifest whose JSON is too large, too deep or not the
expected fields, non-finite floats) raises :class:`CorruptEntryError` and nothing else.
Version 2 values (16 and 32 bits, no codec byte) read as "format version 2" and are recomputed.
Version 4 added the key id. The version is part of every chunk key (:mod:`~cacheblend_rag.store.format.keys`), so
entries of an older version are never looked up: they stay until evicted, expired or cleared.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import xxhash

from cacheblend_rag.store.format.codec import Codec, PackedLayer, codec_for_code
from cacheblend_rag.store.errors import CorruptEntryError

FORMAT_VERSION = 4

LAYER_MAGIC = b"CBKV"
MANIFEST_MAGIC = b"CBKM"
CHECKSUM_SIZE = 16
MAC_SIZE = 32
FLAG_MAC = 1
MAX_MANIFEST_JSON = 1 << 20  # bytes; a manifest of 1,000 layers is about 40 KB
MAX_JSON_DEPTH = 2  # a manifest is an object holding one list of strings
KEY_ID_SIZE = 8
NO_KEY_ID = bytes(KEY_ID_SIZE)  # a checksummed entry's
_KEY_ID_LABEL = b"cacheblend-rag/store-key-id"

_LAYER_HEAD = struct.Struct("<4sHBBHHIIIQ")  # magic, version, codec, flags, group, reserved, h, n, d, payload length
_MANIFEST_HEAD = struct.Struct("<4sHBBI8s")  # magic, version, flags, reserved, JSON length, key id
# No manifest value is larger: what a reader may be handed whole (a Redis store refuses larger ones unread).
MAX_MANIFEST_BYTES = _MANIFEST_HEAD.size + MAX_MANIFEST_JSON + MAC_SIZE
BytesLike = (bytes, bytearray, memoryview)


class Tagger:
    """What ends every value: an XXH3-128 checksum (no key), or an HMAC-SHA256 keyed by ``key``."""

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and (not isinstance(key, (bytes, bytearray)) or len(key) < 16):
            raise ValueError("the store key must be at least 16 bytes")
        self._key = bytes(key) if key is not None else None
        self.key_id = hmac.new(self._key, _KEY_ID_LABEL, hashlib.sha256).digest()[:KEY_ID_SIZE] \
            if self._key is not None else NO_KEY_ID

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    @property
    def size(self) -> int:
        return MAC_SIZE if self._key is not None else CHECKSUM_SIZE

    @property
    def flags(self) -> int:
        return FLAG_MAC if self._key is not None else 0

    def tag(self, parts: Sequence[bytes | memoryview]) -> bytes:
        h: Any  # an XXH3-128 or an HMAC: both take update() and give digest()
        if self._key is None:
            h = xxhash.xxh3_128()
        else:
            h = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()

    def check(self, body: memoryview, tag: memoryview, flags: int, what: str) -> None:
        """Raise :class:`CorruptEntryError` unless ``tag`` is this tagger's tag of ``body``: a layer, which its
        manifest (checked first, under this reader's key) names, so any other tag is damage."""
        if bool(flags & FLAG_MAC) != self.authenticated:
            raise CorruptEntryError(f"{what} carries {'a MAC' if flags & FLAG_MAC else 'no MAC'}, and this "
                                    f"reader's entries {'have one' if self.authenticated else 'do not (no store key)'}")
        if not hmac.compare_digest(self.tag([body]), bytes(tag)):
            raise CorruptEntryError(f"{what} fails its {'MAC' if self.authenticated else 'checksum'}")

    def check_manifest(self, body: memoryview, tag: memoryview, flags: int,
                       key_id: bytes) -> ForeignKeyEntryError | None:
        """Check a manifest's tag as far as this reader can. Raises :class:`CorruptEntryError` for what it
        proves damaged; returns the :class:`ForeignKeyEntryError` to raise, once the manifest's fields are
        checked too, for an entry that is someone else's (another key, or none, or one where it has none)."""
        keyed = bool(flags & FLAG_MAC)
        if keyed != (key_id != NO_KEY_ID):
            raise CorruptEntryError(f"manifest carries {'a MAC' if keyed else 'a checksum'} and key id "
                                    f"{key_id.hex()}: no writer makes that")
        mine = self.key_id.hex() if self.authenticated else "none: it has no store key"
        if keyed and key_id != self.key_id:
            kind = ForeignKeyEntryError if self.authenticated else UnauthenticatedReaderError
            return kind(f"manifest is authenticated under store key id {key_id.hex()}; this reader's is {mine}",
                        key_id.hex())
        expected = self.tag([body]) if keyed else xxhash.xxh3_128_digest(body)
        if not hmac.compare_digest(expected, bytes(tag)):
            raise CorruptEntryError(f"manifest fails its {'MAC' if keyed else 'checksum'}")
        if not keyed and self.authenticated:
            return ForeignKeyEntryError(f"manifest was written without a store key (a checksum, no MAC); this "
                                        f"reader uses only entries under its own (key id {mine})", "")
        return None


class ForeignKeyEntryError(CorruptEntryError):
    """An entry written under another store key than this reader's (or none where it has one, or one where
    it has none), intact as far as this reader can tell. It cannot be checked, so it is not used (a miss,
    computed fresh, counted as ``foreign_key_entries``), but it is not damage either: it is never deleted.
    ``key_id`` is the entry's key id in hex (``""``: written without a key)."""

    def __init__(self, message: str, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


class UnauthenticatedReaderError(ForeignKeyEntryError):
    """An authenticated entry met a reader without the store key (a :class:`ForeignKeyEntryError`)."""


def _view(data: Any, what: str) -> memoryview:
    if not isinstance(data, BytesLike):
        raise CorruptEntryError(f"{what} is a {type(data).__name__}, not bytes (another program wrote it?)")
    view = memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def value_digest(data: bytes | memoryview) -> str:
    """The tag a value ends with, as hex (what a manifest records per layer). The tag's size is read
    from the value's own header, so a value too short to have one gives ``""``."""
    view = _view(data, "value")
    if len(view) < 8:
        return ""
    size = MAC_SIZE if view[7] & FLAG_MAC else CHECKSUM_SIZE
    return bytes(view[-size:]).hex() if len(view) >= size else ""


# ------------------------------------------------------------------ layers
def encode_layer(keys: torch.Tensor, values: torch.Tensor, codec: Codec, tagger: Tagger | None = None) -> bytes:
    """One layer of one chunk: ``keys`` and ``values`` are ``[kv_heads, tokens, head_dim]``."""
    if keys.shape != values.shape or keys.dim() != 3:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be [kv_heads, tokens, head_dim]")
    tagger = tagger or Tagger()
    parts = codec.pack(keys, values)
    payloads = [p.reshape(-1).view(torch.uint8).numpy().data if p.numel() else b"" for p in parts]
    nbytes = sum(len(p) for p in payloads)
    h, n, d = keys.shape
    header = _LAYER_HEAD.pack(LAYER_MAGIC, FORMAT_VERSION, codec.code, tagger.flags, codec.group, 0, h, n, d, nbytes)
    return b"".join([header, *payloads, tagger.tag([header, *payloads])])


def decode_layer(
    data: Any, expected_shape: tuple[int, int, int] | None = None, *, tagger: Tagger | None = None,
    codec: Codec | None = None,
) -> PackedLayer:
    """The layer in ``data``, as tensors over its bytes (no copy; ``.unpacked(dtype)`` gives K and V).

    ``expected_shape`` is ``(kv_heads, tokens, head_dim)`` and ``codec`` the codec the manifest
    names; anything else is :class:`CorruptEntryError`."""
    tagger = tagger or Tagger()
    view = _view(data, "layer value")
    if len(view) < _LAYER_HEAD.size + tagger.size:
        raise CorruptEntryError(f"layer value is truncated: {len(view)} bytes is shorter than any header")
    magic, version, code, flags, group, _, h, n, d, nbytes = _LAYER_HEAD.unpack_from(view, 0)
    if magic != LAYER_MAGIC:
        raise CorruptEntryError(f"layer value has magic {bytes(magic)!r}, expected {LAYER_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"layer value has format version {version}, this code reads {FORMAT_VERSION}")
    tag_size = MAC_SIZE if flags & FLAG_MAC else CHECKSUM_SIZE
    if len(view) != _LAYER_HEAD.size + nbytes + tag_size:
        raise CorruptEntryError(f"layer value has {len(view)} bytes, its header says "
                                f"{_LAYER_HEAD.size + nbytes + tag_size} (truncated or padded)")
    body = view[: _LAYER_HEAD.size + nbytes]
    tagger.check(body, view[_LAYER_HEAD.size + nbytes :], flags, "layer value")
    try:
        found = codec_for_code(code, group)
    except KeyError:
        raise CorruptEntryError(f"layer value has unknown codec code {code}") from None
    if codec is not None and found != codec:
        raise CorruptEntryError(f"layer value is stored as {found!r}, its manifest says {codec!r}")
    if expected_shape is not None and (h, n, d) != tuple(expected_shape):
        raise CorruptEntryError(f"layer value has shape {(h, n, d)}, the manifest says {tuple(expected_shape)}")
    if min(h, n, d) < 1 or found.payload_bytes((h, n, d)) != nbytes:
        raise CorruptEntryError(f"layer value shape {(h, n, d)} in {found!r} does not match its payload of {nbytes} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": the reader only reads
        packed = found.unpack(view[_LAYER_HEAD.size : _LAYER_HEAD.size + nbytes], (h, n, d))
    if not packed.finite:
        raise CorruptEntryError("layer value holds NaN or infinite numbers")
    return packed


# --------------------------------------------------------------- manifests
@dataclass(frozen=True)
class Manifest:
    """What a complete chunk entry holds; written after all of its layers."""

    key: str
    write_id: str  # names this write's layer values, so concurrent writers never mix layers
    num_layers: int
    num_tokens: int
    kv_heads: int
    head_dim: int
    codec: str  # codec name
    group: int  # codec group size (0 for the float codecs)
    layer_digests: tuple[str, ...]  # each layer value's tag, hex
    nbytes: int  # total bytes of the layer values
    created: float

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.kv_heads, self.num_tokens, self.head_dim)


_MANIFEST_TYPES: dict[str, type] = {
    "key": str, "write_id": str, "num_layers": int, "num_tokens": int, "kv_heads": int, "head_dim": int,
    "codec": str, "group": int, "layer_digests": list, "nbytes": int, "created": float,
}


def encode_manifest(manifest: Manifest, tagger: Tagger | None = None) -> bytes:
    tagger = tagger or Tagger()
    fields = asdict(manifest)
    fields["layer_digests"] = list(manifest.layer_digests)
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    body = _MANIFEST_HEAD.pack(MANIFEST_MAGIC, FORMAT_VERSION, tagger.flags, 0, len(payload), tagger.key_id) + payload
    return body + tagger.tag([body])


def _json_depth(text: bytes) -> int:
    """Nesting depth of the JSON ``text`` (brackets outside strings), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def decode_manifest(data: Any, expected_key: str | None = None, *, tagger: Tagger | None = None) -> Manifest:
    """The manifest in ``data``; raises :class:`CorruptEntryError` for anything malformed, and
    :class:`ForeignKeyEntryError` for a well-formed entry under another store key (module docstring)."""
    tagger = tagger or Tagger()
    view, flags, key_id, text = _manifest_parts(data)
    tag_size = MAC_SIZE if flags & FLAG_MAC else CHECKSUM_SIZE
    tag_start = len(view) - tag_size
    foreign = tagger.check_manifest(view[:tag_start], view[tag_start:], flags, key_id)
    # The fields are checked even for a foreign entry (bounded JSON: as peek_manifest reads it): one no writer
    # makes is damage whoever's key it claims, and is deleted.
    manifest = _manifest_from(_parse_json(text), expected_key, tag_size)
    if foreign is not None:
        raise foreign
    return manifest


def peek_manifest(data: Any) -> Manifest:
    """The manifest in ``data`` without checking its tag: for a writer reading back what it just
    wrote, and for inventories (``cache stats``) that use nothing but its sizes and codec."""
    view, flags, _, text = _manifest_parts(data)
    return _manifest_from(_parse_json(text), None, MAC_SIZE if flags & FLAG_MAC else CHECKSUM_SIZE)


def _manifest_parts(data: Any) -> tuple[memoryview, int, bytes, bytes]:
    view = _view(data, "manifest")
    if len(view) < _MANIFEST_HEAD.size + CHECKSUM_SIZE:
        raise CorruptEntryError(f"manifest is truncated: {len(view)} bytes")
    magic, version, flags, _, length, key_id = _MANIFEST_HEAD.unpack_from(view, 0)
    if magic != MANIFEST_MAGIC:
        raise CorruptEntryError(f"manifest has magic {bytes(magic)!r}, expected {MANIFEST_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"manifest has format version {version}, this code reads {FORMAT_VERSION}")
    if length > MAX_MANIFEST_JSON:
        raise CorruptEntryError(f"manifest claims {length} bytes of JSON, more than any manifest ({MAX_MANIFEST_JSON})")
    tag_size = MAC_SIZE if flags & FLAG_MAC else CHECKSUM_SIZE
    if len(view) != _MANIFEST_HEAD.size + length + tag_size:
        raise CorruptEntryError("manifest length does not match its header (truncated or padded)")
    return view, flags, bytes(key_id), bytes(view[_MANIFEST_HEAD.size : _MANIFEST_HEAD.size + length])


def _parse_json(text: bytes) -> Any:
    if _json_depth(text) > MAX_JSON_DEPTH:
        raise CorruptEntryError("manifest JSON is nested deeper than any manifest")
    try:
        return json.loads(text.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptEntryError(f"manifest is not valid JSON: {exc}") from None


def _manifest_from(fields: Any, expected_key: str | None, tag_size: int) -> Manifest:
    if not isinstance(fields, dict) or set(fields) != set(_MANIFEST_TYPES):
        raise CorruptEntryError("manifest does not have the expected fields")
    for name, kind in _MANIFEST_TYPES.items():
        value = fields[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = fields[name] = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorruptEntryError(f"manifest field {name!r} is not a {kind.__name__}")
    manifest = Manifest(**{**fields, "layer_digests": tuple(fields["layer_digests"])})
    if any(v < 1 for v in (manifest.num_layers, manifest.num_tokens, manifest.kv_heads, manifest.head_dim)):
        raise CorruptEntryError("manifest has a non-positive size")
    if any(v > 1 << 24 for v in (manifest.num_layers, manifest.num_tokens, manifest.kv_heads, manifest.head_dim)):
        raise CorruptEntryError("manifest has a size no model has")
    digest_chars = 2 * tag_size
    if len(manifest.layer_digests) != manifest.num_layers or not all(
        isinstance(d, str) and len(d) == digest_chars for d in manifest.layer_digests
    ):
        raise CorruptEntryError("manifest does not list one tag per layer")
    if not math.isfinite(manifest.created):
        raise CorruptEntryError("manifest has a non-finite creation time")
    if expected_key is not None and manifest.key != expected_key:
        raise CorruptEntryError(f"manifest belongs to key {manifest.key[:16]}..., found under {expected_key[:16]}...")
    return manifest
