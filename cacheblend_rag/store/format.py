"""The byte format of stored chunk KV: one self-describing, checksummed value per layer, plus a manifest.

A **layer value** holds K and V of one layer of one chunk as one tensor ``[2, kv_heads, n, head_dim]``::

    offset  size       field
    0       4          magic b"CBKV"
    4       2          format version (little-endian u16)
    6       1          dtype code (1 float16, 2 bfloat16, 3 float32)
    7       1          ndim (at most 8)
    8       4 * ndim   shape (u32 each)
    ...     8          payload length in bytes (u64)
    ...     payload    the tensor, C order, little-endian
    ...     16         XXH3-128 of everything before it

A **manifest** says a chunk is complete. Writers store it last, so a reader that finds a
manifest finds every layer it names (unless the layers were evicted or damaged since, which
the loader detects through the layer checksums and the digests the manifest records)::

    b"CBKM", version (u16), JSON length (u32), UTF-8 JSON, XXH3-128 of everything before it

The checksum detects damage (torn writes, bit rot, truncation), not forgery: whoever can write
the store can write a consistent value. XXH3 checks about 25 GB/s where blake2b managed 0.6, which
made hashing a tenth of a blend's time on a CPU. Version 1 used blake2b; its values now read as
"format version 1" and are recomputed.

Decoding never unpickles and never trusts a length it has not checked against the data:
any malformed input raises :class:`CorruptEntryError` and nothing else.
"""

from __future__ import annotations

import json
import warnings
import math
import struct
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import xxhash

from cacheblend_rag.store.errors import CorruptEntryError

FORMAT_VERSION = 2

LAYER_MAGIC = b"CBKV"
MANIFEST_MAGIC = b"CBKM"
DIGEST_SIZE = 16
MAX_NDIM = 8

_DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sHBB")  # magic, version, dtype code, ndim
_LENGTH = struct.Struct("<Q")
_MANIFEST_HEAD = struct.Struct("<4sHI")  # magic, version, JSON length


def _digest(data: memoryview | bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def storable_dtypes() -> tuple[str, ...]:
    return tuple(str(d).removeprefix("torch.") for d in _DTYPE_CODES)


# ----------------------------------------------------------------- tensors
def encode_tensor(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """Bytes of ``tensor`` (converted to ``dtype`` first, if given) in the layer format."""
    return _encode_parts([tensor], tuple(tensor.shape), dtype)


def _encode_parts(parts: Sequence[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None) -> bytes:
    """One value whose payload is ``parts`` laid end to end (as if stacked), without copying them together."""
    dtype = dtype or parts[0].dtype
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"cannot store a {dtype} tensor; storable dtypes are {', '.join(storable_dtypes())}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot store a tensor with {len(shape)} dimensions; at most {MAX_NDIM} are supported")
    payloads = []
    for part in parts:
        t = part.detach().to(dtype).to("cpu").contiguous()
        payloads.append(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    nbytes = sum(len(p) for p in payloads)
    header = _FIXED.pack(LAYER_MAGIC, FORMAT_VERSION, _DTYPE_CODES[dtype], len(shape))
    header += struct.pack(f"<{len(shape)}I", *shape) + _LENGTH.pack(nbytes)
    h = xxhash.xxh3_128(header)
    for p in payloads:
        h.update(p)
    return b"".join([header, *payloads, h.digest()])


def decode_tensor(data: bytes | bytearray | memoryview, *, copy: bool = True) -> torch.Tensor:
    """The tensor stored in ``data``; raises :class:`CorruptEntryError` for anything malformed.

    ``copy=False`` returns a tensor over ``data``'s own memory, which may be read-only: for a
    caller that only reads it (the loader converts or rotates it into the blend's cache)."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    if len(view) < _FIXED.size + _LENGTH.size + DIGEST_SIZE:
        raise CorruptEntryError(f"layer value is truncated: {len(view)} bytes is shorter than any header")
    magic, version, code, ndim = _FIXED.unpack_from(view, 0)
    if magic != LAYER_MAGIC:
        raise CorruptEntryError(f"layer value has magic {bytes(magic)!r}, expected {LAYER_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"layer value has format version {version}, this code reads {FORMAT_VERSION}")
    if code not in _CODE_DTYPES:
        raise CorruptEntryError(f"layer value has unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise CorruptEntryError(f"layer value claims {ndim} dimensions, at most {MAX_NDIM} are valid")
    header_len = _FIXED.size + 4 * ndim + _LENGTH.size
    if len(view) < header_len + DIGEST_SIZE:
        raise CorruptEntryError(f"layer value is truncated: {len(view)} bytes, its header alone needs {header_len}")
    shape = struct.unpack_from(f"<{ndim}I", view, _FIXED.size)
    (nbytes,) = _LENGTH.unpack_from(view, _FIXED.size + 4 * ndim)
    dtype = _CODE_DTYPES[code]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != nbytes:
        raise CorruptEntryError(f"layer value shape {shape} of {dtype} does not match its payload of {nbytes} bytes")
    if len(view) != header_len + nbytes + DIGEST_SIZE:
        raise CorruptEntryError(
            f"layer value has {len(view)} bytes, its header says {header_len + nbytes + DIGEST_SIZE} (truncated or padded)"
        )
    body = view[: header_len + nbytes]
    if _digest(body) != bytes(view[header_len + nbytes :]):
        raise CorruptEntryError("layer value fails its checksum")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    payload = view[header_len : header_len + nbytes]
    if copy:
        return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": the caller only reads
        return torch.frombuffer(payload, dtype=dtype).view(shape)


def value_digest(data: bytes | memoryview) -> str:
    """The checksum a layer value ends with, as hex (what a manifest records per layer)."""
    return bytes(memoryview(data)[-DIGEST_SIZE:]).hex()


# ------------------------------------------------------------------ layers
def encode_layer(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """One layer of one chunk: ``keys`` and ``values`` are ``[kv_heads, n, head_dim]``."""
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the same shape")
    return _encode_parts([keys, values], (2, *keys.shape), dtype)


def decode_layer(
    data: bytes | memoryview, expected_shape: tuple[int, int, int] | None = None, *, copy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of a layer value; ``expected_shape`` is ``(kv_heads, n, head_dim)``.
    ``copy`` as for :func:`decode_tensor`."""
    t = decode_tensor(data, copy=copy)
    if t.dim() != 4 or t.shape[0] != 2:
        raise CorruptEntryError(f"layer value has shape {tuple(t.shape)}, expected [2, kv_heads, n, head_dim]")
    if expected_shape is not None and tuple(t.shape[1:]) != tuple(expected_shape):
        raise CorruptEntryError(f"layer value has shape {tuple(t.shape[1:])}, the manifest says {tuple(expected_shape)}")
    return t[0], t[1]


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
    layer_digests: tuple[str, ...]
    nbytes: int  # total bytes of the layer values
    created: float

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.kv_heads, self.num_tokens, self.head_dim)


_MANIFEST_TYPES: dict[str, type] = {
    "key": str, "write_id": str, "num_layers": int, "num_tokens": int, "kv_heads": int, "head_dim": int,
    "layer_digests": list, "nbytes": int, "created": float,
}


def encode_manifest(manifest: Manifest) -> bytes:
    fields = asdict(manifest)
    fields["layer_digests"] = list(manifest.layer_digests)
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    body = _MANIFEST_HEAD.pack(MANIFEST_MAGIC, FORMAT_VERSION, len(payload)) + payload
    return body + _digest(body)


def decode_manifest(data: bytes | memoryview, expected_key: str | None = None) -> Manifest:
    """The manifest in ``data``; raises :class:`CorruptEntryError` for anything malformed."""
    view = memoryview(data)
    if len(view) < _MANIFEST_HEAD.size + DIGEST_SIZE:
        raise CorruptEntryError(f"manifest is truncated: {len(view)} bytes")
    magic, version, length = _MANIFEST_HEAD.unpack_from(view, 0)
    if magic != MANIFEST_MAGIC:
        raise CorruptEntryError(f"manifest has magic {bytes(magic)!r}, expected {MANIFEST_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"manifest has format version {version}, this code reads {FORMAT_VERSION}")
    if len(view) != _MANIFEST_HEAD.size + length + DIGEST_SIZE:
        raise CorruptEntryError("manifest length does not match its header (truncated or padded)")
    body = view[: _MANIFEST_HEAD.size + length]
    if _digest(body) != bytes(view[-DIGEST_SIZE:]):
        raise CorruptEntryError("manifest fails its checksum")
    try:
        fields: Any = json.loads(bytes(view[_MANIFEST_HEAD.size : _MANIFEST_HEAD.size + length]).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptEntryError(f"manifest is not valid JSON: {exc}") from None
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
    if len(manifest.layer_digests) != manifest.num_layers or not all(
        isinstance(d, str) for d in manifest.layer_digests
    ):
        raise CorruptEntryError("manifest does not list one digest per layer")
    if expected_key is not None and manifest.key != expected_key:
        raise CorruptEntryError(f"manifest belongs to key {manifest.key[:16]}..., found under {expected_key[:16]}...")
    return manifest
