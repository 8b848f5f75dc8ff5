"""Operations cancelled part-way over real memory, LMDB and Redis tiers: nothing is half-indexed, every tier matches
the index, and a cancelled delete still deletes everywhere.

Each interleaving is ordered by events (a held LMDB writer thread, a write seen in its queue), never by time.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest

from kvstore.config import RedisTierConfig, StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import (
    NS,
    PAGE,
    cancel_when,
    corrupt_records,
    disk_footprint,
    heap_tier,
    make_blocks,
    memory_tier,
    random_op,
    tier_and_index_disagree,
    until,
    writer_held,
    writes_queued,
)


async def test_a_delete_cancelled_while_its_disk_write_waits_still_deletes(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        async with writer_held(disk):
            await cancel_when(store.delete(NS, hashes), lambda: writes_queued(disk) == 1)
        assert (await store.lookup(NS, hashes)).num_blocks == 0
        assert not await tier_and_index_disagree(store)  # the record went too: it was in the queue when cancelled


async def test_a_put_made_while_a_delete_waits_for_the_disk_is_not_deleted_with_it(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    async with TieredStore([memory_tier(1), disk]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes[:1], blocks[:1])
        await store.put(NS, hashes[1:], blocks[1:])  # block 0 is demoted to disk, block 1 is in memory
        assert await store.locate(NS, hashes) == bytes([1, 0])
        async with writer_held(disk):
            delete = asyncio.ensure_future(store.delete(NS, hashes))
            await until(lambda: writes_queued(disk) == 1)  # forgotten everywhere, memory's record gone, disk's queued
            assert await store.put(NS, hashes[1:], blocks[1:]) == 1  # a newer put, into memory
        assert await delete == 2
        assert await store.get(NS, hashes[1:]) == blocks[1:]
        assert not await tier_and_index_disagree(store)


async def test_a_put_made_while_a_delete_waits_for_the_disk_is_published(tmp_path: Path) -> None:
    """Disk only: the newer put's write queues behind the delete's, and wins."""
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    async with TieredStore([disk]) as store:
        hashes, blocks = make_blocks(1)
        await store.put(NS, hashes, blocks)
        async with writer_held(disk):
            delete = asyncio.ensure_future(store.delete(NS, hashes))
            await until(lambda: writes_queued(disk) == 1)
            put = asyncio.ensure_future(store.put(NS, hashes, blocks))
            await until(lambda: writes_queued(disk) == 2)
        assert await delete == 1 and await put == 1
        assert await store.get(NS, hashes) == blocks
        assert not await tier_and_index_disagree(store)


async def test_a_read_cancelled_while_it_reads_a_corrupt_record_leaves_tier_and_index_agreeing(
        tmp_path: Path) -> None:
    """The read's I/O, once begun, ends, and its complete step forgets the corrupt block, caller or not."""
    path = tmp_path / "d"
    hashes, blocks = make_blocks(2)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    corrupt_records(path, hashes[1:])
    disk = LMDBTier(path, 8 * disk_footprint())
    async with TieredStore([disk]) as store:
        async with writer_held(disk):  # the tier's drop of the corrupt record queues behind the held writer
            await cancel_when(store.get(NS, hashes), lambda: writes_queued(disk) == 1)
        assert not await tier_and_index_disagree(store)
        assert (await store.lookup(NS, hashes)).num_blocks == 1
        assert store.stats().tier("disk").counters["lost_records"] == 1


async def test_every_corrupt_record_one_read_finds_is_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "d"
    hashes, blocks = make_blocks(3)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    corrupt_records(path, hashes[1:])
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        assert await store.get(NS, hashes) == blocks[:1]
        assert not await tier_and_index_disagree(store)
        assert (await store.lookup(NS, hashes)).num_blocks == 1
        assert await store.put(NS, hashes, blocks) == 2  # forgotten: a put stores them again
        assert await store.get(NS, hashes) == blocks


async def test_a_delete_cancelled_while_its_disk_write_waits_still_deletes_from_redis(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    config = StoreConfig(redis=RedisTierConfig(url=redis_server.url, mode="write_through"))
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    async with TieredStore([disk], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes, blocks)
        await store.drain()
        async with writer_held(disk):
            await cancel_when(store.delete(NS, hashes), lambda: writes_queued(disk) == 1)
        await store.drain()
        assert (await store.lookup(NS, hashes)).num_blocks == 0


async def test_a_delete_cancelled_in_the_first_of_two_disk_tiers_still_deletes_from_the_second(
        tmp_path: Path) -> None:
    first = LMDBTier(tmp_path / "a", disk_footprint())
    second = LMDBTier(tmp_path / "b", 4 * disk_footprint())
    async with TieredStore([first, second]) as store:
        hashes, blocks = make_blocks(2)
        await store.put(NS, hashes[:1], blocks[:1])
        await store.put(NS, hashes[1:], blocks[1:])  # block 0 demoted to the second tier
        assert await store.locate(NS, hashes) == bytes([1, 0])
        async with writer_held(first):
            await cancel_when(store.delete(NS, hashes), lambda: writes_queued(first) == 1)
        assert not await tier_and_index_disagree(store)


async def test_a_put_cancelled_while_it_writes_is_indexed_whole(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    async with TieredStore([memory_tier(2), disk]) as store:
        hashes, blocks = make_blocks(4)
        async with writer_held(disk):  # the put's tail batch goes to memory, then its head evicts it to disk
            await cancel_when(store.put(NS, hashes, blocks), lambda: writes_queued(disk) == 1)
        await store.drain()
        assert await store.get(NS, hashes) == blocks  # the whole batch, though its caller went away
        assert not await tier_and_index_disagree(store)
        assert await store.put(NS, hashes, blocks) == 0


async def test_close_while_a_cancelled_delete_is_queued_keeps_the_delete(tmp_path: Path) -> None:
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([memory, disk])
    await store.start()
    hashes, blocks = make_blocks(3)
    await store.put(NS, hashes, blocks)  # one on disk, two in memory
    async with writer_held(disk):
        await cancel_when(store.delete(NS, hashes), lambda: writes_queued(disk) == 1)
        closing = asyncio.ensure_future(store.close())
        await until(lambda: not closing.done() and writes_queued(disk) == 1)
    await closing
    async with TieredStore([LMDBTier(tmp_path / "disk", 4 * disk_footprint())]) as reopened:
        assert (await reopened.lookup(NS, hashes)).num_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("top", ["pages", "heap"])
@pytest.mark.parametrize("seed", [*range(8), 37])
async def test_random_cancelled_ops_leave_every_tier_matching_its_index(
        tmp_path: Path, seed: int, top: str, caplog: pytest.LogCaptureFixture) -> None:
    """Random concurrent puts, reads, deletes and clears, a fifth of them cancelled at a random loop turn."""
    caplog.set_level(logging.ERROR)
    rng = random.Random(seed)
    hashes, blocks = make_blocks(12, seed=seed)
    memory: Tier
    if top == "pages":
        memory = MemoryTier(3 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE if seed % 2 else 1 << 30)
    else:  # kvstore serve's memory tier: framed values, leases by reference
        memory = heap_tier(3)
    async with TieredStore([memory, LMDBTier(tmp_path / "disk", 6 * disk_footprint())]) as store:
        for round_ in range(15):
            tasks = [asyncio.ensure_future(random_op(store, rng, hashes, blocks, (None, 10, 90))) for _ in range(20)]
            for _ in range(rng.randrange(6)):
                await asyncio.sleep(0)
            for task in tasks:
                if rng.random() < 0.2:
                    task.cancel()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                # the only refusal: room held by readers (or by deleted blocks still being read)
                assert not isinstance(outcome, Exception) or isinstance(outcome, ResourceExhaustedError), outcome
            assert not await tier_and_index_disagree(store), round_
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]
