"""Tests of the block codec: round trips, layouts and a typed error for each bad input."""

from __future__ import annotations

import pickle
import struct

import pytest
import torch

from kvstore.blocks.tensors import (
    ALIGNMENT,
    DTYPES,
    Layout,
    decode_block,
    decode_header,
    encode_block,
    encode_header,
    header_nbytes,
    torch_dtype,
    verify_block,
)
from kvstore.errors import (
    BadMagicError,
    CodecError,
    ChecksumError,
    ElementCountError,
    TruncatedBlockError,
    UnknownDtypeError,
    UnknownEncodingError,
)


def kv_block(dtype: torch.dtype = torch.float16, heads: int = 4) -> torch.Tensor:
    """``[num_layers=3, 2, num_kv_heads, block_size=16, head_dim=8]``."""
    return torch.randn(3, 2, heads, 16, 8).to(dtype)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    tensor = torch.randn(2, 2, 2, 4, 8).to(torch_dtype(name))
    assert tensor.element_size() == DTYPES[name][1]
    buf = encode_block(tensor)
    out = decode_block(buf)
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("heads", [1, 4, 8])  # MQA, GQA, MHA
def test_round_trip_gqa_and_mqa(heads: int) -> None:
    tensor = kv_block(heads=heads)
    assert torch.equal(decode_block(encode_block(tensor)), tensor)


def test_mla_layout() -> None:
    latent = torch.randn(3, 1, 16, 64, dtype=torch.bfloat16)  # [num_layers, 1, block_size, latent_dim]
    buf = encode_block(latent, Layout.MLA)
    assert decode_header(buf).layout is Layout.MLA
    assert torch.equal(decode_block(buf), latent)
    with pytest.raises(ElementCountError):
        encode_block(kv_block(), Layout.MLA)


def test_payload_is_aligned_and_decoded_without_copy() -> None:
    buf = bytearray(encode_block(kv_block()))
    header = decode_header(buf)
    assert header.header_nbytes % ALIGNMENT == 0 and header.header_nbytes == header_nbytes(5)
    out = decode_block(buf)
    buf[header.header_nbytes] ^= 0xFF  # the tensor views the buffer
    assert out.view(torch.uint8).reshape(-1)[0] == buf[header.header_nbytes]


def test_non_contiguous_input() -> None:
    tensor = torch.randn(3, 2, 16, 4, 8).transpose(2, 3)
    assert torch.equal(decode_block(encode_block(tensor)), tensor)


def test_truncated() -> None:
    buf = encode_block(kv_block())
    for cut in (0, 10, 40, len(buf) - 1):
        with pytest.raises(TruncatedBlockError):
            decode_block(buf[:cut])


def test_bad_checksum() -> None:
    buf = bytearray(encode_block(kv_block()))
    buf[-1] ^= 1
    with pytest.raises(ChecksumError):
        verify_block(buf)
    decode_block(buf, verify=False)  # the header is still fine


def test_unknown_dtype_code_and_name() -> None:
    buf = bytearray(encode_block(kv_block()))
    buf[6] = 200
    with pytest.raises(UnknownDtypeError):
        decode_block(buf)
    with pytest.raises(UnknownDtypeError):
        encode_block(torch.zeros(1, 2, 1, 1, 1, dtype=torch.complex64))


def test_element_count_mismatch() -> None:
    buf = bytearray(encode_block(kv_block()))
    struct.pack_into("<Q", buf, 28, 99)  # first dimension of the shape
    with pytest.raises(ElementCountError):
        decode_block(buf)
    with pytest.raises(ElementCountError):
        decode_block(bytes(encode_block(kv_block())) + b"extra")
    with pytest.raises(ElementCountError):
        encode_header("float16", "kv", (1, 2, 1, 1, 3), b"\x00" * 4)


def test_bad_magic() -> None:
    with pytest.raises(BadMagicError):
        decode_block(b"\x80\x04" + bytes(200))
    with pytest.raises(BadMagicError):
        decode_block(pickle.dumps(kv_block()))


def test_every_header_byte_is_covered_by_the_checksum() -> None:
    """Regression (issue 18, finding 1): the checksum covered the payload alone, so a flipped dtype byte (float16
    read as bfloat16), flags byte or padding byte was served with the block."""
    buf = encode_block(kv_block())
    size = decode_header(buf).header_nbytes
    for offset in range(size):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(buf)
            damaged[offset] ^= flip
            with pytest.raises(CodecError):
                verify_block(damaged)


@pytest.mark.parametrize(("first", "second"), [("float16", "bfloat16"), ("int8", "uint8"),
                                               ("float8_e4m3fn", "float8_e5m2")])
def test_a_dtype_swapped_for_one_of_the_same_size_fails_the_checksum(first: str, second: str) -> None:
    buf = bytearray(encode_block(torch.zeros(1, 2, 1, 4, 8).to(torch_dtype(first))))
    assert buf[6] == DTYPES[first][0]
    buf[6] = DTYPES[second][0]
    assert decode_header(buf).dtype == second  # the header alone still parses...
    with pytest.raises(ChecksumError):
        verify_block(buf)  # ...but the block is refused


def test_the_checksum_is_the_documented_xxh3_stream() -> None:
    """Other languages can check a block: xxh3-64 (seed 0) of the header with its checksum field as zeros, then the payload."""
    import xxhash

    buf = encode_block(kv_block())
    size = decode_header(buf).header_nbytes
    zeroed = bytearray(buf[:size])
    zeroed[20:28] = bytes(8)
    assert struct.unpack_from("<Q", buf, 20)[0] == xxhash.xxh3_64_intdigest(bytes(zeroed) + buf[size:])


def test_version_1_blocks_are_refused_naming_the_version() -> None:
    buf = bytearray(encode_block(kv_block()))
    struct.pack_into("<H", buf, 4, 1)
    with pytest.raises(BadMagicError, match="version 1"):
        decode_header(buf)


def test_non_zero_flags_or_padding_are_refused_by_the_header_check_alone() -> None:
    buf = encode_block(kv_block())
    for offset, value in ((9, 2), (9, 0x80), (decode_header(buf).header_nbytes - 1, 1)):  # unknown flags, padding
        damaged = bytearray(buf)
        damaged[offset] = value
        with pytest.raises(ElementCountError):
            decode_header(damaged)
    damaged = bytearray(buf)
    damaged[9] = 1  # the lossy flag on an exact block: its encoding code (padding, 0) is no encoding
    with pytest.raises(UnknownEncodingError, match="code 0"):
        decode_header(damaged)


@pytest.mark.parametrize("kind", ["bytes", "readonly_view"])
def test_a_tensor_decoded_from_read_only_bytes_does_not_write_into_them(kind: str) -> None:
    """Regression (issue 18, finding 7): ``torch.frombuffer`` over read-only bytes gave a writable tensor whose
    writes changed a stored block (the heap tier's ``bytes``, the page pool's read-only views)."""
    stored = encode_block(kv_block())
    buf = stored if kind == "bytes" else memoryview(bytearray(stored)).toreadonly()
    before = bytes(buf)
    tensor = decode_block(buf)
    tensor.fill_(7)
    assert bytes(buf) == before
    verify_block(buf)


def test_copy_false_views_even_read_only_bytes() -> None:
    """For a caller whose bytes no one else holds (a client's received message): no copy."""
    buf = memoryview(bytearray(encode_block(kv_block()))).toreadonly()
    tensor = decode_block(buf, copy=False)
    assert tensor.data_ptr() == torch.frombuffer(buf.obj, dtype=torch.uint8).data_ptr() + decode_header(buf).header_nbytes
