"""The tiered store over a real shared Redis: write-through, write-back, Redis failures and tenant isolation."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from kvstore.keys import block_key
from kvstore.store.tiered import TieredStore
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.clock import FakeClock
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import NS, PAGE, disk_footprint, make_blocks, memory_tier, redis_config, store_key


def store_with_redis(url: str, mode: str, num_blocks: int = 8,
                     breaker_clock: Callable[[], float] = time.monotonic) -> TieredStore:
    config = redis_config(url, mode)
    return TieredStore([memory_tier(num_blocks)], config, shared=RedisTier(config.redis, breaker_clock=breaker_clock))


async def test_write_through_put_on_one_node_hits_on_another(redis_server: RedisProcess) -> None:
    hashes, blocks = make_blocks(4)
    async with store_with_redis(redis_server.url, "write_through") as node_a, \
            store_with_redis(redis_server.url, "write_through") as node_b:
        await node_a.put(NS, hashes, blocks)
        await node_a.drain()  # the write-through has reached Redis
        result = await node_b.lookup(NS, hashes)
        assert result.num_blocks == 4 and result.tiers == ("redis",) * 4
        assert await node_b.get(NS, hashes) == blocks
        await node_b.drain()
        assert (await node_b.lookup(NS, hashes)).tiers == ("memory",) * 4  # promoted locally
        assert node_b.stats().tier("redis").hits == 4 and node_b.stats().tier("redis").promotions == 4


async def test_blocks_promoted_from_redis_get_the_configured_default_priority(redis_server: RedisProcess) -> None:
    """Regression: they got the library constant (35), not ``default_priority``, so they went before every
    block put without a priority (or were dropped instead of demoted, under ``demote_min_priority``)."""
    config = dataclasses.replace(redis_config(redis_server.url, "write_through"), default_priority=50)
    hashes, blocks = make_blocks(2)
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_a, \
            TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_b:
        await node_a.put(NS, hashes, blocks)
        await node_a.drain()
        assert await node_b.get(NS, hashes) == blocks
        await node_b.drain()
        keys = [block_key(NS, h) for h in hashes]
        assert [node_a.index.policies[0].priority_of(k) for k in keys] == [50, 50]
        assert [node_b.index.policies[0].priority_of(k) for k in keys] == [50, 50]  # observed: [35, 35]


async def test_write_back_demotes_evicted_blocks_to_redis(redis_server: RedisProcess) -> None:
    hashes, blocks = make_blocks(4)
    async with store_with_redis(redis_server.url, "write_back", num_blocks=2) as store:
        await store.put(NS, hashes, blocks)
        assert (await store.lookup(NS, hashes)).tiers == ("memory", "memory", "redis", "redis")
        assert store.stats().tier("redis").demotions == 2
        assert await store.get(NS, hashes) == blocks
        assert redis_server.client().exists(store_key(store, hashes[3]))


async def test_redis_killed_mid_loop_never_reaches_the_caller(redis_server: RedisProcess) -> None:
    clock = FakeClock()
    async with store_with_redis(redis_server.url, "write_through", num_blocks=64, breaker_clock=clock) as store:
        raw = redis_server.client()
        for round_ in range(12):
            if round_ == 4:
                redis_server.kill()
            if round_ == 8:
                redis_server.start()
            if round_ >= 8:
                clock.advance(0.3)  # past breaker_reset_s: the round's first call may be the trial
            hashes, blocks = make_blocks(2, seed=round_)
            assert await store.put(NS, hashes, blocks) == 2
            assert await store.get(NS, hashes) == blocks  # the memory tier keeps answering
            await store.drain()
        counters = store.stats().tier("redis").counters
        assert counters["errors"] + counters["timeouts"] + counters["breaker_open"] > 0
        raw = redis_server.client()  # writes resumed after the restart
        late, _ = make_blocks(2, seed=11)
        assert all(raw.exists(store_key(store, h)) for h in late)


async def test_tenants_never_hit_each_other_in_any_tier(redis_server: RedisProcess, tmp_path) -> None:
    """Tenant B never hits tenant A's blocks in memory, LMDB or Redis, after eviction too."""
    from kvstore.tiers.lmdb import LMDBTier

    tenant_a, tenant_b = NS, dataclasses.replace(NS, cache_salt="tenant-b")
    tokens_hashes_a, blocks = make_blocks(6)
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(2 * 2 * PAGE, page_bytes=PAGE)
    disk = LMDBTier(tmp_path / "d", 2 * disk_footprint())
    async with TieredStore([memory, disk], config, shared=RedisTier(config.redis)) as store:
        await store.put(tenant_a, tokens_hashes_a, blocks)
        tiers = (await store.lookup(tenant_a, tokens_hashes_a)).tiers
        assert {"memory", "disk", "redis"} <= set(tiers), tiers  # A's blocks now sit in every tier
        # B asks with the very same hash bytes (a client that guessed them); the namespace keeps them apart
        assert (await store.lookup(tenant_b, tokens_hashes_a)).num_blocks == 0
        assert await store.get(tenant_b, tokens_hashes_a) == []
        assert await store.clear(tenant_b) == 0
        assert (await store.lookup(tenant_a, tokens_hashes_a)).num_blocks == 6


async def test_a_redis_block_that_does_not_fit_its_namespace_is_a_miss(redis_server: RedisProcess) -> None:
    """Regression: a checksummed block of another dtype and shape, written into Redis by something other than
    a node (a node of another version, a bad script), was served by Get and promoted; Put refuses it."""
    import torch

    from kvstore.blocks.tensors import encode_block

    hashes, blocks = make_blocks(2)
    wrong = encode_block(torch.zeros(3, 2, 5, 7, 9, dtype=torch.float32))  # float32, 7 tokens: not NS's
    async with store_with_redis(redis_server.url, "write_through") as node_a, \
            store_with_redis(redis_server.url, "write_through") as node_b:
        await node_a.put(NS, hashes, blocks)
        await node_a.drain()
        redis_server.client().set(store_key(node_a, hashes[1]), wrong)  # same key, a foreign value
        assert await node_b.get(NS, hashes) == blocks[:1]  # observed: the float32 block served as block 1
        await node_b.drain()
        assert (await node_b.lookup(NS, hashes)).tiers == ("memory", "redis")  # block 0 promoted, not block 1


async def test_a_cancelled_write_through_put_still_writes_through_what_it_stored(redis_server: RedisProcess) -> None:
    """A put cancelled while its (shielded) placement ran stored the block locally but never wrote it through; a
    retry saw it resident and skipped it too, and once memory dropped it (write-through drops victims) it was gone."""
    config = redis_config(redis_server.url, "write_through")
    memory = MemoryTier(2 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE)  # copies in a thread: the put awaits
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(3, seed=5)
        put = asyncio.create_task(store.put(NS, hashes[:1], blocks[:1]))
        await asyncio.sleep(0)
        put.cancel()
        try:
            await put
        except asyncio.CancelledError:
            pass
        await store.drain()
        assert await store.put(NS, hashes[:1], blocks[:1]) == 0  # resident already
        await store.put(NS, hashes[1:], blocks[1:])  # memory holds two: the first block is dropped from it
        await store.drain()
        assert await store.get(NS, hashes[:1]) == blocks[:1]  # from Redis


async def test_a_delete_right_after_a_write_through_put_stays_deleted(redis_server: RedisProcess) -> None:
    """Regression: the put's write-through ran as a background task, so the delete's DEL could reach Redis
    before its SET, and the block came back in Redis (then, on a read, in memory)."""
    hashes, blocks = make_blocks(3)
    async with store_with_redis(redis_server.url, "write_through") as store:
        await store.put(NS, hashes, blocks)
        await store.delete(NS, hashes[1:])  # before the write-through task has run
        await store.drain()
        raw = redis_server.client()
        assert [bool(raw.exists(store_key(store, h))) for h in hashes] == [True, False, False]
        assert (await store.lookup(NS, hashes)).num_blocks == 1


async def test_a_clear_right_after_a_write_through_put_stays_cleared(redis_server: RedisProcess) -> None:
    hashes, blocks = make_blocks(3)
    async with store_with_redis(redis_server.url, "write_through") as store:
        await store.put(NS, hashes, blocks)
        await store.clear(NS)
        await store.drain()  # the sweep of the old generation too
        assert redis_server.client().keys(f"kvstore:{NS.tag.hex()}:*") == [f"kvstore:{NS.tag.hex()}:generation".encode()]
        assert (await store.lookup(NS, hashes)).num_blocks == 0


async def test_a_block_deleted_while_its_redis_hit_is_promoted_stays_deleted(redis_server: RedisProcess) -> None:
    """A read that hit Redis promotes the block in the background; a delete in between must win."""
    hashes, blocks = make_blocks(2)
    async with store_with_redis(redis_server.url, "write_through") as node_a, \
            store_with_redis(redis_server.url, "write_through") as node_b:
        await node_a.put(NS, hashes, blocks)
        await node_a.drain()
        assert await node_b.get(NS, hashes) == blocks  # Redis hits: the promotion is spawned, not yet run
        await node_b.delete(NS, hashes)
        await node_b.drain()
        assert (await node_b.lookup(NS, hashes)).num_blocks == 0
        assert node_b.stats().tier("memory").blocks == 0
