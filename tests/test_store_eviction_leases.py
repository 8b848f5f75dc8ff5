"""Eviction claims its victims with a lease and releases it: an evicted key comes back unpinned.

Regression: ``TieredStore._make_room`` pinned each victim and, once ``policy.remove`` kept leases
(they belong to readers), never unpinned it, so every evicted block stayed pinned and a memory tier
that saw blocks demoted and promoted back refused all puts.
"""
import asyncio
from pathlib import Path

import pytest

from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from tests.support.clock import turns_until
from tests.support.store import NS, disk_footprint, held_keys, make_blocks, memory_tier, writer_held, writes_queued


async def test_evicted_key_keeps_no_lease(tmp_path) -> None:
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 16 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes[:2], blocks[:2])
        await store.put(NS, hashes[2:], blocks[2:])          # memory full: one block demoted to disk
        assert len(store.index.policies[0]) == 2
        # no read is in flight: nothing may hold a reference
        assert held_keys(store) == [set(), set()]
        assert store.index.num_entries() == 0


async def test_promoted_back_block_is_evictable(tmp_path) -> None:
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 16 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(8)
        # cycle blocks through memory: each put evicts, each get of a demoted block promotes it back
        for i in range(8):
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        for i in range(8):
            assert await store.get(NS, hashes[i:i + 1]) == blocks[i:i + 1]
            await store.drain()                                # promotion into memory
        fresh, fresh_blocks = make_blocks(2, seed=7)
        # memory holds 2 blocks that were all evicted before => both pinned forever => no room
        for h, b in zip(fresh, fresh_blocks):
            await store.put(NS, [h], [b])                      # raises ResourceExhaustedError


# End to end through a real server: after one demote/promote cycle the memory tier refuses every new put.

from kvstore.client import KVStoreClient
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace


@pytest.mark.slow
def test_server_still_takes_puts_after_blocks_were_promoted_back(tmp_path) -> None:
    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": "8MiB",
                                           "store.disk.path": str(tmp_path / "disk"),
                                           "store.disk.capacity_bytes": "64MiB"}))
    try:
        ns = namespace()
        with KVStoreClient(server.target, retries=0) as kv:
            first, first_t = kv_blocks(ns, 7, num_layers=4, num_kv_heads=8, head_dim=512)            # ~1 MiB each
            second, second_t = kv_blocks(ns, 7, num_layers=4, num_kv_heads=8, head_dim=512, first_token=10_000)
            assert kv.put(ns, first, first_t) == 7
            assert kv.put(ns, second, second_t) == 7          # demotes `first` to disk
            assert kv.lookup(ns, first).tiers == ("disk",) * 7
            assert len(kv.get(ns, first)) == 7                # promotes `first` back (evicts `second`)
            server.call(server.server.store.drain())          # the promotions have run
            assert kv.lookup(ns, first).tiers == ("memory",) * 7
            third, third_t = kv_blocks(ns, 7, num_layers=4, num_kv_heads=8, head_dim=512, first_token=20_000)
            # no reader holds anything, `first` is evictable -> this must succeed
            assert kv.put(ns, third, third_t) == 7            # raises ResourceExhaustedError
    finally:
        server.stop()


async def test_room_held_by_deleted_blocks_still_leased_is_made_by_evicting_others() -> None:
    # regression: the store counted only the blocks it tracks, so the pages of 3 deleted blocks still being
    # read looked free; the put found the pool full, and one retry (room for twice the put) did not cover them
    async with TieredStore([memory_tier(4)]) as store:
        hashes, blocks = make_blocks(5)
        await store.put(NS, hashes[:4], blocks[:4])
        async with store.read(NS, hashes[:3]) as held:  # a slow reader of blocks 0..2
            await store.delete(NS, hashes[:3])
            await store.put(NS, hashes[4:], blocks[4:])  # block 3 is evicted for it
            assert [bytes(b) for b in held] == blocks[:3]  # the reader's views are intact
        assert await store.locate(NS, hashes[3:]) == b""
        assert await store.get(NS, hashes[4:]) == blocks[4:]


async def test_a_victim_leased_while_it_is_demoted_does_not_fail_the_put(tmp_path: Path) -> None:
    # regression: _make_room counts leased-but-deleted pages in _make_room, but the TierFullError retry still asks for
    # 2 * need on top of them: with one evictable block left, which is all the put needs, it raises
    memory = memory_tier(4)
    disk = LMDBTier(tmp_path / "disk", 16 * disk_footprint())
    store = TieredStore([memory, disk])
    await store.start()
    hashes, blocks = make_blocks(5)
    for h, b in zip(hashes[:4], blocks[:4]):  # A (oldest) .. D
        await store.put(NS, [h], [b])
    reading, done = asyncio.Event(), asyncio.Event()

    async def reader() -> None:
        async with store.read(NS, hashes[:3]) as held:  # A, B, C, leased from memory
            assert len(held) == 3
            reading.set()
            await done.wait()

    async with writer_held(disk):
        put = asyncio.ensure_future(store.put(NS, hashes[4:], blocks[4:]))  # evicts A, whose demotion waits
        await turns_until(lambda: writes_queued(disk) > 0)  # A's demotion has reached the held writer: the put waits
        read = asyncio.ensure_future(reader())
        await reading.wait()
    try:
        assert await put == 1  # room for E: D can go (A's pages are held by the reader, B and C are pinned)
    finally:
        done.set()
        await read
        await store.close()
