"""The byte format: round trips, and every kind of damage raises CorruptEntryError (never anything else)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cacheblend_rag.store.errors import CorruptEntryError
from cacheblend_rag.store.format import (
    DIGEST_SIZE,
    Manifest,
    decode_layer,
    decode_manifest,
    decode_tensor,
    encode_layer,
    encode_manifest,
    encode_tensor,
    value_digest,
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tensor_round_trip_keeps_shape_dtype_and_values(dtype):
    t = torch.randn(2, 3, 7, 5).to(dtype)
    out = decode_tensor(encode_tensor(t))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_encoding_converts_to_the_storage_dtype():
    t = torch.randn(4, 4)
    out = decode_tensor(encode_tensor(t, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), t, atol=0.02, rtol=0.01)


def test_empty_tensor_round_trips():
    assert decode_tensor(encode_tensor(torch.empty(2, 0, 3))).shape == (2, 0, 3)


def test_layer_round_trip_and_shape_check():
    k, v = torch.randn(2, 9, 4), torch.randn(2, 9, 4)
    blob = encode_layer(k, v)
    k2, v2 = decode_layer(blob, (2, 9, 4))
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(CorruptEntryError, match="shape"):
        decode_layer(blob, (2, 10, 4))
    with pytest.raises(CorruptEntryError, match="shape"):
        decode_layer(encode_tensor(torch.randn(3, 2, 9, 4)))


def test_unstorable_tensors_are_refused_when_encoding():
    with pytest.raises(TypeError, match="storable"):
        encode_tensor(torch.ones(3, dtype=torch.int64))


def _valid_blob() -> bytes:
    return encode_layer(torch.randn(2, 5, 4), torch.randn(2, 5, 4))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[:-1], id="truncated-by-one"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated-half"),
        pytest.param(lambda b: b[:10], id="truncated-header"),
        pytest.param(lambda b: b + b"\0", id="padded"),
        pytest.param(lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], id="payload-bit-flip"),
        pytest.param(lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), id="wrong-checksum"),
        pytest.param(lambda b: b"XXXX" + b[4:], id="bad-magic"),
        pytest.param(lambda b: b[:4] + struct.pack("<H", 99) + b[6:], id="future-version"),
        pytest.param(lambda b: b[:6] + bytes([77]) + b[7:], id="unknown-dtype"),
        pytest.param(lambda b: b[:7] + bytes([200]) + b[8:], id="absurd-ndim"),
        pytest.param(lambda b: b[:8] + struct.pack("<I", 2**31) + b[12:], id="shape-too-large"),
        pytest.param(lambda b: b"", id="empty"),
    ],
)
def test_damaged_layer_values_raise_corrupt_entry_error(damage):
    with pytest.raises(CorruptEntryError):
        decode_tensor(damage(_valid_blob()))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_and_never_decode(data):
    with pytest.raises(CorruptEntryError):
        decode_tensor(data)
    with pytest.raises(CorruptEntryError):
        decode_manifest(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_byte_change_of_a_valid_value_is_detected(data):
    blob = bytearray(_valid_blob())
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptEntryError):
        decode_tensor(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(prefix=st.binary(min_size=0, max_size=64), cut=st.integers(0, 64))
def test_random_headers_with_the_right_magic_never_crash(prefix, cut):
    blob = _valid_blob()
    candidate = b"CBKV" + prefix + blob[4 + cut :]
    assume(candidate != blob)
    with pytest.raises(CorruptEntryError):
        decode_tensor(candidate)


def _manifest() -> Manifest:
    return Manifest(key="ab" * 32, write_id="0123", num_layers=2, num_tokens=5, kv_heads=2, head_dim=4,
                    layer_digests=("aa", "bb"), nbytes=100, created=1.5)


def test_manifest_round_trip_and_key_check():
    m = _manifest()
    assert decode_manifest(encode_manifest(m), expected_key=m.key) == m
    with pytest.raises(CorruptEntryError, match="belongs"):
        decode_manifest(encode_manifest(m), expected_key="cd" * 32)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("layer_digests", ("aa",)), ("num_tokens", -1)])
def test_manifest_with_inconsistent_fields_is_corrupt(field, value):
    fields = {**_manifest().__dict__, field: value}
    with pytest.raises(CorruptEntryError):
        decode_manifest(encode_manifest(Manifest(**fields)))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_byte_change_of_a_manifest_is_detected(data):
    blob = bytearray(encode_manifest(_manifest()))
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptEntryError):
        decode_manifest(bytes(blob))


def test_value_digest_is_the_trailing_checksum():
    blob = _valid_blob()
    assert value_digest(blob) == blob[-DIGEST_SIZE:].hex()


def test_scalars_and_non_contiguous_views_round_trip():
    assert decode_tensor(encode_tensor(torch.tensor(3.0))).item() == 3.0
    view = torch.randn(4, 5).t()[1:3]
    assert torch.equal(decode_tensor(encode_tensor(view)), view)
    k, v = torch.randn(5, 2, 4).transpose(0, 1), torch.randn(2, 5, 4)
    k2, v2 = decode_layer(encode_layer(k, v))
    assert torch.equal(k2, k) and torch.equal(v2, v)
