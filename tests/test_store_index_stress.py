"""Random concurrent puts, reads, deletes and clears (some cancelled) over memory and a real LMDB tier.

Checks the store's one invariant between its index and its tiers: after
``drain()``, every tier holds exactly the blocks its eviction policy tracks.
A tier record with no entry takes room that nothing ever evicts; an entry
with no record is a lookup hit that every get misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
from pathlib import Path
from typing import AsyncIterator, Awaitable, Sequence

import lmdb
import pytest

from kvstore.config import RedisTierConfig, StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.keys import block_key
from kvstore.server.wire import reply_head
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES, HeapTier
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.test_store import NS, PAGE, disk_footprint, make_blocks, memory_tier


async def tier_and_index_disagree(store: TieredStore) -> list[str]:
    """Each tier whose records differ from its policy's keys, as a line naming both counts.

    Waits first for the writes LMDB tiers have queued: a write whose caller was
    cancelled still runs, in order, and may still be queued after ``drain()``.
    """
    for tier in store._tiers:
        if isinstance(tier, LMDBTier):
            await asyncio.wrap_future(tier._writer.submit(lambda: None))
    problems = []
    for tier, policy in zip(store._tiers, store._policies):
        tracked = set(policy)
        held = {entry.key for entry in await tier.resident()}
        if tracked != held:
            problems.append(f"{tier.name}: {len(held - tracked)} records without an entry, "
                            f"{len(tracked - held)} entries without a record")
    return problems


async def cancel_while_waiting(call: Awaitable[object], wait_s: float) -> None:
    """Start ``call``, let it run ``wait_s`` seconds (until it waits on something held), then cancel it and
    check that it ends cancelled."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(wait_s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def random_op(store: TieredStore, rng: random.Random, hashes: list[bytes], blocks: list[bytes],
                    priorities: Sequence[int | None] = (None,)) -> None:
    """One random operation of the stress tests on a random run of the blocks: a put (of a run with a repeated
    block, at a random priority of ``priorities``), a read that holds its leases a moment, a delete (of a run with
    every key twice), or a clear of the namespace."""
    k = rng.randrange(len(hashes))
    n = rng.randrange(1, len(hashes) + 1 - k)
    h, b = hashes[k:k + n], blocks[k:k + n]
    r = rng.random()
    if r < 0.35:
        await store.put(NS, h + h[:1], b + b[:1], priority=rng.choice(priorities))
    elif r < 0.7:
        async with store.read(NS, h):
            await asyncio.sleep(rng.random() * 0.002)
    elif r < 0.85:
        await store.delete(NS, h + h)
    else:
        await store.clear(NS)


@contextlib.asynccontextmanager
async def writer_held(disk: LMDBTier) -> AsyncIterator[None]:
    """Keep the LMDB tier's one writer thread busy for the body, so that every write submitted meanwhile waits
    in its queue; on leaving, let it go and wait until those writes have run."""
    gate = threading.Event()
    disk._writer.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()
        await asyncio.wrap_future(disk._writer.submit(lambda: None))


async def test_a_delete_cancelled_while_its_disk_write_waits_still_deletes(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([disk])
    await store.start()
    hashes, blocks = make_blocks(2)
    await store.put(NS, hashes, blocks)
    async with writer_held(disk):
        await cancel_while_waiting(store.delete(NS, hashes), 0.01)  # forgotten, and its write queued
    assert (await store.lookup(NS, hashes)).num_blocks == 0
    assert not await tier_and_index_disagree(store)  # the record went too: it was in the queue when cancelled
    await store.close()


async def test_a_put_made_while_a_delete_waits_for_the_disk_is_not_deleted_with_it(tmp_path: Path) -> None:
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([memory_tier(1), disk])
    await store.start()
    hashes, blocks = make_blocks(2)
    await store.put(NS, hashes[:1], blocks[:1])
    await store.put(NS, hashes[1:], blocks[1:])  # block 0 is demoted to disk, block 1 is in memory
    assert await store.locate(NS, hashes) == bytes([1, 0])
    async with writer_held(disk):
        delete = asyncio.ensure_future(store.delete(NS, hashes))  # the disk's block first
        await asyncio.sleep(0.01)
        await store.put(NS, hashes[1:], blocks[1:])  # into memory, while the delete waits for the disk
    await delete
    assert [bytes(b) for b in await store.get(NS, hashes[1:])] == blocks[1:]
    assert not await tier_and_index_disagree(store)
    await store.close()


def corrupt_records(path: Path, hashes: list[bytes]) -> None:
    """Flip one byte in the middle of each block's LMDB record (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        for h in hashes:
            key = block_key(NS, h)
            value = bytearray(txn.get(key))
            value[len(value) // 2] ^= 0xFF
            txn.put(key, bytes(value))
    env.close()


async def test_a_read_cancelled_while_its_corrupt_record_is_dropped_forgets_the_block(
        tmp_path: Path) -> None:
    # regression: LMDB writes run to their end since a cancelled delete may not drop its write; this made the corrupt-record drop run to its end although the read was cancelled, but the read's
    # _forget_if_gone never runs: the policy kept an entry whose record is gone (a lookup hit every get misses)
    path = tmp_path / "d"
    hashes, blocks = make_blocks(2)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    corrupt_records(path, hashes[1:])
    disk = LMDBTier(path, 8 * disk_footprint())
    store = TieredStore([disk])
    await store.start()
    async with writer_held(disk):
        await cancel_while_waiting(store.get(NS, hashes), 0.05)  # the get found the corrupt block, its drop is queued behind the held writer
    assert not await tier_and_index_disagree(store)
    await store.close()


async def test_every_corrupt_record_one_read_finds_is_forgotten(tmp_path: Path) -> None:
    # regression: LMDBTier.get drops every corrupt record it read, but the read forgot only the first miss
    path = tmp_path / "d"
    hashes, blocks = make_blocks(3)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    corrupt_records(path, hashes[1:])
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        assert await store.get(NS, hashes) == blocks[:1]
        assert not await tier_and_index_disagree(store)


async def test_a_delete_cancelled_while_its_disk_write_waits_still_deletes_from_redis(
        tmp_path: Path, redis_server: RedisProcess) -> None:
    # regression: the shared delete was spawned only after the local tiers' deletes were awaited: a cancelled delete
    # left the block in Redis, where the next lookup and get find it
    config = StoreConfig(redis=RedisTierConfig(url=redis_server.url, mode="write_through"))
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([disk], config, shared=RedisTier(config.redis))
    await store.start()
    hashes, blocks = make_blocks(2)
    await store.put(NS, hashes, blocks)
    await store.drain()
    async with writer_held(disk):
        await cancel_while_waiting(store.delete(NS, hashes), 0.05)
    await store.drain()
    assert (await store.lookup(NS, hashes)).num_blocks == 0
    await store.close()


async def test_a_delete_cancelled_in_the_first_of_two_disk_tiers_still_deletes_from_the_second(
        tmp_path: Path) -> None:
    # regression: with two LMDB tiers the first tier's delete suspends: a cancellation there never started the second's
    first = LMDBTier(tmp_path / "a", disk_footprint())
    second = LMDBTier(tmp_path / "b", 4 * disk_footprint())
    store = TieredStore([first, second])
    await store.start()
    hashes, blocks = make_blocks(2)
    await store.put(NS, hashes[:1], blocks[:1])
    await store.put(NS, hashes[1:], blocks[1:])  # block 0 demoted to the second tier
    assert await store.locate(NS, hashes) == bytes([1, 0])
    async with writer_held(first):
        await cancel_while_waiting(store.delete(NS, hashes), 0.05)
    assert not await tier_and_index_disagree(store)
    await store.close()


async def test_close_while_a_cancelled_delete_is_queued_keeps_the_delete(tmp_path: Path) -> None:
    memory = memory_tier(2)
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([memory, disk])
    await store.start()
    hashes, blocks = make_blocks(3)
    await store.put(NS, hashes, blocks)  # one on disk, two in memory
    async with writer_held(disk):
        delete = asyncio.ensure_future(store.delete(NS, hashes))
        await asyncio.sleep(0.05)
        delete.cancel()
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.05)
    await asyncio.wait_for(closing, 5)
    reopened = TieredStore([LMDBTier(tmp_path / "disk", 4 * disk_footprint())])
    await reopened.start()
    assert (await reopened.lookup(NS, hashes)).num_blocks == 0
    await reopened.close()


# seed 37 left two LMDB records without an entry: a delete cancelled while its LMDB write was queued dropped it
@pytest.mark.parametrize("top", ["pages", "heap"])
@pytest.mark.parametrize("seed", [*range(8), 37])
async def test_random_cancelled_ops_leave_every_tier_matching_its_index(
        tmp_path: Path, seed: int, top: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(seed)
    hashes, blocks = make_blocks(12, seed=seed)
    if top == "pages":
        memory: Tier = MemoryTier(3 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE if seed % 2 else 1 << 30)
    else:  # kvstore serve's memory tier: ready replies, leases by reference
        memory = HeapTier(3 * (len(blocks[0]) + BLOCK_OVERHEAD_BYTES),
                          reply_head=functools.partial(reply_head, chunk_bytes=1 << 20))
    store = TieredStore([memory, LMDBTier(tmp_path / "disk", 6 * disk_footprint())])
    await store.start()

    for round_ in range(15):
        tasks = [asyncio.ensure_future(random_op(store, rng, hashes, blocks, (None, 10, 90))) for _ in range(20)]
        await asyncio.sleep(rng.random() * 0.003)
        for task in tasks:
            if rng.random() < 0.2:
                task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            # the only refusal: room held by leases (of readers, or of deleted blocks still being read)
            assert not isinstance(outcome, Exception) or isinstance(outcome, ResourceExhaustedError), outcome
        await store.drain()
        assert not await tier_and_index_disagree(store), (round_, await tier_and_index_disagree(store))
    await store.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]
