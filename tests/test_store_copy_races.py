"""Deletes against copies to and from the shared tier in flight, over a real redis-server.

A write-through, a promotion of a Redis hit and a demotion into Redis run in the
background (``kvstore.store``, ``kvstore.tombstones``); a delete or clear that
overlaps one must win, and a put made after it must not be lost.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstore.store import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.test_store import NS, PAGE, disk_footprint, make_blocks, memory_tier
from tests.test_store_index_stress import writer_held
from tests.test_store_redis import redis_config, store_key


def slow_first_put(store: TieredStore, delay: float = 0.2):
    """Delay the first shared put by ``delay`` s before it is sent (a slow Redis / queued connection)."""
    real = store._shared.put
    calls = {"n": 0}

    async def put(keys, values, metas):
        calls["n"] += 1
        if calls["n"] == 1:
            await asyncio.sleep(delay)
        return await real(keys, values, metas)

    store._shared.put = put
    return calls


def gate_tier_put(tier):
    """Hold the tier's next put until the returned event is set."""
    gate, real = asyncio.Event(), tier.put
    entered = asyncio.Event()

    async def put(keys, values, metas):
        entered.set()
        await gate.wait()
        return await real(keys, values, metas)

    tier.put = put
    return gate, entered


async def test_a_delete_during_a_write_through_put_wins_in_memory_and_in_redis_alike(
        redis_server: RedisProcess) -> None:
    """Regression: the put still published its block in memory but skipped its write-through, and a put after
    the delete found the block resident and wrote nothing through: memory and Redis disagreed for good."""
    config = redis_config(redis_server.url, "write_through")
    memory = MemoryTier(8 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE)  # the put awaits a thread
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=3)
        put = asyncio.create_task(store.put(NS, hashes, blocks))
        await asyncio.sleep(0)  # the placement is copying in a thread
        await store.delete(NS, hashes)  # finished before the placement publishes
        await put
        await store.drain()
        # a put strictly after the delete finished
        await store.put(NS, hashes, blocks)
        await store.drain()
        local = (await store.lookup(NS, hashes)).tiers
        in_redis = bool(redis_server.client().exists(store_key(store, hashes[0])))
        assert local == ("memory",)
        assert in_redis, "block is in memory but never reached Redis despite a put after the delete"


async def test_a_late_write_through_never_removes_a_later_puts_block_from_redis(redis_server: RedisProcess) -> None:
    """Regression: an early put's write-through landed after a delete and was undone by a DEL, which also
    removed the write of a put made after the delete. Deletes now wait for writes in flight instead."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=4)
        slow_first_put(store, 0.3)
        await store.put(NS, hashes, blocks)  # P1: write-through spawned, its SET delayed
        await asyncio.sleep(0.01)
        await store.delete(NS, hashes)  # D: finished
        await store.put(NS, hashes, blocks)  # P2, after D: must reach Redis
        await store.drain()
        assert (await store.lookup(NS, hashes)).tiers == ("memory",)
        assert redis_server.client().exists(store_key(store, hashes[0])), \
            "P2's write-through was undone by P1's undo"
        assert len(store._tombstones) == 0 and not store._tombstones._open


async def test_a_promotion_that_fits_no_local_tier_cannot_undo_a_delete(redis_server: RedisProcess) -> None:
    """Regression (write_back): a Redis hit too large for memory was SET back into Redis by its promotion,
    unchecked, so a delete that landed first was undone."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(1 * PAGE, page_bytes=PAGE)  # a block takes two pages: none fits
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=6)
        await store.put(NS, hashes, blocks)  # straight to Redis (fits no local tier)
        assert redis_server.client().exists(store_key(store, hashes[0]))
        slow_first_put(store, 0.3)  # the next SET is the promotion's
        assert await store.get(NS, hashes) == blocks  # promotion spawned
        await asyncio.sleep(0.05)  # promotion passed its deleted_since filter, its SET is delayed
        await store.delete(NS, hashes)
        await store.drain()
        assert not redis_server.client().exists(store_key(store, hashes[0])), "delete undone by a promotion"


async def test_a_promotion_that_fits_no_local_tier_writes_nothing_back_to_redis(redis_server: RedisProcess) -> None:
    """Regression: such a promotion re-wrote what it had just read (resetting the key's TTL)."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(1 * PAGE, page_bytes=PAGE)
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=6)
        await store.put(NS, hashes, blocks)
        before = store._shared.counters().get("written")
        assert await store.get(NS, hashes) == blocks
        await store.drain()
        assert store._shared.counters().get("written") == before, store._shared.counters()


async def test_a_delete_during_a_demotion_into_redis_neither_fails_the_put_nor_is_undone(
        redis_server: RedisProcess) -> None:
    """Regression (write_back, memory for one block): a second put evicts the first into Redis; a delete of
    the victim while the demotion reads it made the put fail with a KeyError."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(1 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE)
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(2, seed=8)
        await store.put(NS, hashes[:1], blocks[:1])
        put = asyncio.create_task(store.put(NS, hashes[1:], blocks[1:]))  # evicts block 0 into Redis
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await store.delete(NS, hashes[:1])
        assert await put == 1  # observed: KeyError from PriorityLRUPolicy.priority_of
        await store.drain()
        assert not redis_server.client().exists(store_key(store, hashes[0]))
        assert len(store._tombstones) == 0 and not store._tombstones._open


async def test_a_put_after_a_delete_does_not_wait_on_an_older_put_the_delete_overtook(
        redis_server: RedisProcess) -> None:
    """Regression: the later put waited for the older one, which lost to the delete, and stored nothing."""
    """P1 placing (in flight), D deletes and finishes, P2 (strictly after D) puts the same block: P2 joins P1's
    pending placement, which now drops the block (since=epoch) and skips its write-through. P2 returns 0 and
    the block is nowhere."""
    config = redis_config(redis_server.url, "write_through")
    memory = memory_tier(8)
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=21)
        gate, entered = gate_tier_put(memory)
        p1 = asyncio.create_task(store.put(NS, hashes, blocks))
        await entered.wait()                      # P1's placement is writing into memory
        await store.delete(NS, hashes)            # D: finished
        p2 = asyncio.create_task(store.put(NS, hashes, blocks))  # P2: strictly after D
        await asyncio.sleep(0.01)
        gate.set()
        await p1
        n2 = await p2
        await store.drain()
        local = (await store.lookup(NS, hashes)).tiers
        in_redis = bool(redis_server.client().exists(store_key(store, hashes[0])))
        assert (n2, local, in_redis) == (1, ("memory",), True), (n2, local, in_redis)


async def test_a_cancelled_delete_still_deletes_from_redis(redis_server: RedisProcess) -> None:
    """A delete cancelled while it waits for a write into Redis in flight: the block must not come back from Redis."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=23)
        slow_first_put(store, 0.3)
        await store.put(NS, hashes, blocks)
        await asyncio.sleep(0.01)
        d = asyncio.create_task(store.delete(NS, hashes))
        await asyncio.sleep(0.05)
        d.cancel()
        try:
            await d
        except asyncio.CancelledError:
            pass
        await store.drain()
        assert await store.get(NS, hashes) == [], "a cancelled delete: the block comes back from Redis"


async def test_a_clear_wins_over_a_put_still_placing_its_blocks(tmp_path: Path) -> None:
    # regression: clear() collects pending keys ("puts still placing them lose, too"), but without write-through the
    # placement has no copy window (since=None), so it published its block after the clear returned
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([disk])
    await store.start()
    hashes, blocks = make_blocks(1)
    async with writer_held(disk):
        put = asyncio.ensure_future(store.put(NS, hashes, blocks))
        await asyncio.sleep(0.05)  # placing: its LMDB write is queued
        clear = asyncio.ensure_future(store.clear(NS))
        await asyncio.sleep(0.05)
    await clear
    await put
    assert (await store.lookup(NS, hashes)).num_blocks == 0
    await store.close()
