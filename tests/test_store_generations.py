"""A stale generation loses: each operation whose entry was removed while its I/O ran discards what it wrote.

Every test holds one tier call of the operation at a gate (``tests.support.store.GatedTier``: an event, never a
sleep), runs the racing delete, clear or put, opens the gate, and checks that the store serves what the order of
the calls says, and that every tier still matches the index.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import (
    NS,
    GatedTier,
    disk_footprint,
    held_keys,
    make_blocks,
    memory_tier,
    redis_config,
    tier_and_index_disagree,
)


async def test_a_put_whose_write_a_delete_overtakes_publishes_nothing(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(2)
        gated = GatedTier(disk, "put")
        put = asyncio.ensure_future(store.put(NS, hashes, blocks))
        await gated.entered.wait()  # placing: its write is in the tier's hands
        assert await store.delete(NS, hashes) == 0  # nothing resident yet; the placement is retired
        gated.gate.set()
        assert await put == 2  # the put succeeds, but its generation is stale: it publishes nothing
        assert (await store.lookup(NS, hashes)).num_blocks == 0
        assert not await tier_and_index_disagree(store)  # and the record it wrote is gone again


async def test_a_put_made_after_a_delete_of_a_placement_is_stored(tmp_path: Path) -> None:
    """The newer put of the same keys waits for the stale placement to end (its record is discarded first), then
    writes its own: the newer generation wins."""
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(2)
        gated = GatedTier(disk, "put")
        old = asyncio.ensure_future(store.put(NS, hashes, blocks))
        await gated.entered.wait()
        await store.delete(NS, hashes)
        new = asyncio.ensure_future(store.put(NS, hashes, blocks))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not new.done()  # it waits for the stale placement
        gated.gate.set()
        assert await old == 2 and await new == 2
        assert await store.get(NS, hashes) == blocks
        assert not await tier_and_index_disagree(store)


async def test_a_demotion_whose_block_is_deleted_meanwhile_publishes_nothing_below(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory_tier(1), disk]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes[:1], blocks[:1])
        gated = GatedTier(disk, "put")  # the demotion's write into disk
        put = asyncio.ensure_future(store.put(NS, hashes[1:], blocks[1:]))  # evicts block 0 into disk
        await gated.entered.wait()
        assert (await store.lookup(NS, hashes[:1])).tiers == ("memory",)  # a victim stays readable until moved
        assert await store.delete(NS, hashes[:1]) == 1
        gated.gate.set()
        assert await put == 1
        assert (await store.lookup(NS, hashes[:1])).num_blocks == 0  # not resurrected on disk
        assert await store.get(NS, hashes[1:]) == blocks[1:]
        assert not await tier_and_index_disagree(store)


async def test_a_promotion_whose_block_is_deleted_meanwhile_publishes_nothing_above(tmp_path: Path) -> None:
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(3)
        for i in range(3):
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        assert (await store.lookup(NS, hashes[:1])).tiers == ("disk",)
        gated = GatedTier(memory, "put")  # the promotion's write into memory (the mover's queue)
        assert await store.get(NS, hashes[:1]) == blocks[:1]
        await gated.entered.wait()
        assert await store.delete(NS, hashes[:1]) == 1
        gated.gate.set()
        await store.drain()
        assert (await store.lookup(NS, hashes[:1])).num_blocks == 0
        assert not await tier_and_index_disagree(store)


async def test_a_read_of_a_block_moved_out_meanwhile_is_not_cut_short(tmp_path: Path) -> None:
    """The reader's reference keeps the block's old record (a retired entry) until it has read it: no follow-up
    read, no shorter prefix."""
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(3)
        for i in range(3):
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        gated = GatedTier(disk, "get")
        first = asyncio.ensure_future(store.get(NS, hashes[:1]))  # holds block 0 on disk, its read at the gate
        await gated.entered.wait()
        second = store.read(NS, hashes[:1], lend=False)
        assert await second.open() == blocks[:1]  # a second reader (its disk read is not gated)
        second.close()  # ... whose promotion moves block 0 into memory
        await store.drain()
        assert (await store.lookup(NS, hashes[:1])).tiers == ("memory",)
        assert held_keys(store) == [set(), set()]  # the first reader holds the retired entry, not a resident one
        gated.gate.set()
        assert await first == blocks[:1]
        await store.drain()
        assert not await tier_and_index_disagree(store)  # the old record went with the last reader


async def test_a_clear_wins_over_a_put_still_placing_and_loses_to_one_made_after(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory_tier(4), disk]) as store:
        hashes, blocks = make_blocks(4)
        await store.put(NS, hashes[:2], blocks[:2])
        gated = GatedTier(store.tiers[0], "put")
        placing = asyncio.ensure_future(store.put(NS, hashes[2:3], blocks[2:3]))
        await gated.entered.wait()
        assert await store.clear(NS) == 2
        gated.gate.set()
        await placing
        assert await store.put(NS, hashes[3:], blocks[3:]) == 1  # after the clear: the namespace's next generation
        assert [(await store.lookup(NS, [h])).num_blocks for h in hashes] == [0, 0, 0, 1]
        assert not await tier_and_index_disagree(store)


async def test_a_write_through_begun_before_a_clear_lands_where_nothing_reads(redis_server: RedisProcess) -> None:
    config = redis_config(redis_server.url, "write_through")
    shared = RedisTier(config.redis)
    async with TieredStore([memory_tier(4)], config, shared=shared) as store:
        hashes, blocks = make_blocks(2)
        gated = GatedTier(shared, "put")  # the mover's write-through, its generation taken at the put
        assert await store.put(NS, hashes, blocks) == 2
        await gated.entered.wait()
        await store.clear(NS)
        gated.gate.set()
        await store.drain()
        assert (await store.lookup(NS, hashes)).num_blocks == 0  # neither local nor in Redis
        raw = redis_server.client()
        generation_0 = [shared.redis_key(k, 0) for k in (block_key_of(h) for h in hashes)]
        generation_1 = [shared.redis_key(k, 1) for k in (block_key_of(h) for h in hashes)]
        assert not any(raw.exists(name) for name in generation_1)
        assert not any(raw.exists(name) for name in generation_0)  # written, then unlinked as stale, or swept


async def test_a_promotion_of_a_redis_hit_read_before_a_clear_is_dropped(redis_server: RedisProcess) -> None:
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(4)], config, shared=RedisTier(config.redis)) as writer, \
            TieredStore([memory_tier(4)], config, shared=RedisTier(config.redis)) as reader:
        hashes, blocks = make_blocks(2)
        await writer.put(NS, hashes, blocks)
        await writer.drain()
        gated = GatedTier(reader.tiers[0], "put")  # the reader's promotion into memory
        assert await reader.get(NS, hashes) == blocks
        await gated.entered.wait()
        await reader.clear(NS)
        gated.gate.set()
        await reader.drain()
        assert (await reader.lookup(NS, hashes)).num_blocks == 0
        assert reader.stats().tier("memory").blocks == 0
        assert not await tier_and_index_disagree(reader)


def block_key_of(block_hash: bytes) -> bytes:
    from kvstore.keys import block_key

    return block_key(NS, block_hash)
