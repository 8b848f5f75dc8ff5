"""TTLs, sessions and miss causes on a real store (memory, LMDB and a real Redis): the bounds on pinned bytes, a
clamped TTL, and ``explain`` naming every cause of a miss, with the counts summing to the misses.

Clocks are injected: TTLs run on the test's clock, never on sleeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.config import PinsConfig, StoreConfig
from kvstore.keys import block_key
from kvstore.store.misses import CAUSES
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier, redis_config

HASHES, BLOCKS = make_blocks(24, seed=11)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_pins_over_a_bound_are_refused_as_pins_not_as_puts() -> None:
    async def go() -> None:
        config = StoreConfig(pins=PinsConfig(max_tier_fraction=0.25, max_ttl_s=60.0))
        async with TieredStore([memory_tier(8)], config) as store:
            assert await store.put(NS, HASHES[:6], BLOCKS[:6], ttl_s=30.0) == 6  # every block stored
            assert (await store.lookup(NS, HASHES[:6])).num_blocks == 6
            stats = store.stats()
            footprint = store.tiers[0].footprint(len(BLOCKS[0]))
            assert stats.tiers[0].pinned_bytes == 2 * footprint  # a quarter of 8 blocks: the last pinned keep theirs
            assert stats.counters["pins_displaced"] == 4 and stats.counters["pins_refused_tier"] == 0
            policy = store.index.policies[0]
            assert [policy.is_pinned(block_key(NS, h)) for h in HASHES[:6]] == [True, True] + [False] * 4
            await store.put(NS, HASHES[6:7], BLOCKS[6:7], ttl_s=3600.0)  # over store.pins.max_ttl_s: clamped
            assert store.stats().counters["ttl_clamped"] == 1

    run(go())


def test_the_node_and_tenant_bounds_and_a_pin_of_a_resident_block() -> None:
    async def go() -> None:
        footprint = memory_tier(1).footprint(len(BLOCKS[0]))
        config = StoreConfig(pins=PinsConfig(max_tier_fraction=1.0, max_bytes=3 * footprint,
                                             max_tenant_bytes=2 * footprint))
        salted = NS.__class__(model=NS.model, dtype=NS.dtype, block_size=NS.block_size, cache_salt="tenant-b")
        hashes_b, blocks_b = make_blocks(4, seed=3, ns=salted)
        async with TieredStore([memory_tier(16)], config) as store:
            await store.put(NS, HASHES[:4], BLOCKS[:4], ttl_s=10.0)
            assert store.stats().counters["pins_refused_tenant"] == 2  # tenant "" pins 2 blocks at most
            await store.put(salted, hashes_b[:3], blocks_b[:3], ttl_s=10.0)
            counters = store.stats().counters
            assert counters["pinned_bytes"] == 3 * footprint and counters["pins_refused_node"] == 2
            await store.put(NS, HASHES[8:9], BLOCKS[8:9])
            await store.get(NS, HASHES[8:9], ttl_s=10.0)  # a get's TTL pins what it returns, bounds permitting
            assert store.stats().counters["pins_refused_node"] == 3

    run(go())


def test_a_ttl_keeps_a_session_from_other_traffic_only_while_it_runs() -> None:
    async def go() -> None:
        clock = Clock()
        async with TieredStore([memory_tier(8)], StoreConfig(), clock=clock) as store:
            await store.put(NS, HASHES[:4], BLOCKS[:4], ttl_s=30.0, session_id="agent")  # half the tier: all pinned
            clock.now += 20.0
            for start in range(4, 12, 2):  # other traffic, more than the tier holds
                await store.put(NS, HASHES[start:start + 2], BLOCKS[start:start + 2])
            assert (await store.lookup(NS, HASHES[:4])).num_blocks == 4  # paused under its TTL: all of it hits
            assert len(await store.get(NS, HASHES[:4])) == 4  # a hit renews the TTL: 30 s from now
            clock.now += 29.0
            for start in range(12, 20, 2):
                await store.put(NS, HASHES[start:start + 2], BLOCKS[start:start + 2])
            assert (await store.lookup(NS, HASHES[:4])).num_blocks == 4
            clock.now += 2.0  # ran out
            await store.put(NS, HASHES[20:24], BLOCKS[20:24])
            assert (await store.lookup(NS, HASHES[:4])).num_blocks == 0  # the next victims, tail first
            explained = await store.explain(NS, HASHES[:4])
            assert [b.cause for b in explained] == ["expired"] * 4
            assert [b.cause for b in await store.explain(NS, HASHES[4:5])] == ["evicted"]  # other traffic: no TTL
            assert "evicted" in explained[0].detail or "TTL ran out" in explained[0].detail

    run(go())


def test_a_ttl_survives_demotion_promotion_and_a_restart(tmp_path: Path) -> None:
    async def go() -> None:
        clock = Clock()

        def open_store() -> TieredStore:
            disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint(), clock=clock)
            return TieredStore([memory_tier(2), disk], StoreConfig(pins=PinsConfig(max_tier_fraction=1.0)),
                               clock=clock)

        key = block_key(NS, HASHES[0])
        async with open_store() as store:
            await store.put(NS, HASHES[:1], BLOCKS[:1], ttl_s=50.0)
            await store.put(NS, HASHES[1:4], BLOCKS[1:4])  # block 0 is demoted to disk, its TTL with it
            disk = store.index.policies[1]
            assert store.index.level_of(key) == 1 and disk.pin_of(key) == (50.0, 1050.0)
            clock.now += 10.0
            await store.get(NS, HASHES[:1])  # renewed, and promoted with its TTL
            await store.drain()
            level = store.index.level_of(key)
            assert store.index.policies[level].pin_of(key) == (50.0, 1060.0)
        async with open_store() as store:  # memory was flushed to disk on close
            assert store.index.policies[1].pin_of(key) == (50.0, 1060.0)
        clock.now += 100.0
        async with open_store() as store:  # ran out while the node was down: kept, unpinned
            assert store.index.level_of(key) is not None and not store.index.policies[1].is_pinned(key)

    run(go())


@pytest.mark.slow
def test_explain_names_every_cause_and_the_counts_sum_to_the_misses(tmp_path: Path,
                                                                   redis_server: RedisProcess) -> None:  # noqa: F811
    async def go() -> None:
        clock = Clock()
        config = StoreConfig(redis=redis_config(redis_server.url, "write_back").redis, demote_min_priority=20,
                             pins=PinsConfig(max_tier_fraction=1.0))
        memory, disk = memory_tier(3), LMDBTier(tmp_path / "disk", 3 * disk_footprint(), clock=clock)
        store = TieredStore([memory, disk], config, shared=RedisTier(config.redis), clock=clock)
        await store.start()
        try:
            other = NS.__class__(model=NS.model, dtype=NS.dtype, block_size=NS.block_size, revision="v2")
            await store.put(NS, HASHES[:2], BLOCKS[:2])
            await store.delete(NS, HASHES[1:2])
            assert [b.cause for b in await store.explain(NS, HASHES[:3])] == ["", "deleted", "never_stored"]
            assert [b.cause for b in await store.explain(other, HASHES[:1])] == ["other_namespace"]
            await store.put(NS, HASHES[2:4], BLOCKS[2:4])
            await store.delete(NS, HASHES[2:3])
            after = await store.explain(NS, HASHES[2:4])
            assert [b.cause for b in after] == ["deleted", "after_miss"] and after[1].tier == "memory"
            await store.put(NS, HASHES[4:5], BLOCKS[4:5], priority=10, ttl_s=5.0)  # below the floor: dropped
            await store.put(NS, HASHES[5:6], BLOCKS[5:6], priority=10)
            clock.now += 10.0  # block 4's TTL ran out
            await store.put(NS, HASHES[6:12], BLOCKS[6:12])  # pushes everything down, and off the node
            await store.drain()
            causes = {b.position: b.cause for b in await store.explain(NS, HASHES[:12]) if not b.hit}
            assert causes[4] == causes[5] == "dropped", causes  # a victim under the floor, its TTL gone or not
            lost = block_key(NS, HASHES[11])
            await store.tiers[store.index.level_of(lost)].delete([lost])  # the record goes behind the store's back
            assert len(await store.get(NS, HASHES[11:12])) == 0  # the read finds it lost
            assert (await store.explain(NS, HASHES[11:12]))[0].cause == "lost"
            await store.put(NS, HASHES[12:20], BLOCKS[12:20])  # the oldest leave the disk for Redis (write-back)
            await store.drain()
            redis_server.kill()
            shared = [i for i, b in enumerate(await store.explain(NS, HASHES[:20])) if b.cause == "tier_unavailable"]
            assert shared, "no block that left for the dead Redis is named so"
            # a lookup, then an eviction, then the get: the blocks the lookup found and the get did not are raced
            found = (await store.lookup(NS, HASHES[19:20])).num_blocks
            await store.delete(NS, HASHES[19:20])
            assert found == 1 and await store.get(NS, HASHES[19:20]) == []
            await store.put(NS, HASHES[20:24], BLOCKS[20:24], ttl_s=1.0)
            clock.now += 5.0
            await store.put(NS, HASHES[:4], BLOCKS[:4])
            for hashes in (HASHES[:24], HASHES[5:9], HASHES[12:16]):
                await store.lookup(NS, hashes)
            stats = store.stats()
            assert set(stats.missed_blocks) == set(CAUSES)
            assert sum(stats.missed_blocks.values()) == stats.lookup_miss_blocks + stats.missed_blocks["lease_lost"]
            assert stats.missed_blocks["lease_lost"] == 1 and stats.missed_blocks["tier_unavailable"] > 0
        finally:
            await store.close()

    run(go())


def test_a_block_stored_again_after_its_eviction_is_no_longer_named_by_it() -> None:
    async def go() -> None:
        async with TieredStore([memory_tier(4)], StoreConfig()) as store:
            await store.put(NS, HASHES[:4], BLOCKS[:4])
            await store.put(NS, HASHES[4:8], BLOCKS[4:8])  # evicts the first chain
            assert store.index.history.get(block_key(NS, HASHES[1])) is not None
            await store.put(NS, HASHES[:4], BLOCKS[:4])  # stored again: the history forgets them
            assert store.index.history.get(block_key(NS, HASHES[1])) is None
            await store.delete(NS, HASHES[:1])
            assert (await store.lookup(NS, HASHES[:4])).num_blocks == 0
            by_cause = store.misses.counts.by_cause
            assert by_cause["deleted"] == 1 and by_cause["after_miss"] == 3 and by_cause["evicted"] == 0
            await store.put(NS, HASHES[8:12], BLOCKS[8:12])  # evicts the chain again, tail first
            assert (await store.lookup(NS, HASHES[1:4])).num_blocks == 0
            assert by_cause["evicted"] == 3 and store.misses.counts.reuse_gap_counts[0] == 3

    run(go())
