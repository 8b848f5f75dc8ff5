"""Tests of the heap tier: the shared contract (with and without a framing), then its framed values and leases."""

from __future__ import annotations

import functools

import pytest

from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.errors import ConfigError, InvalidArgumentError, UnavailableError
from kvstore.wire import decode_block_chunk, encode_block_chunk, reply_head
from kvstore.store.factory import open_async_store
from kvstore.tiers.base import LendingTier, TierFullError
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES, HeapTier
from kvstore.tiers.memory import MemoryTier
from tests.support.tier_contract import TierContract, make_block, make_key, make_sized_block, meta

KiB = 1024
MiB = 1024 * KiB
CHUNK = 64 * KiB
HEADS = functools.partial(reply_head, chunk_bytes=CHUNK)


class TestHeapTierContract(TierContract):
    @pytest.fixture(params=["reply heads", "bare"])
    async def tier(self, request):
        tier = HeapTier(4 * MiB, framing=HEADS if request.param == "reply heads" else None)
        yield tier
        await tier.close()


def test_a_heap_tier_is_a_leasing_tier():
    assert isinstance(HeapTier(MiB), LendingTier)


def test_a_negative_capacity_is_refused():
    with pytest.raises(InvalidArgumentError):
        HeapTier(-1)


def test_footprint_is_the_block_and_a_fixed_overhead():
    assert HeapTier(MiB).footprint(1000) == 1000 + BLOCK_OVERHEAD_BYTES
    assert BLOCK_OVERHEAD_BYTES >= len(reply_head(1 << 40, chunk_bytes=1 << 41)) + 33  # type: ignore[arg-type]


async def test_a_block_is_stored_as_its_ready_reply_and_leased_without_a_copy():
    tier = HeapTier(MiB, framing=HEADS)
    block = make_block(0)
    await tier.put([make_key(0)], [memoryview(block)], [meta()])
    lease = tier.lend([make_key(0), make_key(1)])
    (reply, missing), (value, miss) = lease.framed, lease.values  # type: ignore[misc]
    assert missing is None and miss is None
    assert reply == encode_block_chunk(0, len(block), block, True)
    assert decode_block_chunk(reply)[1] == block == value
    assert isinstance(value, memoryview) and value.readonly and value.obj is reply  # a view of the reply itself
    assert tier.lend([make_key(0)]).framed[0] is reply  # type: ignore[index]  # the same object on every read
    lease.release()
    await tier.close()


async def test_a_block_already_behind_its_head_is_kept_without_a_copy_and_any_other_view_is_copied():
    tier = HeapTier(MiB, framing=HEADS)
    block = make_block(0)
    head = HEADS(len(block))
    framed = b"".join((head, block))  # as a same-host Put copies a block out of the client's segment
    tail = memoryview(framed)[len(head):]
    same_bytes_elsewhere = memoryview(b"".join((head, block, b"x")))[len(head):-1]  # not the tail of its bytes
    shifted = memoryview(b"".join((b"y" * len(head), block)))[len(head):]  # the tail, behind something else
    await tier.put([make_key(i) for i in range(3)], [tail, same_bytes_elsewhere, shifted], [meta()] * 3)
    lease = tier.lend([make_key(i) for i in range(3)])
    assert lease.framed[0] is framed  # type: ignore[index]
    assert all(reply == encode_block_chunk(0, len(block), block, True) for reply in lease.framed)  # type: ignore[union-attr]
    assert lease.framed[1] is not same_bytes_elsewhere.obj and lease.framed[2] is not shifted.obj  # type: ignore[index]
    lease.release()
    await tier.close()


async def test_a_block_over_one_message_is_stored_bare_and_a_bytes_value_is_kept_as_is():
    tier = HeapTier(MiB, framing=HEADS)
    big = make_sized_block(0, CHUNK + 2)
    await tier.put([make_key(0)], [big], [meta()])
    lease = tier.lend([make_key(0)])
    assert lease.framed == [None] and lease.values[0] is big
    assert (await tier.get([make_key(0)]))[0] is big
    lease.release()
    await tier.close()


async def test_a_bare_tier_copies_only_what_is_not_bytes():
    tier = HeapTier(MiB)
    block = make_block(0)
    await tier.put([make_key(0), make_key(1)], [block, bytearray(block)], [meta()] * 2)
    lease = tier.lend([make_key(0), make_key(1)])
    assert lease.framed == [None, None]
    assert lease.values[0] is block and type(lease.values[1]) is bytes and lease.values[1] == block
    lease.release()
    await tier.close()


async def test_capacity_counts_footprints_and_a_batch_that_does_not_fit_stores_nothing():
    block = make_sized_block(0, 10 * KiB)
    tier = HeapTier(3 * tier_footprint(block), framing=HEADS)
    await tier.put([make_key(0), make_key(1)], [block, block], [meta()] * 2)
    assert tier.used_bytes == 2 * tier_footprint(block)
    with pytest.raises(TierFullError):
        await tier.put([make_key(2), make_key(3)], [block, block], [meta()] * 2)
    assert await tier.contains([make_key(2), make_key(3)]) == [False, False]
    await tier.put([make_key(0), make_key(2)], [block, block], [meta()] * 2)  # replacing key 0 frees its room
    assert tier.used_bytes == 3 * tier_footprint(block) and tier.num_blocks == 3
    await tier.close()


def tier_footprint(block: bytes) -> int:
    return len(block) + BLOCK_OVERHEAD_BYTES


async def test_a_lease_is_a_reference_that_outlives_a_delete_and_a_replace():
    old, new = make_sized_block(1, 10 * KiB), make_sized_block(2, 10 * KiB)
    tier = HeapTier(tier_footprint(old), framing=HEADS)
    assert tier.lends_references
    await tier.put([make_key(1)], [old], [meta()])
    lease = tier.lend([make_key(1), make_key(1)])
    await tier.put([make_key(1)], [new], [meta()])  # the full tier takes the new value in the old one's room
    assert await tier.get([make_key(1)]) == [new] and tier.used_bytes == tier_footprint(new)
    await tier.delete([make_key(1)])
    assert tier.used_bytes == 0 and await tier.contains([make_key(1)]) == [False]
    assert lease.values == [old, old]  # the leased values never change
    assert all(decode_block_chunk(reply)[1] == old for reply in lease.framed)  # type: ignore[union-attr, arg-type]
    lease.release()
    lease.release()  # nothing to give back, however often
    assert tier.used_bytes == 0
    await tier.close()


async def test_a_batch_with_a_value_that_is_not_bytes_like_stores_nothing_of_it():
    tier = HeapTier(MiB, framing=HEADS)
    with pytest.raises(InvalidArgumentError, match="bytes-like"):
        await tier.put([make_key(0), make_key(1)], [make_block(0), 12345], [meta()] * 2)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="priority"):  # every occurrence of a key is checked
        await tier.put([make_key(0), make_key(0)], [make_block(0)] * 2, [meta(priority=500), meta()])
    assert await tier.resident() == [] and tier.used_bytes == 0
    await tier.close()


async def test_a_non_contiguous_or_typed_value_is_stored_as_its_bytes():
    tier = HeapTier(MiB, framing=HEADS)
    block = make_block(0)
    strided = memoryview(bytearray(block) * 2)[::2]  # every other byte: not contiguous
    typed = memoryview(bytearray(block)).cast("H")  # two bytes per item
    await tier.put([make_key(0), make_key(1)], [strided, typed], [meta()] * 2)
    assert await tier.get([make_key(0), make_key(1)]) == [bytes(strided), block]
    assert tier.used_bytes == 2 * (len(block) + BLOCK_OVERHEAD_BYTES)
    await tier.close()


async def test_leases_outlive_a_close_and_releasing_after_it_is_harmless():
    tier = HeapTier(MiB, framing=HEADS)
    block = make_block(0)
    await tier.put([make_key(0)], [block], [meta()])
    lease = tier.lend([make_key(0)])
    await tier.close()
    assert lease.values[0] == block
    lease.release()
    with pytest.raises(UnavailableError):
        tier.lend([make_key(0)])


# -- which memory tier a store gets ----------------------------------------------------


@pytest.mark.parametrize("storage, with_heads, expected", [
    ("auto", True, HeapTier),  # kvstore serve
    ("auto", False, MemoryTier),  # the embedded store
    ("pages", True, MemoryTier),
    ("heap", False, HeapTier),
])
async def test_storage_picks_the_memory_tier(storage: str, with_heads: bool, expected: type) -> None:
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=MiB, storage=storage))
    store = await open_async_store(config, framing=HEADS if with_heads else None)
    try:
        assert type(store.tiers[0]) is expected
    finally:
        await store.close()


def test_heap_storage_is_host_memory_only():
    with pytest.raises(ConfigError, match="heap"):
        MemoryTierConfig(storage="heap", device="cuda:0")
    with pytest.raises(ConfigError, match="storage"):
        MemoryTierConfig(storage="disk")
