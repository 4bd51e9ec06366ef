"""How one layer of one chunk (K and V, ``[kv_heads, tokens, head_dim]`` each) becomes stored bytes.

Five codecs, chosen per store (``ChunkCache(storage_dtype=...)``):

==========  =======================================================================  ==============
codec       payload                                                                   bytes/value
==========  =======================================================================  ==============
float32     K then V, as computed by a float32 model                                  4
float16     K then V                                                                  2
bfloat16    K then V                                                                  2
int8        symmetric 8-bit; K per channel over groups of ``group`` tokens, V per     1 + 2/group
            token over groups of ``group`` channels; one float16 scale per group
int4        asymmetric 4-bit, two values a byte; grouped as int8, with a float16      0.5 + 4/group
            scale and a float16 minimum per group
==========  =======================================================================  ==============

The grouping follows KIVI (keys quantized per channel, values per token): a few channels of
the keys carry most of their magnitude, consistently across tokens, so one scale per channel
fits them, while values have no such channels. Keys are stored before RoPE, as always: a
per-channel scale before the rotation is the same scale for every position the chunk may be
placed at. Measured alternatives are in research/quality_notebook.md ("Compressed chunk KV").

Decoding is two steps, so that quantized bytes can cross to a GPU before they are expanded:
:meth:`Codec.unpack` makes tensors over the payload bytes (no copy), and
:meth:`PackedLayer.unpacked` turns them into K and V in a compute dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from cacheblend_rag.errors import ConfigError

_SCALE_DTYPE = torch.float16  # a scale's own rounding (2^-11) is far below an 8-bit step (2^-7)
_TINY = 1e-8


@dataclass
class PackedLayer:
    """One layer's payload as tensors over the stored bytes (or copies of them on a device)."""

    codec: "Codec"
    shape: tuple[int, int, int]  # (kv_heads, tokens, head_dim) of K, and of V
    tensors: list[torch.Tensor]

    def unpacked(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V. ``dtype=None`` keeps a float codec's stored dtype (views, no copy); quantized
        codecs always expand, into ``dtype`` (float32 when ``None``)."""
        return self.codec.expand(self, dtype)

    @property
    def finite(self) -> bool:
        """Whether every stored float (values, or scales and minima) is finite: their sum in float32 is,
        since NaN or an infinity carries into any sum. One pass without a mask, 8x faster than
        ``isfinite(t).all()``, which cost a 16-bit store ~95 ms a 3,000-token blend on a CPU. A float32
        sum can overflow only past 3e38, far beyond any real K/V: such a layer is refused, and recomputed."""
        return all(bool(torch.isfinite(t.sum(dtype=torch.float32))) for t in self.tensors if t.is_floating_point())


_ALIGN = 16  # bytes: any dtype's view of a staged tensor starts on a multiple of its element size


def staged(layers: Sequence[PackedLayer], device: torch.device, *, pin: bool) -> list[PackedLayer]:
    """``layers`` moved to ``device`` in one transfer: their tensors packed back to back into one host
    buffer (page-locked when ``pin``, so that the copy is asynchronous on the current stream), copied at
    once, and cut back into views there. Copying each chunk's tensors on its own cost a GPU blend a
    page-locked allocation and a transfer per chunk, layer and tensor (docs/performance.md, GPU)."""
    placed: list[tuple[torch.Tensor, int, int]] = []  # (tensor, offset, bytes)
    total = 0
    for layer in layers:
        for t in layer.tensors:
            size = t.numel() * t.element_size()
            placed.append((t, total, size))
            total += -(-size // _ALIGN) * _ALIGN
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, offset, size in placed:
        if size:
            host[offset : offset + size].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    there = host.to(device, non_blocking=pin)
    cut = iter(placed)
    out = []
    for layer in layers:
        tensors = []
        for t in layer.tensors:
            _, offset, size = next(cut)
            tensors.append(there[offset : offset + size].view(t.dtype).view(t.shape))
        out.append(PackedLayer(layer.codec, layer.shape, tensors))
    return out


class Codec(ABC):
    """One way to store a layer. ``code`` goes into every layer value's header."""

    name: ClassVar[str]
    code: ClassVar[int]
    lossy: ClassVar[bool] = False

    def __init__(self, group: int = 0) -> None:
        self.group = group

    def __repr__(self) -> str:
        return f"{self.name}" + (f"(group={self.group})" if self.group else "")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and (self.code, self.group) == (other.code, other.group)

    def __hash__(self) -> int:
        return hash((self.code, self.group))

    def exact_for(self, dtype: torch.dtype) -> bool:
        """Whether values computed in ``dtype`` come back from this codec unchanged."""
        return False

    @property
    def tag(self) -> str:
        """What a store key carries of the codec: nothing for the lossless floats (readers of any
        precision may share them), the codec and group for a quantized one (never mixed)."""
        return f"{self.name}-g{self.group}" if self.lossy else ""

    @abstractmethod
    def sizes(self, shape: tuple[int, int, int]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of each payload tensor, in order, for K and V of ``shape``."""

    def payload_bytes(self, shape: tuple[int, int, int]) -> int:
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in self.sizes(shape))

    @abstractmethod
    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """Payload tensors (contiguous, on the CPU) for ``keys``/``values`` ``[kv_heads, tokens, head_dim]``."""

    def unpack(self, payload: memoryview, shape: tuple[int, int, int]) -> PackedLayer:
        """Tensors over ``payload`` (which must be ``payload_bytes(shape)`` long); no copy."""
        tensors, offset = [], 0
        for dtype, dims in self.sizes(shape):
            n = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
            part = payload[offset : offset + n]
            tensors.append(torch.frombuffer(part, dtype=dtype).view(dims) if n else torch.empty(dims, dtype=dtype))
            offset += n
        return PackedLayer(self, shape, tensors)

    @abstractmethod
    def expand(self, packed: PackedLayer, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class FloatCodec(Codec):
    dtype: ClassVar[torch.dtype]

    def exact_for(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype or self.dtype == torch.float32

    def sizes(self, shape):
        return [(self.dtype, shape), (self.dtype, shape)]

    def pack(self, keys, values):
        return [keys.detach().to("cpu", self.dtype).contiguous(), values.detach().to("cpu", self.dtype).contiguous()]

    def expand(self, packed, dtype):
        k, v = packed.tensors
        return (k, v) if dtype is None or dtype == k.dtype else (k.to(dtype), v.to(dtype))


class Float32(FloatCodec):
    name, code, dtype = "float32", 3, torch.float32


class Float16(FloatCodec):
    name, code, dtype = "float16", 1, torch.float16


class BFloat16(FloatCodec):
    name, code, dtype = "bfloat16", 2, torch.bfloat16


def _key_groups(tokens: int, group: int) -> int:
    return max(1, math.ceil(tokens / group))


def _value_group(head_dim: int, group: int) -> int:
    """Channels a value group spans: ``group`` when it divides the head dimension, else all of it."""
    return group if head_dim % group == 0 else head_dim


def _grouped_keys(keys: torch.Tensor, group: int) -> torch.Tensor:
    """``[h, n, d]`` -> ``[h, groups, group, d]``, the last group padded by repeating the last token
    (which changes no group's minimum, maximum or absolute maximum)."""
    h, n, d = keys.shape
    groups = _key_groups(n, group)
    if groups * group != n:
        keys = torch.cat([keys, keys[:, -1:].expand(h, groups * group - n, d)], dim=1)
    return keys.view(h, groups, group, d)


def _expand_keys(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, group: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``q * scale (+ minimum)`` with one scale per channel and group of tokens."""
    h, n, d = q.shape
    out = torch.empty((h, n, d), dtype=dtype, device=q.device)
    full = (n // group) * group
    parts = [(slice(0, full), slice(0, n // group))] if full else []
    if full < n:
        parts.append((slice(full, n), slice(n // group, n // group + 1)))
    for rows, groups in parts:
        count = groups.stop - groups.start
        target = out[:, rows].view(h, count, -1, d)
        torch.mul(q[:, rows].view(h, count, -1, d), scale[:, groups, None, :], out=target)
        if minimum is not None:
            target.add_(minimum[:, groups, None, :])
    return out


class Int8(Codec):
    name, code, lossy = "int8", 4, True

    def sizes(self, shape):
        h, n, d = shape
        vg = _value_group(d, self.group)
        return [(torch.int8, shape), (_SCALE_DTYPE, (h, _key_groups(n, self.group), d)),
                (torch.int8, shape), (_SCALE_DTYPE, (h, n, d // vg))]

    def pack(self, keys, values):
        keys, values = keys.detach().to("cpu", torch.float32), values.detach().to("cpu", torch.float32)
        h, n, d = keys.shape
        grouped = _grouped_keys(keys, self.group)
        k_scale = (grouped.abs().amax(dim=2) / 127).clamp(min=_TINY).to(_SCALE_DTYPE)
        k_q = (grouped / k_scale.float()[:, :, None, :]).round_().clamp_(-127, 127).to(torch.int8)
        vg = _value_group(d, self.group)
        v_grouped = values.view(h, n, d // vg, vg)
        v_scale = (v_grouped.abs().amax(dim=3) / 127).clamp(min=_TINY).to(_SCALE_DTYPE)
        v_q = (v_grouped / v_scale.float()[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        return [k_q.view(h, -1, d)[:, :n].contiguous(), k_scale, v_q.view(h, n, d), v_scale]

    def expand(self, packed, dtype):
        dtype = dtype or torch.float32
        k_q, k_scale, v_q, v_scale = packed.tensors
        h, n, d = packed.shape
        keys = _expand_keys(k_q, k_scale.to(dtype), None, self.group, dtype)
        vg = _value_group(d, self.group)
        values = (v_q.view(h, n, d // vg, vg).to(dtype) * v_scale.to(dtype)[..., None]).view(h, n, d)
        return keys, values


class Int4(Codec):
    name, code, lossy = "int4", 5, True

    def sizes(self, shape):
        h, n, d = shape
        kg, vg = _key_groups(n, self.group), _value_group(d, self.group)
        return [(torch.uint8, (h, n, d // 2)), (_SCALE_DTYPE, (h, kg, d)), (_SCALE_DTYPE, (h, kg, d)),
                (torch.uint8, (h, n, d // 2)), (_SCALE_DTYPE, (h, n, d // vg)), (_SCALE_DTYPE, (h, n, d // vg))]

    @staticmethod
    def _levels(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((x - low) / scale).round_().clamp_(0, 15).to(torch.uint8)

    @staticmethod
    def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
        return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()

    @staticmethod
    def _unpack_nibbles(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).to(dtype)

    def pack(self, keys, values):
        keys, values = keys.detach().to("cpu", torch.float32), values.detach().to("cpu", torch.float32)
        h, n, d = keys.shape
        if d % 2:
            raise ValueError(f"int4 storage needs an even head dimension, this model has {d}")
        grouped = _grouped_keys(keys, self.group)
        k_min, k_max = grouped.amin(dim=2), grouped.amax(dim=2)
        k_scale = ((k_max - k_min) / 15).clamp(min=_TINY).to(_SCALE_DTYPE)
        k_min = k_min.to(_SCALE_DTYPE)
        k_q = self._levels(grouped, k_min.float()[:, :, None, :], k_scale.float()[:, :, None, :])
        vg = _value_group(d, self.group)
        v_grouped = values.view(h, n, d // vg, vg)
        v_min, v_max = v_grouped.amin(dim=3), v_grouped.amax(dim=3)
        v_scale = ((v_max - v_min) / 15).clamp(min=_TINY).to(_SCALE_DTYPE)
        v_min = v_min.to(_SCALE_DTYPE)
        v_q = self._levels(v_grouped, v_min.float()[..., None], v_scale.float()[..., None])
        return [self._pack_nibbles(k_q.view(h, -1, d)[:, :n]), k_scale, k_min,
                self._pack_nibbles(v_q.view(h, n, d)), v_scale, v_min]

    def expand(self, packed, dtype):
        dtype = dtype or torch.float32
        k_packed, k_scale, k_min, v_packed, v_scale, v_min = packed.tensors
        h, n, d = packed.shape
        keys = _expand_keys(self._unpack_nibbles(k_packed, dtype), k_scale.to(dtype), k_min.to(dtype),
                            self.group, dtype)
        vg = _value_group(d, self.group)
        v_levels = self._unpack_nibbles(v_packed, dtype).view(h, n, d // vg, vg)
        values = torch.addcmul(v_min.to(dtype)[..., None], v_levels, v_scale.to(dtype)[..., None]).view(h, n, d)
        return keys, values


_BY_CODE: dict[int, type[Codec]] = {c.code: c for c in (Float16, BFloat16, Float32, Int8, Int4)}
_BY_NAME: dict[str, type[Codec]] = {c.name: c for c in _BY_CODE.values()}
DEFAULT_GROUP = 64
STORAGE_DTYPES = ("auto", "float16", "bfloat16", "float32", "int8", "int4")


def codec_for_code(code: int, group: int) -> Codec:
    """The codec a stored header names; ``KeyError`` for an unknown code or a group it cannot have."""
    cls = _BY_CODE[code]
    if not cls.lossy:
        if group:
            raise KeyError(f"{cls.name} has no group")
        return cls()
    if not 1 <= group <= 4096:
        raise KeyError(f"{cls.name} group {group}")
    return cls(group)


def codec_for_name(name: str, group: int) -> Codec:
    """The codec a manifest names; ``KeyError`` for an unknown name."""
    return codec_for_code(_BY_NAME[name].code, group)


def codec_named(name: str | torch.dtype, group: int = DEFAULT_GROUP) -> Codec | None:
    """The codec ``storage_dtype=name`` picks (``None`` for ``"auto"``, which picks per layer)."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _BY_NAME:
        raise ConfigError(f"storage_dtype={name!r} is not supported; choose one of {', '.join(map(repr, STORAGE_DTYPES))}")
    cls = _BY_NAME[name]
    if not cls.lossy:
        return cls()
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= 4096:
        raise ConfigError(f"storage group={group!r} must be an integer in [1, 4096]")
    return cls(group)


def float_codec(dtype: torch.dtype) -> Codec:
    return _BY_NAME[str(dtype).removeprefix("torch.")]()
