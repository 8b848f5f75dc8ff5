"""A hostile same-host client's multi-block puts: the node checks each block of a batch of like blocks with one
header parse (``kvstore.blocks.tensors.LikeBlocks``) and each copy as it makes it (``kvstore.validation.BlockChecker``), so a
bad block anywhere in a batch, of any kind, must still fail the whole put, name its position, store nothing of it,
change nothing stored before, and leave the node healthy."""

from __future__ import annotations

import struct
import threading

import grpc
import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.keys import hash_blocks
from kvstore.wire import namespace_to_pb
from tests.shm.test_hostile import A, put_shared
from tests.support.security import TOKEN_A, client_of, sha_namespace
from tests.support.server import ThreadedServer
from tests.support.shm import RawSession, assert_healthy, small_block

NUM_BLOCKS = 8
BAD = 5
"""The position of the bad block in the batch (neither the first, which is parsed, nor the last)."""


def _staged(blocks: list[bytes]) -> tuple[list[int], list[int]]:
    """Offsets (64-byte aligned, one after another) and sizes of ``blocks`` laid out in a put segment."""
    offsets, position = [], 0
    for block in blocks:
        offsets.append(position)
        position += -(-len(block) // 64) * 64
    return offsets, [len(b) for b in blocks]


def _flip_payload(block: bytes) -> bytes:
    return block[:-1] + bytes([block[-1] ^ 0x01])


def _wrong_checksum(block: bytes) -> bytes:
    (checksum,) = struct.unpack_from("<Q", block, 20)
    return block[:20] + struct.pack("<Q", checksum ^ 1) + block[28:]


def _other_dtype(seed: int) -> bytes:  # a valid block, checksum and all, of bfloat16: its header differs in one byte
    return encode_block(small_block(seed).view(torch.bfloat16))


def _other_tokens(seed: int) -> bytes:  # a valid block of 32 tokens: another shape and length
    return encode_block(torch.cat([small_block(seed), small_block(seed + 1)], dim=3))


def _flip_padding(block: bytes) -> bytes:  # a header padding byte set, the checksum recomputed over it
    from kvstore.blocks.tensors import block_checksum

    head = bytearray(block[:128])
    head[127] = 1
    head[20:28] = struct.pack("<Q", block_checksum(head, block[128:]))
    return bytes(head) + block[128:]


@pytest.mark.parametrize("bad, message", [
    (lambda b, s: _flip_payload(b), "checksum"),
    (lambda b, s: _wrong_checksum(b), "checksum"),
    (lambda b, s: _other_dtype(s), "does not match the namespace"),
    (lambda b, s: _other_tokens(s), "tokens"),
    (lambda b, s: _flip_padding(b), "padding"),
], ids=["payload", "checksum-field", "dtype", "tokens", "padding"])
def test_one_bad_block_in_a_batch_fails_the_whole_put_and_names_it(node: ThreadedServer, bad, message) -> None:  # type: ignore[no-untyped-def]
    ns = sha_namespace("tenant-a")
    stored_hashes = hash_blocks(ns, list(range(16 * NUM_BLOCKS)))
    stored = [encode_block(small_block(i)) for i in range(NUM_BLOCKS)]
    with client_of(node, TOKEN_A) as client:
        assert client.put(ns, stored_hashes, stored) == NUM_BLOCKS
    hashes = hash_blocks(ns, list(range(1000, 1000 + 16 * NUM_BLOCKS)))
    blocks = [encode_block(small_block(100 + i)) for i in range(NUM_BLOCKS)]
    blocks[BAD] = bad(blocks[BAD], 100 + BAD)
    offsets, sizes = _staged(blocks)
    with RawSession(node.target, A) as hostile:
        for block, offset in zip(blocks, offsets):
            hostile.put.view[offset:offset + len(block)] = block
        with pytest.raises(grpc.RpcError) as raised:
            put_shared(hostile, namespace_to_pb(ns), hashes, offsets, sizes)
        # the same blocks as stored ones' hashes: a failed put must not touch what those hold
        with pytest.raises(grpc.RpcError):
            put_shared(hostile, namespace_to_pb(ns), stored_hashes, offsets, sizes)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert f"block {BAD}" in raised.value.details() and message in raised.value.details(), raised.value.details()
    with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
        assert client.lookup(ns, hashes).num_blocks == 0  # nothing of the bad put, not even the blocks before BAD
        assert [bytes(b) for b in client.get(ns, stored_hashes)] == stored
    assert_healthy(node)


def test_scribbling_over_one_block_of_a_batch_during_the_copy_spoils_at_most_that_put(node: ThreadedServer) -> None:
    ns = sha_namespace("tenant-a")
    blocks = [encode_block(small_block(200 + i)) for i in range(NUM_BLOCKS)]
    offsets, sizes = _staged(blocks)
    valid = blocks[BAD]
    garbage = bytes(range(256)) * (len(valid) // 256 + 1)
    stop = threading.Event()
    outcomes: list[object] = []
    with RawSession(node.target, A) as hostile:
        view = hostile.put.view
        for block, offset in zip(blocks, offsets):
            view[offset:offset + len(block)] = block
        base = offsets[BAD]

        def scribble() -> None:  # flips block BAD between its valid bytes and garbage, 4 KiB at a time
            i = 0
            while not stop.is_set():
                start = (i * 4096) % len(valid)
                end = min(start + 4096, len(valid))
                view[base + start:base + end] = (valid if i % 2 else garbage)[start:end]
                i += 1

        thread = threading.Thread(target=scribble)
        thread.start()
        try:
            for attempt in range(30):
                hashes = hash_blocks(ns, list(range(16 * NUM_BLOCKS * attempt, 16 * NUM_BLOCKS * (attempt + 1))))
                try:
                    outcomes.append((hashes, put_shared(hostile, namespace_to_pb(ns), hashes, offsets, sizes)
                                     .num_stored))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
                    outcomes.append((hashes, exc.code()))
        finally:
            stop.set()
            thread.join()
    assert any(outcome == grpc.StatusCode.INVALID_ARGUMENT for _, outcome in outcomes)  # torn copies were refused
    with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
        for hashes, outcome in outcomes:
            if outcome == NUM_BLOCKS:  # stored only if every copy validated: then they are the valid blocks
                assert [bytes(b) for b in client.get(ns, hashes)] == blocks
            else:
                assert client.lookup(ns, hashes).num_blocks == 0
    assert_healthy(node)
