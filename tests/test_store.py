"""Tests of the tiered store over real memory and LMDB tiers."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import lmdb
import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import DiskTierConfig, MemoryTierConfig, StoreConfig
from kvstore.embedded import open_store
from kvstore.errors import ChecksumError, InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kvstore.keys import block_key, block_keys, hash_blocks
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from tests.support.clock import FakeClock
from tests.support.store import (
    BLOCK_SIZE, NS, PAGE, SharedMemoryTier, disk_footprint, held_keys, heap_tier, make_blocks, memory_tier,
)

@pytest.fixture
async def two_tier(tmp_path):
    """Memory for 3 blocks over LMDB for 8 blocks."""
    memory = memory_tier(3)
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    store = TieredStore([memory, disk])
    await store.start()
    yield store
    await store.close()


async def test_put_lookup_get_round_trip() -> None:
    async with TieredStore([memory_tier(16)]) as store:
        hashes, blocks = make_blocks(5)
        assert await store.put(NS, hashes, blocks) == 5
        assert await store.put(NS, hashes, blocks) == 0  # already resident: not written twice
        result = await store.lookup(NS, hashes)
        assert result.num_blocks == 5 and result.tiers == ("memory",) * 5
        assert await store.get(NS, hashes) == blocks


async def test_prefix_semantics_stop_at_first_miss() -> None:
    async with TieredStore([memory_tier(16)]) as store:
        hashes, blocks = make_blocks(5)
        await store.put(NS, hashes[:2] + hashes[3:], blocks[:2] + blocks[3:])
        assert (await store.lookup(NS, hashes)).num_blocks == 2
        assert await store.get(NS, hashes) == blocks[:2]
        other, _ = make_blocks(2, seed=9)
        assert (await store.lookup(NS, other + hashes)).num_blocks == 0


async def test_demotion_chain_and_promotion(two_tier: TieredStore) -> None:
    store = two_tier
    hashes, blocks = make_blocks(6)
    await store.put(NS, hashes[:3], blocks[:3])
    await store.put(NS, hashes[3:], blocks[3:])
    result = await store.lookup(NS, hashes)
    assert result.num_blocks == 6
    assert result.tiers == ("disk",) * 3 + ("memory",) * 3
    stats = store.stats()
    assert stats.tier("memory").evictions == 3 and stats.tier("disk").demotions == 3
    assert await store.get(NS, hashes) == blocks  # served from both tiers, in order
    await store.drain()
    stats = store.stats()
    assert stats.tier("disk").hits == 3 and stats.tier("memory").hits == 3
    assert stats.tier("disk").promotions == 3
    assert (await store.lookup(NS, hashes[:3])).tiers == ("memory",) * 3  # promoted
    assert stats.tier("memory").blocks == 3 and stats.tier("disk").blocks == 3  # exclusive tiers


async def test_tail_of_a_chain_is_evicted_before_its_head(two_tier: TieredStore) -> None:
    store = two_tier
    hashes, blocks = make_blocks(4)
    await store.put(NS, hashes, blocks)  # 4 blocks into 3 slots: one must go
    assert (await store.lookup(NS, hashes)).tiers == ("memory", "memory", "memory", "disk")


async def test_low_priority_goes_first_and_below_floor_is_dropped(tmp_path) -> None:
    config = StoreConfig(demote_min_priority=10)
    memory, disk = memory_tier(2), LMDBTier(tmp_path / "d", 8 * disk_footprint())
    async with TieredStore([memory, disk], config) as store:
        hashes, blocks = make_blocks(4)
        await store.put(NS, hashes[:1], blocks[:1], priority=90)
        await store.put(NS, hashes[1:2], blocks[1:2], priority=0)
        await store.put(NS, hashes[2:3], blocks[2:3], priority=50)
        # the priority-0 block went first, and below the floor it was dropped, not demoted
        assert (await store.lookup(NS, hashes[1:2])).num_blocks == 0
        await store.put(NS, hashes[3:], blocks[3:])
        assert (await store.lookup(NS, hashes[2:3])).tiers == ("disk",)  # 50 < 90: demoted
        assert (await store.lookup(NS, hashes[:1])).tiers == ("memory",)
        assert store.stats().tier("disk").demotions == 1


async def test_retention_expires_to_default_priority() -> None:
    now = [1000.0]
    async with TieredStore([memory_tier(2)], clock=lambda: now[0]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes[:1], blocks[:1], priority=90, retention_s=10)
        await store.put(NS, hashes[1:2], blocks[1:2])
        await store.put(NS, hashes[2:3], blocks[2:3])  # evicts the default-priority block
        assert (await store.lookup(NS, hashes[:1])).num_blocks == 1
        other, more = make_blocks(2, seed=3)
        await store.put(NS, other[:1], more[:1])
        assert (await store.lookup(NS, hashes[:1])).num_blocks == 1  # priority 90 outlives newer blocks
        now[0] += 11  # retention over: block 0 drops to priority 35 like the rest
        await store.put(NS, other, more)
        assert (await store.lookup(NS, hashes[:1])).num_blocks == 0


async def test_leased_blocks_survive_eviction_pressure(tmp_path) -> None:
    disk = LMDBTier(tmp_path / "d", 3 * disk_footprint())  # threaded reads: the get really is in flight
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes, blocks)
        reader = asyncio.create_task(store.get(NS, hashes))
        await asyncio.sleep(0)  # the get has leased its prefix and awaits the disk read
        newcomer, newblock = make_blocks(1, seed=5)
        with pytest.raises(ResourceExhaustedError, match="leased"):
            await store.put(NS, newcomer, newblock)
        assert await reader == blocks
        assert await store.put(NS, newcomer, newblock) == 1  # leases released: eviction works again
        assert (await store.lookup(NS, hashes)).num_blocks == 2  # the tail made room, the head stays


async def test_cancelled_get_releases_its_leases(tmp_path) -> None:
    disk = LMDBTier(tmp_path / "d", 2 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        reader = asyncio.create_task(store.get(NS, hashes))
        for _ in range(100):  # until the get has taken its references (its prepare step), then awaits the disk
            if held_keys(store)[0]:
                break
            await asyncio.sleep(0)
        keys = set(block_keys(NS, hashes))
        assert held_keys(store) == [keys]  # the get held both blocks: no victims while it reads
        assert {store.index.held(0, key).readers for key in keys} == {1}  # type: ignore[union-attr]
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await store.drain()  # the read's disk I/O, once started, ends first: then its references go
        assert held_keys(store) == [set()] and store.index.num_entries() == 0
        newcomer, newblock = make_blocks(2, seed=5)
        assert await store.put(NS, newcomer, newblock) == 2


async def test_concurrent_puts_of_one_key_store_one_value(tmp_path) -> None:
    disk = LMDBTier(tmp_path / "d", 16 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(4)
        results = await asyncio.gather(*(store.put(NS, hashes, blocks) for _ in range(5)))
        assert sum(results) == 4 and all(r in (0, 4) for r in results)
        assert await store.get(NS, hashes) == blocks
        assert store.stats().tier("disk").blocks == 4 and disk.used_bytes == 4 * disk_footprint()


async def test_bad_blocks_store_nothing() -> None:
    async with TieredStore([memory_tier(16)], StoreConfig(max_block_bytes=64 * 1024)) as store:
        hashes, blocks = make_blocks(3)
        corrupt = bytearray(blocks[1])
        corrupt[-1] ^= 1
        with pytest.raises(ChecksumError, match="block 1"):
            await store.put(NS, hashes, [blocks[0], bytes(corrupt), blocks[2]])
        wrong_dtype = encode_block(torch.zeros(2, 2, 2, BLOCK_SIZE, 64, dtype=torch.float32))
        with pytest.raises(InvalidArgumentError, match="does not match"):
            await store.put(NS, hashes[:1], [wrong_dtype])
        wrong_size = encode_block(torch.zeros(2, 2, 2, BLOCK_SIZE + 1, 64, dtype=torch.float16))
        with pytest.raises(InvalidArgumentError, match="block size"):
            await store.put(NS, hashes[:1], [wrong_size])
        huge = encode_block(torch.zeros(64, 2, 2, BLOCK_SIZE, 64, dtype=torch.float16))
        with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
            await store.put(NS, hashes[:1], [huge])
        with pytest.raises(InvalidArgumentError):
            await store.put(NS, [h[:8] for h in hashes], blocks)
        with pytest.raises(InvalidArgumentError):
            await store.put(NS, hashes, blocks, priority=101)
        with pytest.raises(InvalidArgumentError):
            await store.put(NS, hashes, blocks[:2])
        assert (await store.lookup(NS, hashes)).num_blocks == 0
        assert store.stats().tier("memory").blocks == 0


async def test_block_larger_than_the_top_tier_goes_below(tmp_path) -> None:
    memory = MemoryTier(PAGE, page_bytes=PAGE)  # smaller than any block
    disk = LMDBTier(tmp_path / "d", 4 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        assert (await store.lookup(NS, hashes)).tiers == ("disk", "disk")
        assert await store.get(NS, hashes) == blocks
    async with TieredStore([MemoryTier(PAGE, page_bytes=PAGE)]) as store:
        with pytest.raises(ResourceExhaustedError, match="larger than every tier"):
            await store.put(NS, hashes, blocks)


async def test_delete_and_clear_one_namespace(two_tier: TieredStore) -> None:
    store = two_tier
    other_ns = dataclasses.replace(NS, cache_salt="tenant-b")
    hashes, blocks = make_blocks(5)
    other_hashes, other_blocks = make_blocks(2, ns=other_ns)
    await store.put(NS, hashes, blocks)
    await store.put(other_ns, other_hashes, other_blocks)
    assert await store.delete(NS, hashes[:1]) == 1
    assert (await store.lookup(NS, hashes)).num_blocks == 0
    assert (await store.lookup(NS, hashes[1:])).num_blocks == 4
    assert await store.clear(NS) == 4
    assert store.stats().tier("memory").blocks + store.stats().tier("disk").blocks == 2
    assert await store.get(other_ns, other_hashes) == other_blocks


async def test_namespaces_never_share_blocks() -> None:
    async with TieredStore([memory_tier(16)]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        salted = dataclasses.replace(NS, cache_salt="other-tenant")
        assert (await store.lookup(salted, hashes)).num_blocks == 0  # same hash bytes, other namespace


async def test_stored_bytes_never_exceed_capacity(tmp_path) -> None:
    memory = memory_tier(4)
    disk = LMDBTier(tmp_path / "d", 6 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        for seed in range(12):
            hashes, blocks = make_blocks(1 + seed % 3, seed=seed)
            await store.put(NS, hashes, blocks, priority=seed * 7 % 101)
            if seed % 4 == 0:
                await store.get(NS, hashes)
            await store.drain()
            for tier in (memory, disk):
                stats = store.stats().tier(tier.name)
                assert stats.bytes <= stats.capacity_bytes
                assert tier.used_bytes <= tier.capacity_bytes
                assert tier.used_bytes == stats.bytes  # the index and the tier agree


async def test_restart_restores_blocks_priority_and_recency(tmp_path) -> None:
    path = tmp_path / "d"
    hashes, blocks = make_blocks(3)
    async with TieredStore([LMDBTier(path, 3 * disk_footprint())]) as store:
        await store.put(NS, hashes[:1], blocks[:1], priority=80)
        await store.put(NS, hashes[1:2], blocks[1:2])
        await store.put(NS, hashes[2:3], blocks[2:3])
        await store.get(NS, hashes[1:2])  # block 1 is now more recent than block 2
    async with TieredStore([LMDBTier(path, 3 * disk_footprint())]) as store:
        assert await store.get(NS, hashes[:1]) == blocks[:1]
        assert await store.get(NS, hashes[1:2]) == blocks[1:2]
        assert store.stats().tier("disk").blocks == 3
        newcomer, newblock = make_blocks(1, seed=7)
        await store.put(NS, newcomer, newblock)
        # block 2 had the default priority and the oldest access: it is the victim
        assert [(await store.lookup(NS, [h])).num_blocks for h in hashes] == [1, 1, 0]


async def test_corrupt_lmdb_record_is_a_miss_and_cleaned_up(tmp_path) -> None:
    path = tmp_path / "d"
    hashes, blocks = make_blocks(3)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        key = block_key(NS, hashes[1])
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0xFF
        txn.put(key, bytes(value))
    env.close()
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        assert await store.get(NS, hashes) == blocks[:1]  # the prefix ends at the corrupt block
        stats = store.stats().tier("disk")
        assert stats.corrupt_records == 1 and stats.blocks == 2
        assert (await store.lookup(NS, hashes)).num_blocks == 1
        await store.put(NS, hashes[1:2], blocks[1:2])  # healed by a new put
        assert await store.get(NS, hashes) == blocks


async def test_closed_store_is_unavailable() -> None:
    store = TieredStore([memory_tier(2)])
    await store.start()
    await store.close()
    with pytest.raises(UnavailableError):
        await store.lookup(NS, [])


@pytest.mark.slow
def test_embedded_store_round_trip_and_fork(tmp_path) -> None:
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=1 << 20), disk=DiskTierConfig(path=str(tmp_path / "d")))
    tensors = [torch.randn(2, 2, 2, BLOCK_SIZE, 8).half() for _ in range(2)]
    hashes = hash_blocks(NS, range(2 * BLOCK_SIZE))
    with open_store(config) as store:
        assert store.put(NS, hashes, tensors) == 2
        assert store.lookup(NS, hashes).num_blocks == 2
        assert all(torch.equal(a, b) for a, b in zip(store.get_tensors(NS, hashes), tensors))
        pid = os.fork()
        if pid == 0:  # the child must get a clear error, never a hang
            try:
                store.lookup(NS, hashes)
                os._exit(1)
            except UnavailableError:
                os._exit(0)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.stats().tier("memory").blocks == 2
    with open_store(config) as store:  # closing demoted the memory tier to disk
        assert store.stats().tier("disk").blocks == 2
        assert store.get(NS, hashes) == [encode_block(t) for t in tensors]


async def test_namespace_bytes_follow_puts_evictions_and_deletes(two_tier: TieredStore) -> None:
    """Each block counts the most it may take in any local tier, whichever holds it (``kvstore.store.charges``)."""
    store = two_tier
    other_ns = dataclasses.replace(NS, cache_salt="tenant-b")
    hashes, blocks = make_blocks(5)
    await store.put(NS, hashes, blocks)
    other_hashes, other_blocks = make_blocks(1, ns=other_ns)
    await store.put(other_ns, other_hashes, other_blocks)
    stats = store.stats()
    assert stats.tier("disk").blocks  # some went down to disk: they count the same there
    assert store.namespace_bytes(NS.tag) == sum(store.charge_of(len(b)) for b in blocks)
    assert store.namespace_bytes(other_ns.tag) == store.charge_of(len(other_blocks[0])) > 0
    assert store.charge_of(len(blocks[0])) == max(t.footprint(len(blocks[0])) for t in store.tiers)
    assert await store.delete(NS, hashes[:2]) == 2
    assert store.namespace_bytes(NS.tag) == sum(store.charge_of(len(b)) for b in blocks[2:])
    await store.clear(NS)
    assert store.namespace_bytes(NS.tag) == 0


# ---------------------------------------------------------------------- read(): leased, zero-copy reads

from kvstore.api import LookupResult  # noqa: E402


async def test_read_lends_memory_blocks_as_views_and_get_still_copies() -> None:
    async with TieredStore([memory_tier(4)]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes, blocks)
        async with store.read(NS, hashes) as got:
            assert got == blocks and all(type(b) is memoryview for b in got)
        async with store.read(NS, hashes, lend=False) as got:
            assert got == blocks and all(type(b) is bytes for b in got)
        got = await store.get(NS, hashes)
        assert got == blocks and all(type(b) is bytes for b in got)


async def test_read_stops_at_the_first_miss_and_counts_like_get() -> None:
    async with TieredStore([memory_tier(8)]) as store:
        hashes, blocks = make_blocks(4)
        await store.put(NS, hashes[:2] + hashes[3:], blocks[:2] + blocks[3:])
        async with store.read(NS, hashes) as got:
            assert got == blocks[:2]
        async with store.read(NS, []) as got:
            assert got == []
        stats = store.stats().tier("memory")
        assert (stats.hits, stats.misses) == (2, 1)


async def test_a_read_refreshes_recency_with_the_head_most_recent() -> None:
    async with TieredStore([memory_tier(4)]) as store:  # the top tier alone: the read's fast path
        hashes, blocks = make_blocks(4)
        await store.put(NS, hashes[:2], blocks[:2])
        await store.put(NS, hashes[2:], blocks[2:])  # more recent than the first two
        async with store.read(NS, hashes[:2]) as got:
            assert got == blocks[:2]
        newcomers, new_blocks = make_blocks(3, seed=5)
        assert await store.put(NS, newcomers[:2], new_blocks[:2]) == 2  # evicts the two blocks not read
        assert await store.locate(NS, hashes) == bytes(2)
        assert await store.put(NS, newcomers[2:], new_blocks[2:]) == 1  # evicts the read prefix's tail, not its head
        assert await store.locate(NS, hashes) == bytes(1)


async def test_a_read_from_the_heap_tier_lends_its_framed_values_by_reference_and_counts_when_closed() -> None:
    from kvstore.wire import decode_block_chunk

    hashes, blocks = make_blocks(3)
    async with TieredStore([heap_tier(2)]) as store:
        await store.put(NS, hashes[:2], blocks[:2])
        read = store.read(NS, hashes)
        got = read.open_now()  # every cached block is in the top tier: no await
        assert got == blocks[:2] and read.framed is not None
        assert [decode_block_chunk(r)[1] for r in read.framed] == blocks[:2]  # type: ignore[arg-type]
        assert held_keys(store) == [set()]  # references need no holds...
        assert await store.put(NS, hashes[2:], blocks[2:]) == 1  # ...so the read does not stop eviction
        assert got == blocks[:2]  # and what it holds stays whole
        assert store.stats().tier("memory").hits == 0  # counted when the read closes
        read.close()
        read.close()  # once
        stats = store.stats().tier("memory")
        assert (stats.hits, stats.misses) == (2, 1)


@pytest.mark.parametrize("kind", ["heap", "pages"])
async def test_a_block_being_read_is_no_early_victim(kind: str) -> None:
    """The read refreshes its blocks when it opens: pinned (pages) or not (heap), they are not the LRU end."""
    hashes, blocks = make_blocks(4)
    async with TieredStore([heap_tier(3) if kind == "heap" else memory_tier(3)]) as store:
        for i in range(3):  # A, B, C: A the least recent
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        async with store.read(NS, hashes[:1]) as got:  # a Get of A is streaming
            assert got == blocks[:1]
            await store.put(NS, hashes[3:], blocks[3:])  # D needs room: B goes, not A
        assert await store.locate(NS, hashes[:1]) == b"\0"
        assert await store.locate(NS, hashes[1:2]) == b""


async def test_closing_an_old_read_does_not_refresh_a_block_put_again_meanwhile() -> None:
    hashes, blocks = make_blocks(4)
    a, b, c, d = ([h] for h in hashes)
    block_a, block_b, block_c, block_d = ([x] for x in blocks)
    async with TieredStore([heap_tier(3)]) as store:
        await store.put(NS, a, block_a)
        await store.put(NS, b, block_b)
        read = store.read(NS, a)
        assert read.open_now() == block_a
        await store.delete(NS, a)
        await store.put(NS, a, block_a)  # a new block under A: LRU order B, A
        await store.put(NS, c, block_c)  # B, A, C
        await store.put(NS, b, block_b)  # a put again is an access: A, C, B
        read.close()  # of the old A: it counts a hit, and refreshes nothing
        await store.put(NS, d, block_d)  # evicts the least recent: the new A
        assert await store.locate(NS, a) == b""


async def test_a_read_of_a_prefix_partly_in_a_lower_tier_cannot_open_now(two_tier) -> None:
    store = two_tier
    hashes, blocks = make_blocks(5)
    await store.put(NS, hashes, blocks)  # memory holds 3: the rest went down to disk
    read = store.read(NS, hashes)
    assert read.open_now() is None and held_keys(store) == [set(), set()]  # nothing taken
    async with read as got:
        assert got == blocks


async def test_blocks_being_read_cannot_be_evicted_until_the_read_ends() -> None:
    memory = memory_tier(3)
    async with TieredStore([memory]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes, blocks)
        newcomers, new_blocks = make_blocks(3, seed=5)
        async with store.read(NS, hashes[:2]) as got:
            assert await store.put(NS, newcomers[:1], new_blocks[:1]) == 1  # evicts the one block not being read
            assert (await store.lookup(NS, hashes)).num_blocks == 2
            with pytest.raises(ResourceExhaustedError, match="leased"):  # two slots wanted, one is not being read
                await store.put(NS, newcomers[1:], new_blocks[1:])
            assert (await store.lookup(NS, hashes)).num_blocks == 2
            assert got == blocks[:2]
        assert await store.put(NS, newcomers[1:], new_blocks[1:]) == 2  # released: eviction may take them again
        assert (await store.lookup(NS, hashes)).num_blocks < 2
        assert memory.num_free_pages == 0


async def test_blocks_deleted_during_a_read_stay_intact_until_it_ends() -> None:
    memory = memory_tier(3)
    async with TieredStore([memory]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes, blocks)
        newcomers, new_blocks = make_blocks(3, seed=5)
        async with store.read(NS, hashes) as got:
            assert await store.delete(NS, hashes) == 3
            assert (await store.lookup(NS, hashes)).num_blocks == 0
            with pytest.raises(ResourceExhaustedError):  # the pages are still lent out
                await store.put(NS, newcomers, new_blocks)
            assert got == blocks
        assert memory.num_free_pages == memory.num_pages
        assert await store.put(NS, newcomers, new_blocks) == 3
        assert await store.get(NS, newcomers) == new_blocks


async def test_leaving_a_read_by_an_error_releases_its_leases() -> None:
    memory = memory_tier(2)
    async with TieredStore([memory]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        with pytest.raises(RuntimeError, match="boom"):
            async with store.read(NS, hashes) as got:
                assert got == blocks
                raise RuntimeError("boom")
        newcomers, new_blocks = make_blocks(2, seed=5)
        assert await store.put(NS, newcomers, new_blocks) == 2  # both read blocks could be evicted
        assert await store.clear(NS) == 2
        assert memory.num_free_pages == memory.num_pages  # and the tier holds no page back for a lease


async def test_a_cancelled_read_releases_its_leases() -> None:
    memory = memory_tier(2)
    async with TieredStore([memory]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        inside, never = asyncio.Event(), asyncio.Event()

        async def reader() -> None:
            async with store.read(NS, hashes) as got:
                assert got == blocks
                inside.set()
                await never.wait()

        task = asyncio.create_task(reader())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        newcomers, new_blocks = make_blocks(2, seed=5)
        assert await store.put(NS, newcomers, new_blocks) == 2
        assert await store.clear(NS) == 2
        assert memory.num_free_pages == memory.num_pages


async def test_concurrent_reads_of_one_prefix_each_hold_it() -> None:
    async with TieredStore([memory_tier(2)]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        newcomer, new_block = make_blocks(1, seed=5)
        async with store.read(NS, hashes) as first:
            async with store.read(NS, hashes) as second:
                assert first == second == blocks
            with pytest.raises(ResourceExhaustedError):  # the first read still holds both blocks
                await store.put(NS, newcomer, new_block)
        assert await store.put(NS, newcomer, new_block) == 1


async def test_promoting_more_blocks_than_the_top_tier_holds_loses_none(tmp_path) -> None:
    """Six disk hits promoted into a memory tier of four: the last two written evict two promoted ones back.

    Those went back to disk, where their own copies still were, and the promotion then deleted every promoted
    block from disk: two of ten blocks were in no tier (more with concurrent gets).
    """
    memory = memory_tier(4)
    async with TieredStore([memory, LMDBTier(tmp_path / "disk", 20 * disk_footprint())]) as store:
        hashes, blocks = make_blocks(10, seed=3)
        await store.put(NS, hashes, blocks)  # memory holds the head, disk the other six
        assert await store.get(NS, hashes) == blocks
        await store.drain()
        assert [t.blocks for t in store.stats().tiers] == [4, 6]
        assert store.stats().tier("disk").promotions == 4  # the two sent back down did not move
        for _ in range(3):  # concurrent gets pin the top tier, so some promotions find no room and stop
            await asyncio.gather(*(store.get(NS, hashes) for _ in range(5)))
            await store.drain()
            assert await store.get(NS, hashes) == blocks
            stats = store.stats()
            assert sum(t.blocks for t in stats.tiers) == 10  # each block in exactly one tier
            assert memory.num_pages - memory.num_free_pages == 2 * stats.tier("memory").blocks  # no ghost entries


class _SlowLMDB(LMDBTier):
    """A real LMDB tier whose next get waits for :attr:`gate`: a slow disk read, to order a race."""

    gate: asyncio.Event | None = None

    async def get(self, keys):  # type: ignore[no-untyped-def]
        gate, self.gate = self.gate, None
        if gate is not None:
            await gate.wait()
        return await super().get(keys)


async def test_a_read_does_not_forget_a_block_deleted_and_put_again_while_it_waited(tmp_path) -> None:
    """A read over disk and memory found the memory block gone (deleted), and once its slow disk half ended it
    forgot the block's entry, which by then was a new put's: the block was unreadable and its pages lost for good."""
    memory = memory_tier(1)
    disk = _SlowLMDB(tmp_path / "disk", 50 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(3, seed=2)
        await store.put(NS, hashes[:1], blocks[:1])
        await store.put(NS, hashes[1:2], blocks[1:2])  # the first on disk, the second in memory
        assert await store.locate(NS, hashes[:2]) == b"\x01\x00"
        gate = disk.gate = asyncio.Event()
        reader = asyncio.create_task(store.get(NS, hashes[:2]))  # both tiers at once; the disk half waits
        await asyncio.sleep(0)
        assert await store.delete(NS, hashes[1:2]) == 1
        assert await store.put(NS, hashes[1:2], blocks[1:2]) == 1
        gate.set()
        assert (await reader)[:1] == blocks[:1]
        await store.drain()
        assert await store.get(NS, hashes[1:2]) == blocks[1:2]
        assert memory.num_free_pages == memory.num_pages - 2 * store.stats().tier("memory").blocks


async def test_close_waits_for_a_put_in_flight_so_a_restart_serves_its_block(tmp_path) -> None:
    """A put still making room (demoting to disk) published its block after close had demoted memory: the put
    succeeded and the block was gone after a restart."""
    hashes, blocks = make_blocks(2, seed=6)
    store = TieredStore([memory_tier(1), LMDBTier(tmp_path / "disk", 50 * disk_footprint())])
    await store.start()
    await store.put(NS, hashes[:1], blocks[:1])
    put = asyncio.create_task(store.put(NS, hashes[1:], blocks[1:]))  # must demote the first block first
    for _ in range(3):
        await asyncio.sleep(0)  # the put is now writing the first block to disk
    await store.close()
    assert await put == 1
    async with TieredStore([memory_tier(1), LMDBTier(tmp_path / "disk", 50 * disk_footprint())]) as store:
        assert await store.get(NS, hashes) == blocks


async def test_close_demotes_low_priority_blocks_too_so_a_restart_serves_them(tmp_path) -> None:
    """Regression: close demoted memory through the eviction path, which drops blocks below
    ``demote_min_priority``; a restart lost them though the disk had room."""
    config = StoreConfig(demote_min_priority=50)
    hashes, blocks = make_blocks(3, seed=7)
    async with TieredStore([memory_tier(4), LMDBTier(tmp_path / "disk", 8 * disk_footprint())], config) as store:
        await store.put(NS, hashes, blocks, priority=10)
        assert (await store.lookup(NS, hashes)).tiers == ("memory",) * 3
    async with TieredStore([memory_tier(4), LMDBTier(tmp_path / "disk", 8 * disk_footprint())], config) as store:
        assert await store.get(NS, hashes) == blocks


async def test_close_demotes_low_priority_blocks_only_into_free_room(tmp_path) -> None:
    """Flushing blocks below ``demote_min_priority`` on close must not push higher-priority disk blocks out."""
    config = StoreConfig(demote_min_priority=50)
    hashes, blocks = make_blocks(4, seed=9)
    store = TieredStore([memory_tier(2), LMDBTier(tmp_path / "d", 2 * disk_footprint())], config)
    await store.start()
    await store.put(NS, hashes[:1], blocks[:1], priority=90)
    await store.put(NS, hashes[1:2], blocks[1:2], priority=90)
    await store.put(NS, hashes[2:3], blocks[2:3], priority=10)  # evicts the 90s to disk
    await store.put(NS, hashes[3:4], blocks[3:4], priority=10)
    assert (await store.lookup(NS, hashes[:1])).tiers == ("disk",)
    await store.close()  # flushes the two priority-10 blocks into a full disk
    store = TieredStore([memory_tier(2), LMDBTier(tmp_path / "d", 2 * disk_footprint())], config)
    await store.start()
    present = [(await store.lookup(NS, [h])).num_blocks for h in hashes]
    await store.close()
    assert present[:2] == [1, 1], f"priority-90 blocks lost to priority-10 ones on close: {present}"


async def test_close_sizes_low_priority_blocks_by_their_bytes_on_disk(tmp_path) -> None:
    """Regression: the flush sized them by their memory pages, and dropped one that fit an empty disk exactly."""
    """_flush_set feeds the memory footprint (policy.size_of, page-rounded) into the disk tier's footprint(),
    which wants a raw length: one LMDB page too many per block, so a low-priority block that fits is dropped."""
    config = StoreConfig(demote_min_priority=50)
    hashes, blocks = make_blocks(1, seed=22)
    store = TieredStore([memory_tier(2), LMDBTier(tmp_path / "d", 1 * disk_footprint())], config)
    await store.start()
    await store.put(NS, hashes, blocks, priority=10)
    await store.close()
    store = TieredStore([memory_tier(2), LMDBTier(tmp_path / "d", 1 * disk_footprint())], config)
    await store.start()
    present = (await store.lookup(NS, hashes)).num_blocks
    await store.close()
    assert present == 1, "the disk had room for the block but close dropped it"


async def test_close_reads_priorities_after_retentions_end(tmp_path) -> None:
    """Regression: a block whose retention had ended still counted as priority 90, and pushed out a 60."""
    """_flush_set reads policy.priority_of without expiring retentions first: a block whose retention ended
    (priority back to 10) is flushed as a 90 and evicts a priority-60 disk block."""
    config = StoreConfig(demote_min_priority=50, default_priority=10)
    hashes, blocks = make_blocks(4, seed=25)
    clock = FakeClock()

    def tiers():
        return [memory_tier(2), LMDBTier(tmp_path / "d", 2 * disk_footprint(), clock=clock)]

    store = TieredStore(tiers(), config, clock=clock)
    await store.start()
    await store.put(NS, hashes[0:1], blocks[0:1], priority=60)
    await store.put(NS, hashes[1:2], blocks[1:2], priority=60)
    await store.put(NS, hashes[2:3], blocks[2:3], priority=90, retention_s=0.05)  # B
    await store.put(NS, hashes[3:4], blocks[3:4], priority=90)  # C; the 60s are on disk now, disk full
    assert len(store.index.policies[1]) == 2
    clock.advance(0.1)  # B is priority 10 now
    await store.close()
    store = TieredStore(tiers(), config, clock=clock)
    await store.start()
    present = [(await store.lookup(NS, [h])).num_blocks for h in hashes]
    await store.close()
    assert present[0] + present[1] == 1 and present[2] == 0, present


async def test_close_flushes_each_volatile_tier_straight_to_disk(tmp_path) -> None:
    """Regression: memory flushed into a second memory tier first, whose room-making dropped its low-priority
    blocks though the disk had room."""
    """[memory, memory2, disk]: flushing level 0 into memory2 makes room there with the default floor, which
    drops memory2's low-priority block, though the disk has room for everything."""
    config = StoreConfig(demote_min_priority=50, default_priority=10)
    hashes, blocks = make_blocks(2, seed=24)
    clock = FakeClock()

    def tiers():
        return [memory_tier(1), memory_tier(1), LMDBTier(tmp_path / "d", 8 * disk_footprint(), clock=clock)]

    store = TieredStore(tiers(), config, clock=clock)
    await store.start()
    await store.put(NS, hashes[1:], blocks[1:], priority=90, retention_s=0.05)  # B: reverts to 10 soon
    await store.put(NS, hashes[:1], blocks[:1], priority=90)  # A: pushes B into memory2
    assert len(store.index.policies[1]) == 1 and len(store.index.policies[2]) == 0
    clock.advance(0.1)  # B is now priority 10, below the floor; the disk has room for 8 blocks
    await store.close()
    store = TieredStore(tiers(), config, clock=clock)
    await store.start()
    present = [(await store.lookup(NS, [h])).num_blocks for h in hashes]
    await store.close()
    assert present == [1, 1], present


async def test_locate_gives_the_tier_index_of_each_prefix_block(two_tier: TieredStore) -> None:
    store = two_tier
    assert store.tier_names == ("memory", "disk")
    hashes, blocks = make_blocks(6)
    await store.put(NS, hashes[:3], blocks[:3])
    await store.put(NS, hashes[3:], blocks[3:])  # the first three were demoted to disk
    located = await store.locate(NS, hashes)
    assert located == bytes([1, 1, 1, 0, 0, 0])
    assert await store.lookup(NS, hashes) == LookupResult.from_block_tiers(located, store.tier_names)
    assert await store.locate(NS, hashes[3:]) == bytes(3)
    assert await store.locate(NS, []) == b""
    other, _ = make_blocks(2, seed=9)
    assert await store.locate(NS, hashes[:2] + other + hashes[2:]) == bytes([1, 1])  # the miss ends the prefix
    assert await store.locate(NS, other + hashes) == b""


async def test_locate_gives_the_shared_tier_the_last_index() -> None:
    memory, shared = memory_tier(2), SharedMemoryTier(1 << 20, page_bytes=PAGE, name="shared")
    async with TieredStore([memory], shared=shared) as store:  # write-through: every put also reaches it
        assert store.tier_names == ("memory", "shared")
        hashes, blocks = make_blocks(4)
        await store.put(NS, hashes, blocks)  # memory keeps the head; the tail lives on in the shared tier
        await store.drain()
        assert await store.locate(NS, hashes) == bytes([0, 0, 1, 1])
        assert (await store.lookup(NS, hashes)).tiers == ("memory", "memory", "shared", "shared")
        async with store.read(NS, hashes) as got:
            assert got == blocks and [type(b) for b in got] == [memoryview] * 2 + [bytes] * 2


async def test_a_disk_hit_read_through_read_is_promoted_to_memory(two_tier: TieredStore) -> None:
    store = two_tier
    hashes, blocks = make_blocks(6)
    await store.put(NS, hashes[:3], blocks[:3])
    await store.put(NS, hashes[3:], blocks[3:])
    async with store.read(NS, hashes) as got:
        assert got == blocks
        assert [type(b) for b in got] == [bytes] * 3 + [memoryview] * 3  # disk copies, memory views
    await store.drain()
    assert await store.locate(NS, hashes) == bytes([0, 0, 0, 1, 1, 1])
    assert store.stats().tier("disk").promotions == 3
    assert await store.get(NS, hashes) == blocks


async def test_a_promotion_started_by_a_read_is_not_lost_when_the_body_awaits(two_tier: TieredStore) -> None:
    store = two_tier
    hashes, blocks = make_blocks(6)
    await store.put(NS, hashes[:3], blocks[:3])
    await store.put(NS, hashes[3:], blocks[3:])
    async with store.read(NS, hashes) as got:
        await store.drain()  # as the service's Get does while it writes its messages
        assert got == blocks
    await store.drain()
    assert await store.locate(NS, hashes[:3]) == bytes(3)


async def test_a_restart_keeps_a_chains_tail_before_its_head(tmp_path) -> None:
    """Regression: every block of one put had the same last access, so a restart (which sorts by it) put a
    chain's blocks back in key order, and one eviction could take a head and with it the whole prefix."""
    first, second = make_blocks(4, seed=21), make_blocks(4, seed=22)
    extra = make_blocks(1, seed=23)
    clock = FakeClock()
    for restart in (False, True):
        path = tmp_path / f"disk-{restart}"
        store = TieredStore([LMDBTier(path, 8 * disk_footprint(), clock=clock)], clock=clock)
        await store.start()
        await store.put(NS, *first)
        clock.advance(0.01)
        await store.put(NS, *second)
        assert await store.get(NS, first[0][:2]) and await store.get(NS, second[0][:3])  # reads, head first
        if restart:
            await store.close()
            store = TieredStore([LMDBTier(path, 8 * disk_footprint(), clock=clock)], clock=clock)
            await store.start()
        await store.put(NS, *extra)  # room for one more: one victim, the first chain's tail
        assert (await store.lookup(NS, first[0])).num_blocks == 3, f"restart={restart}"  # observed with: 0
        assert (await store.lookup(NS, second[0])).num_blocks == 4
        await store.close()


async def test_a_read_follows_a_block_promoted_away_while_it_waited_on_disk(tmp_path) -> None:
    """Regression: a read pinned a block on disk, and another read's promotion moved it into memory before the
    first one's disk read ran: that read came back short though the block was cached all along."""
    hashes, blocks = make_blocks(3, seed=11)
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory_tier(2), disk]) as store:
        for i in range(3):
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        assert (await store.lookup(NS, hashes[:1])).tiers == ("disk",)
        real_get, gate, entered = disk.get, asyncio.Event(), asyncio.Event()

        async def gated_get(keys):  # the first disk read waits for the gate
            disk.get = real_get
            entered.set()
            await gate.wait()
            return await real_get(keys)

        disk.get = gated_get
        first = asyncio.create_task(store.get(NS, hashes[:1]))
        await entered.wait()  # located and pinned on disk, its read not yet done
        assert await store.get(NS, hashes[:1]) == blocks[:1]  # a second read, whose promotion moves the block
        await store.drain()
        assert (await store.lookup(NS, hashes[:1])).tiers == ("memory",)
        gate.set()
        assert await first == blocks[:1]  # observed: [] (the disk no longer held it)
