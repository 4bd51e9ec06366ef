"""The byte format: round trips, and every kind of damage raises CorruptEntryError (never anything else)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.errors import CorruptEntryError
from cacheblend_rag.store.format.chunk_bytes import (
    CHECKSUM_SIZE,
    MAC_SIZE,
    Manifest,
    Tagger,
    ForeignKeyEntryError,
    UnauthenticatedReaderError,
    decode_layer,
    decode_manifest,
    encode_layer,
    encode_manifest,
    peek_manifest,
    value_digest,
)

F16 = codec_named("float16")
MANIFEST_HEAD = 20  # bytes before a manifest's JSON: magic, version, flags, reserved, length, key id
F32 = codec_named("float32")


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_float_layers_round_trip_exactly_in_their_dtype(name):
    codec = codec_named(name)
    k, v = torch.randn(2, 7, 4).to(codec.dtype), torch.randn(2, 7, 4).to(codec.dtype)
    k2, v2 = decode_layer(encode_layer(k, v, codec), (2, 7, 4)).unpacked()
    assert k2.dtype == codec.dtype and torch.equal(k2, k) and torch.equal(v2, v)


def test_encoding_converts_to_the_codecs_dtype():
    k = torch.randn(2, 4, 4)
    k2, _ = decode_layer(encode_layer(k, k, codec_named("bfloat16"))).unpacked()
    assert k2.dtype == torch.bfloat16
    torch.testing.assert_close(k2.float(), k, atol=0.02, rtol=0.01)


def test_layer_round_trip_and_shape_check():
    k, v = torch.randn(2, 9, 4), torch.randn(2, 9, 4)
    blob = encode_layer(k, v, F32)
    k2, v2 = decode_layer(blob, (2, 9, 4)).unpacked()
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(CorruptEntryError, match="shape"):
        decode_layer(blob, (2, 10, 4))
    with pytest.raises(CorruptEntryError, match="stored as float32, its manifest says float16"):
        decode_layer(blob, codec=F16)
    with pytest.raises(ValueError, match="kv_heads, tokens, head_dim"):
        encode_layer(torch.randn(3, 2, 9, 4), torch.randn(3, 2, 9, 4), F32)


def _valid_blob(codec=F16) -> bytes:
    return encode_layer(torch.randn(2, 5, 4), torch.randn(2, 5, 4), codec)


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
        pytest.param(lambda b: b[:4] + struct.pack("<H", 2) + b[6:], id="format-version-2"),
        pytest.param(lambda b: b[:6] + bytes([77]) + b[7:], id="unknown-codec"),
        pytest.param(lambda b: b[:7] + bytes([b[7] | 1]) + b[8:], id="claims-a-mac"),
        pytest.param(lambda b: b[:12] + struct.pack("<I", 2**31) + b[16:], id="shape-too-large"),
        pytest.param(lambda b: b"", id="empty"),
    ],
)
def test_damaged_layer_values_raise_corrupt_entry_error(damage):
    with pytest.raises(CorruptEntryError):
        decode_layer(damage(_valid_blob()))


@pytest.mark.parametrize("value", ["a string", 12, 3.5, None, ["list"], {"a": 1}], ids=lambda v: type(v).__name__)
def test_values_of_other_types_are_corrupt_not_a_crash(value):
    with pytest.raises(CorruptEntryError, match="not bytes"):
        decode_layer(value)
    with pytest.raises(CorruptEntryError, match="not bytes"):
        decode_manifest(value)


@pytest.mark.parametrize("codec", ["float16", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_with_a_matching_checksum_are_corrupt(codec, bad):
    k = torch.randn(2, 5, 4)
    k[1, 2, 3] = bad
    blob = encode_layer(k, torch.randn(2, 5, 4), codec_named(codec, 4))
    with pytest.raises(CorruptEntryError, match="NaN or infinite"):
        decode_layer(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_and_never_decode(data):
    with pytest.raises(CorruptEntryError):
        decode_layer(data)
    with pytest.raises(CorruptEntryError):
        decode_manifest(data)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["float16", "int8", "int4"]))
def test_any_single_byte_change_of_a_valid_value_is_detected(data, codec):
    blob = bytearray(_valid_blob(codec_named(codec, 4)))
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptEntryError):
        decode_layer(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(prefix=st.binary(min_size=0, max_size=64), cut=st.integers(0, 64))
def test_random_headers_with_the_right_magic_never_crash(prefix, cut):
    blob = _valid_blob()
    candidate = b"CBKV" + prefix + blob[4 + cut :]
    assume(candidate != blob)
    with pytest.raises(CorruptEntryError):
        decode_layer(candidate)


def _manifest(tag_size: int = CHECKSUM_SIZE) -> Manifest:
    return Manifest(key="ab" * 32, write_id="0123", num_layers=2, num_tokens=5, kv_heads=2, head_dim=4,
                    codec="float16", group=0, layer_digests=("aa" * tag_size, "bb" * tag_size), nbytes=100,
                    created=1.5)


def test_manifest_round_trip_and_key_check():
    m = _manifest()
    assert decode_manifest(encode_manifest(m), expected_key=m.key) == m
    with pytest.raises(CorruptEntryError, match="belongs"):
        decode_manifest(encode_manifest(m), expected_key="cd" * 32)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("layer_digests", ("aa" * 16,)), ("num_tokens", -1),
                                         ("layer_digests", ("aa", "bb")), ("created", float("nan"))])
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


def test_value_digest_is_the_trailing_tag():
    blob = _valid_blob()
    assert value_digest(blob) == blob[-CHECKSUM_SIZE:].hex()
    signed = encode_layer(torch.randn(2, 5, 4), torch.randn(2, 5, 4), F16, Tagger(b"k" * 32))
    assert value_digest(signed) == signed[-MAC_SIZE:].hex()


def test_non_contiguous_views_round_trip():
    k, v = torch.randn(5, 2, 4).transpose(0, 1), torch.randn(2, 5, 4)
    k2, v2 = decode_layer(encode_layer(k, v, F32)).unpacked()
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_manifest_json_nested_deeply_is_corrupt_even_with_a_valid_checksum():
    import json

    import xxhash

    from cacheblend_rag.store.format import chunk_bytes as fmt

    nested = ("[" * 100_000 + "]" * 100_000).encode()
    body = fmt._MANIFEST_HEAD.pack(fmt.MANIFEST_MAGIC, fmt.FORMAT_VERSION, 0, 0, len(nested), fmt.NO_KEY_ID) + nested
    with pytest.raises(CorruptEntryError, match="nested deeper"):
        decode_manifest(body + xxhash.xxh3_128_digest(body))
    big = json.dumps({"x": "a" * (fmt.MAX_MANIFEST_JSON + 1)}).encode()
    body = fmt._MANIFEST_HEAD.pack(fmt.MANIFEST_MAGIC, fmt.FORMAT_VERSION, 0, 0, len(big), fmt.NO_KEY_ID) + big
    with pytest.raises(CorruptEntryError, match="more than any manifest"):
        decode_manifest(body + xxhash.xxh3_128_digest(body))


def test_authenticated_values_need_the_key_and_forgery_fails():
    key, other = Tagger(b"k" * 32), Tagger(b"x" * 32)
    k, v = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    signed = encode_layer(k, v, F16, key)
    assert torch.equal(decode_layer(signed, tagger=key).unpacked()[0], k.half())
    with pytest.raises(CorruptEntryError, match="fails its MAC"):
        decode_layer(signed, tagger=other)
    # A layer is read only under its manifest, checked first with this reader's key: another tag is damage.
    with pytest.raises(CorruptEntryError, match="carries a MAC"):
        decode_layer(signed)
    plain = encode_layer(k, v, F16)  # what a forger without the key can make: a valid checksum
    with pytest.raises(CorruptEntryError, match="carries no MAC"):
        decode_layer(plain, tagger=key)
    manifest = _manifest(MAC_SIZE)
    data = encode_manifest(manifest, key)
    assert decode_manifest(data, tagger=key) == manifest and peek_manifest(data) == manifest
    forged = bytearray(data)
    forged[MANIFEST_HEAD + 10] ^= 1  # in the JSON, under this reader's own key id
    with pytest.raises(CorruptEntryError, match="fails its MAC") as damaged:
        decode_manifest(bytes(forged), tagger=key)
    assert not isinstance(damaged.value, ForeignKeyEntryError)  # damage: deleted


def test_the_key_id_names_the_key_and_tells_foreign_entries_from_damage():
    key, other = Tagger(b"k" * 32), Tagger(b"x" * 32)
    assert key.key_id != other.key_id and key.key_id == Tagger(b"k" * 32).key_id and len(key.key_id) == 8
    assert key.key_id not in b"k" * 32 and Tagger().key_id == bytes(8)  # never the key; zeros for none
    signed, plain = encode_manifest(_manifest(MAC_SIZE), key), encode_manifest(_manifest())
    with pytest.raises(ForeignKeyEntryError, match=f"key id {key.key_id.hex()}; this reader's is "
                                                   f"{other.key_id.hex()}") as wrong_key:
        decode_manifest(signed, tagger=other)  # a reader with another key: not damage, never deleted
    assert wrong_key.value.key_id == key.key_id.hex()
    with pytest.raises(UnauthenticatedReaderError, match="this reader's is none"):
        decode_manifest(signed)  # no key: cannot check it (a ForeignKeyEntryError too)
    with pytest.raises(ForeignKeyEntryError, match="written without a store key") as keyless:
        decode_manifest(plain, tagger=key)  # intact (its checksum holds), but not under this reader's key
    assert keyless.value.key_id == ""
    # What a reader can check, it checks whatever key the entry claims: a failing checksum or malformed fields
    # are damage (deleted), not foreign.
    broken = bytearray(plain)
    broken[MANIFEST_HEAD + 3] ^= 1
    with pytest.raises(CorruptEntryError, match="fails its checksum") as damaged:
        decode_manifest(bytes(broken), tagger=key)
    assert not isinstance(damaged.value, ForeignKeyEntryError)
    with pytest.raises(CorruptEntryError, match="belongs") as swapped:
        decode_manifest(signed, expected_key="cd" * 32, tagger=other)
    assert not isinstance(swapped.value, ForeignKeyEntryError)
    relabelled = bytearray(signed)
    relabelled[12:20] = bytes(8)  # a MAC with no key id: no writer makes that
    with pytest.raises(CorruptEntryError, match="no writer makes that") as odd:
        decode_manifest(bytes(relabelled), tagger=other)
    assert not isinstance(odd.value, ForeignKeyEntryError)
