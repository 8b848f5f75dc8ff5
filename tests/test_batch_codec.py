"""The batched Put steps: staging like tensors with one header (``kvstore.blocks.copying.encode_batch_into``), checking
like blocks with one header parse (``kvstore.blocks.tensors.LikeBlocks``, ``kvstore.validation.BlockChecker``), each exactly
as strict as the per-block steps they stand in for."""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

from kvstore.blocks.copying import encode_batch_into, encode_into, encoded_nbytes
from kvstore.blocks.tensors import LikeBlocks, encode_block, verify_block
from kvstore.errors import ChecksumError, CodecError, ElementCountError, InvalidArgumentError
from kvstore.keys import Namespace
from kvstore.validation import BlockChecker, CheckedBlocks, check_blocks

NS = Namespace(model="batch-codec", dtype="float16", block_size=16)


def _tensors(num: int, dtype: torch.dtype = torch.float16, tokens: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randn(2, 2, 2, tokens, 64, generator=generator).to(dtype) for _ in range(num)]


def _segment(nbytes: int) -> tuple[memoryview, torch.Tensor]:
    segment = mmap.mmap(-1, nbytes)
    return memoryview(segment), torch.frombuffer(segment, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_a_batch_is_staged_byte_for_byte_as_block_by_block(dtype: torch.dtype) -> None:
    tensors = [t.to(dtype) for t in _tensors(5)]
    tensors[2] = tensors[2].transpose(3, 4).contiguous().transpose(3, 4)  # not contiguous: copied as well
    nbytes = encoded_nbytes(tensors[0])
    step = -(-nbytes // 64) * 64 + 64
    offsets = [64 + i * step for i in range(len(tensors))]
    view, raw = _segment(offsets[-1] + step)
    assert encode_batch_into(tensors, "kv", view, raw, offsets)
    for tensor, offset in zip(tensors, offsets):
        assert bytes(view[offset:offset + nbytes]) == encode_block(tensor)
        verify_block(view[offset:offset + nbytes])
    expected_view, expected_raw = _segment(len(view))
    for tensor, offset in zip(tensors, offsets):
        encode_into(tensor, "kv", expected_view[offset:offset + nbytes], expected_raw[offset:offset + nbytes])
    assert bytes(view) == bytes(expected_view)  # nothing written between the blocks either


@pytest.mark.parametrize("case", ["one block", "mixed dtypes", "mixed shapes", "bytes", "uneven offsets",
                                  "offsets too close"])
def test_what_is_not_a_like_batch_is_left_to_block_by_block(case: str) -> None:
    tensors: list[object] = list(_tensors(3))
    nbytes = encoded_nbytes(tensors[0])  # type: ignore[arg-type]
    offsets = [0, nbytes + 64, 2 * nbytes + 128]
    if case == "one block":
        tensors, offsets = tensors[:1], offsets[:1]
    elif case == "mixed dtypes":
        tensors[1] = tensors[1].to(torch.bfloat16)  # type: ignore[attr-defined]
    elif case == "mixed shapes":
        tensors[1] = _tensors(1, tokens=8)[0]
    elif case == "bytes":
        tensors[1] = encode_block(tensors[1])  # type: ignore[arg-type]
    elif case == "uneven offsets":
        offsets[2] += 64
    else:
        offsets = [0, nbytes - 64, 2 * nbytes - 128]
    view, raw = _segment(4 * nbytes)
    assert not encode_batch_into(tensors, "kv", view, raw, offsets)  # type: ignore[arg-type]
    assert not any(view)  # nothing written


def test_a_batch_whose_shape_does_not_fit_the_layout_raises() -> None:
    tensors = [torch.zeros(2, 3, 2, 16, 64, dtype=torch.float16) for _ in range(2)]  # kv needs dim 1 == 2
    view, raw = _segment(1 << 20)
    with pytest.raises(ElementCountError):
        encode_batch_into(tensors, "kv", view, raw, [0, 1 << 19])


def test_like_blocks_checks_only_the_checksum_of_blocks_like_the_reference() -> None:
    blocks = [encode_block(t) for t in _tensors(3)]
    like = LikeBlocks(verify_block(blocks[0]), blocks[0])
    assert like.verify(blocks[1]) and like.verify(memoryview(blocks[2]))
    corrupt = blocks[1][:-1] + bytes([blocks[1][-1] ^ 0x80])
    with pytest.raises(ChecksumError):
        like.verify(corrupt)
    (checksum,) = struct.unpack_from("<Q", blocks[1], 20)
    with pytest.raises(ChecksumError):
        like.verify(blocks[1][:20] + struct.pack("<Q", checksum ^ 1) + blocks[1][28:])
    other_dtype = encode_block(_tensors(1)[0].view(torch.bfloat16))
    assert not like.verify(other_dtype)  # a header byte differs: not like it (the caller parses it)
    assert not like.verify(encode_block(_tensors(1, tokens=8)[0]))  # another length
    assert not like.verify(blocks[1] + b"\0")  # a trailing byte


def test_every_header_byte_of_a_like_block_is_still_checked() -> None:
    blocks = [encode_block(t) for t in _tensors(2)]
    like = LikeBlocks(verify_block(blocks[0]), blocks[0])
    for position in range(128):
        if 20 <= position < 28:
            continue  # the checksum field: covered above
        changed = bytearray(blocks[1])
        changed[position] ^= 0x01
        assert not like.verify(bytes(changed)), position  # then a full check refuses it (tests/test_codec.py)
        with pytest.raises(CodecError):
            verify_block(bytes(changed))


def test_check_blocks_names_the_first_bad_block_of_any_kind() -> None:
    blocks = [encode_block(t) for t in _tensors(6)]
    check_blocks(NS, blocks, 1 << 20)
    for bad, error in [
        (blocks[4][:-1] + bytes([blocks[4][-1] ^ 1]), ChecksumError),
        (encode_block(_tensors(1)[0].view(torch.bfloat16)), InvalidArgumentError),
        (encode_block(_tensors(1, tokens=8)[0]), InvalidArgumentError),
        (blocks[4][:-64], CodecError),
        ("not bytes", InvalidArgumentError),
    ]:
        batch = [*blocks[:4], bad, *blocks[5:]]
        with pytest.raises(error, match="block 4"):
            check_blocks(NS, batch, 1 << 20)


def test_a_mixed_batch_is_checked_block_by_block() -> None:
    small = [encode_block(t) for t in _tensors(2)]
    other = encode_block(torch.zeros(4, 2, 2, 16, 64, dtype=torch.float16))  # a valid block of another shape
    check_blocks(NS, [small[0], other, small[1], other], 1 << 20)  # each unlike the last: each parsed


def test_checked_blocks_are_not_checked_again_only_for_their_own_namespace_and_limit() -> None:
    blocks = [encode_block(t) for t in _tensors(2)]
    checker = BlockChecker(NS, 1 << 20)
    for position, block in enumerate(blocks):
        checker.check(position, block)
    checked = CheckedBlocks(blocks, checker)
    check_blocks(NS, checked, 1 << 20)
    other = Namespace(model="batch-codec", dtype="bfloat16", block_size=16)
    with pytest.raises(InvalidArgumentError, match="block 0"):
        check_blocks(other, checked, 1 << 20)  # another namespace: checked again, and refused
    from kvstore.errors import ResourceExhaustedError

    with pytest.raises(ResourceExhaustedError):
        check_blocks(NS, checked, 1024)  # a lower limit than they were checked against: checked again


def test_blocks_for_put_checks_every_kind_of_block_once_and_still_refuses_a_later_bad_one() -> None:
    from kvstore.blocks.copying import blocks_for_put
    from kvstore.errors import UnknownDtypeError

    tensors = _tensors(4)
    assert blocks_for_put(tensors, "kv") == tensors
    with pytest.raises(ElementCountError, match="block 3"):
        blocks_for_put([*tensors[:3], torch.zeros(4, 2, 2, 16, 64, dtype=torch.float16)], "kv")  # another model
    with pytest.raises(ElementCountError):
        blocks_for_put([*tensors[:3], torch.zeros(2, 3, 2, 16, 64, dtype=torch.float16)], "kv")  # not kv
    with pytest.raises(UnknownDtypeError):
        blocks_for_put([*tensors[:3], tensors[3].to(torch.complex64)], "kv")
    mixed = [*tensors[:2], encode_block(tensors[2]), tensors[3]]
    assert blocks_for_put(mixed, "kv") == mixed
