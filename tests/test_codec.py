"""Tests of the block codec: round trips, layouts and a typed error for each bad input."""

from __future__ import annotations

import pickle
import struct

import pytest
import torch

from kvstore.codec import (
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
    ChecksumError,
    ElementCountError,
    TruncatedBlockError,
    UnknownDtypeError,
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
