"""The block format of lossy blocks: encoding, group and scales under the checksum, an unknown encoding refused
by name, and exact blocks and namespaces byte for byte what they were before encodings existed."""

from __future__ import annotations

import random
import struct

import pytest
import torch
import xxhash

from kvstore.blocks.tensors import (
    FLAG_ENCODED,
    block_checksum,
    decode_block,
    decode_header,
    encode_block,
    verify_block,
)
from kvstore.blocks.encoding import Encoding, encode_lossy
from kvstore.blocks.encoding.blocks import plan_of
from kvstore.errors import ChecksumError, CodecError, ElementCountError, UnknownEncodingError
from kvstore.keys import Namespace, hash_blocks

SHAPE = (2, 2, 2, 16, 64)


def _lossy(encoding: Encoding) -> bytearray:
    return encode_lossy(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16), "kv",
                        encoding)


def _reseal(block: bytearray) -> bytearray:
    """The block with its checksum recomputed: what a writer that means the damage would produce."""
    head = decode_header_size(block)
    struct.pack_into("<Q", block, 20, block_checksum(block[:head], block[head:]))
    return block


def decode_header_size(block: bytes | bytearray) -> int:
    return struct.unpack_from("<H", block, 10)[0]


def test_exact_blocks_and_namespaces_are_unchanged() -> None:
    """Golden values from the build before encodings (dbea9f9): an exact block's bytes, a namespace's root and a
    chained hash."""
    x = torch.arange(2 * 2 * 2 * 4 * 8, dtype=torch.float32).reshape(2, 2, 2, 4, 8).to(torch.bfloat16)
    assert xxhash.xxh3_64_hexdigest(encode_block(x)) == "6cca344417527201"
    ns = Namespace(model="golden", dtype="bfloat16", block_size=4)
    assert ns.root.hex() == "4bfc5d0f514b0d31c7fca8eddf1d4a8d"
    assert hash_blocks(ns, list(range(8)))[1].hex() == "6361634687b7b9891731007e485f936f"
    assert decode_header(encode_block(x)).encoding == ""


@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.value)
def test_every_header_and_scale_byte_is_under_the_checksum(encoding: Encoding) -> None:
    """Each bit of the header (encoding code, group, flags included) and every scale byte, flipped, is refused
    as corruption; so is a sample of the data section's bytes. Never decoded into other values."""
    block = _lossy(encoding)
    header = verify_block(block)
    plan = plan_of(header)
    positions = list(range(header.header_nbytes + plan.scales_nbytes))
    rng = random.Random(encoding.code)
    positions += rng.sample(range(header.header_nbytes + plan.data_offset, header.nbytes), 64)
    for position in positions:
        for bit in (0, 3, 7):
            damaged = bytearray(block)
            damaged[position] ^= 1 << bit
            with pytest.raises(CodecError):
                decode_block(damaged)


def test_an_unknown_encoding_is_refused_by_name_even_when_resealed() -> None:
    block = _lossy(Encoding.INT8)
    at = 28 + 8 * len(SHAPE)  # the encoding code follows the shape
    block[at] = 99
    with pytest.raises(UnknownEncodingError, match="unknown KV encoding code 99"):
        verify_block(_reseal(block))


def test_a_changed_encoding_or_group_is_refused_even_when_resealed() -> None:
    """Another known encoding's code, or another group, does not fit the payload's size: never misread."""
    block = _lossy(Encoding.INT8)
    at = 28 + 8 * len(SHAPE)
    block[at] = Encoding.FP8_E4M3.code  # same size: the checksum is what tells (and a resealed one decodes fp8)
    with pytest.raises(ChecksumError):
        verify_block(block)
    block = _lossy(Encoding.INT4)
    struct.pack_into("<H", block, at + 2, 32)
    with pytest.raises(ElementCountError, match="value group 32"):
        verify_block(_reseal(block))
    block = _lossy(Encoding.INT4)
    block[9] = 0x02  # an unknown flag
    with pytest.raises(ElementCountError, match="flags"):
        verify_block(_reseal(block))


def test_a_lossy_block_without_its_flag_is_refused() -> None:
    """Cleared flag 1: read as an exact block, its payload size does not fit the shape."""
    block = _lossy(Encoding.INT8)
    assert block[9] == FLAG_ENCODED
    block[9] = 0
    with pytest.raises(ElementCountError):
        verify_block(_reseal(block))
