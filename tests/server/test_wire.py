"""The shared wire helpers as pure logic: namespace conversion, chunking and reassembly."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError, ResourceExhaustedError, UnknownDtypeError
from kvstore.keys import HashAlgorithm, Namespace
from kvstore.server.wire import BlockAssembler, iter_chunks, namespace_from_pb, namespace_to_pb


def test_namespace_round_trips_every_field() -> None:
    ns = Namespace(model="m", revision="r1", dtype="bfloat16", layout="mla", block_size=32, tp_size=4, tp_rank=3,
                   adapter="lora-7", cache_salt="tenant", hash_algorithm=HashAlgorithm.SHA256)
    back = namespace_from_pb(namespace_to_pb(ns))
    assert back == ns and back.root == ns.root


def test_unknown_dtype_in_namespace_is_a_codec_error() -> None:
    message = namespace_to_pb(Namespace(model="m"))
    message.dtype = "float13"
    with pytest.raises(UnknownDtypeError):
        namespace_from_pb(message)


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 30, 31])
def test_chunks_reassemble_to_the_block(size: int) -> None:
    block = bytes(range(size))
    chunks = list(iter_chunks(block, 10))
    assert [offset for offset, _, _ in chunks] == list(range(0, max(size, 1), 10))
    assert [last for _, _, last in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(len(data) <= 10 for _, data, _ in chunks)
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=2)
    for index in range(2):
        assembler.begin(index, size)
        for offset, data, _ in chunks:
            assembler.add(index, offset, data)
    assert assembler.finish() == [block, block]


def test_a_single_chunk_block_is_not_copied() -> None:
    block = b"x" * 10
    ((_, data, _),) = iter_chunks(block, 10)
    assembler = BlockAssembler(100, 1)
    assembler.begin(0, 10)
    assembler.add(0, 0, data)
    assert assembler.finish()[0] is block


def test_assembler_refuses_bad_streams() -> None:
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=2)
    with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
        assembler.begin(0, 101)
    with pytest.raises(InvalidArgumentError, match="expected"):
        assembler.begin(1, 10)
    with pytest.raises(InvalidArgumentError, match="before that block's first chunk"):
        assembler.add(0, 0, b"x")
    assembler.begin(0, 10)
    with pytest.raises(InvalidArgumentError, match="offset"):
        assembler.add(0, 5, b"x")
    with pytest.raises(InvalidArgumentError, match="run past"):
        assembler.add(0, 0, b"x" * 11)
    assembler.add(0, 0, b"x" * 5)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        assembler.begin(1, 10)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        _truncated()
    full = BlockAssembler(100, 1)
    full.begin(0, 1)
    full.add(0, 0, b"x")
    with pytest.raises(InvalidArgumentError, match="max_hashes_per_request=1"):
        full.begin(1, 1)


def _truncated() -> None:
    assembler = BlockAssembler(100, 1)
    assembler.begin(0, 2)
    assembler.add(0, 0, b"x")
    assembler.finish()


def test_assembler_bounds_the_bytes_of_one_stream() -> None:
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=10, max_total_bytes=150)
    assembler.begin(0, 100)
    assembler.add(0, 0, b"x" * 100)
    with pytest.raises(ResourceExhaustedError, match="max_put_bytes"):
        assembler.begin(1, 60)  # refused before any of its bytes are buffered
