"""Deletes and clears racing puts, reads and copies still in flight, some of them cancelled part-way.

A delete or clear wins over a put that was still placing its blocks when it
began, and loses to a put made after it began; a block a disk tier drops as
corrupt is forgotten, and only that block; a cancelled delete or clear still
finishes in every tier, the shared one included.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.test_store import BLOCK_SIZE, NS, PAGE, disk_footprint, make_blocks, memory_tier
from tests.test_store_copy_races import slow_first_put
from tests.test_store_index_stress import corrupt_records, tier_and_index_disagree, writer_held
from tests.test_store_redis import redis_config, store_key


class _GatedReadLMDB(LMDBTier):
    """A real LMDB tier whose next read transaction, once it has read, waits in its reader thread for ``gate``."""

    gate: threading.Event | None = None

    def _get_txn(self, keys, *args):  # type: ignore[no-untyped-def]
        result = super()._get_txn(keys, *args)
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.wait(5)
        return result


async def test_a_good_block_that_replaced_a_corrupt_one_is_not_forgotten_with_it(tmp_path: Path) -> None:
    """A get reads a corrupt record; before its drop is submitted the block is deleted and put again (a good
    record, published at the disk level). The drop skips the good record, so the store must not forget it.
    Regression: the disk tier reported every key the get had found corrupt, and the store forgot the new entry:
    a record no entry accounted for (room never evicted), and a lookup missed a block that was on disk."""
    path = tmp_path / "d"
    hashes, blocks = make_blocks(1)
    async with TieredStore([LMDBTier(path, 8 * disk_footprint())]) as store:
        await store.put(NS, hashes, blocks)
    corrupt_records(path, hashes)
    disk = _GatedReadLMDB(path, 8 * disk_footprint())
    store = TieredStore([disk])
    await store.start()
    gate = disk.gate = threading.Event()
    read = asyncio.ensure_future(store.get(NS, hashes))
    await asyncio.sleep(0.05)  # the read found the corrupt record and waits in its thread
    assert await store.delete(NS, hashes) == 1
    assert await store.put(NS, hashes, blocks) == 1  # a good record, published on disk
    gate.set()
    assert await read == []
    await store.drain()
    problems = await tier_and_index_disagree(store)
    located = (await store.lookup(NS, hashes)).num_blocks
    await store.close()
    assert not problems
    assert located == 1


async def test_a_put_made_while_a_delete_waits_for_the_disk_is_published(tmp_path: Path) -> None:
    """The disk-only twin of test_a_put_made_while_a_delete_waits_for_the_disk_is_not_deleted_with_it: the put
    starts after the delete forgot the key, so it is the newer and wins, though its disk write queues behind the
    delete's. Regression: the put counted as overtaken by the delete's end record and was not published."""
    disk = LMDBTier(tmp_path / "disk", 4 * disk_footprint())
    store = TieredStore([disk])
    await store.start()
    hashes, blocks = make_blocks(1)
    await store.put(NS, hashes, blocks)
    async with writer_held(disk):
        delete = asyncio.ensure_future(store.delete(NS, hashes))
        await asyncio.sleep(0.01)  # forgotten, its write queued
        put = asyncio.ensure_future(store.put(NS, hashes, blocks))
        await asyncio.sleep(0.01)  # placed afresh, its write queued after the delete's
    assert await delete == 1
    assert await put == 1
    await store.drain()
    got = await store.get(NS, hashes)
    await store.close()
    assert got == blocks


async def test_a_put_that_evicts_to_disk_while_a_delete_waits_is_published(tmp_path: Path) -> None:
    """Memory over disk, memory full: a put made after a delete forgot its key must first demote a victim to
    disk, which queues behind the delete's disk write. Regression: the put's block was dropped as deleted."""
    disk = LMDBTier(tmp_path / "disk", 8 * disk_footprint())
    store = TieredStore([memory_tier(1), disk])
    await store.start()
    hashes, blocks = make_blocks(3)
    await store.put(NS, hashes[:1], blocks[:1])
    await store.put(NS, hashes[1:2], blocks[1:2])  # block 0 on disk, block 1 fills memory
    assert await store.locate(NS, hashes[:2]) == bytes([1, 0])
    async with writer_held(disk):
        delete = asyncio.ensure_future(store.delete(NS, hashes[:1]))  # the disk block
        await asyncio.sleep(0.01)
        put = asyncio.ensure_future(store.put(NS, hashes[:1], blocks[:1]))  # must demote block 1 first
        await asyncio.sleep(0.01)
    assert await delete == 1
    assert await put == 1
    await store.drain()
    got = await store.get(NS, hashes[:1])
    await store.close()
    assert got == blocks[:1]




async def test_a_delete_wins_over_a_write_back_put_spilling_into_redis(redis_server: RedisProcess) -> None:
    """write_back, a block that fits no local tier goes straight into Redis. A delete that overtakes the put
    (still placing its block) must win there too. Regression: that write was neither registered for deletes to
    wait for nor checked against the put's window, and its SET landed after the delete's UNLINK."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(PAGE, page_bytes=PAGE)  # one page: an encoded block (two pages) fits no local tier
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=31)
        slow_first_put(store, 0.2)
        put = asyncio.create_task(store.put(NS, hashes, blocks))
        await asyncio.sleep(0.05)  # placing: the spill into Redis is on its way
        await store.delete(NS, hashes)  # overtakes the put: it still places its block
        await put
        await store.drain()
        in_redis = bool(redis_server.client().exists(store_key(store, hashes[0])))
        assert not in_redis, "the put still placing its block won over the delete in Redis"


async def test_a_clear_cancelled_while_it_deletes_locally_still_clears_redis(redis_server: RedisProcess) -> None:
    """A clear cancelled while it deletes its local keys (whose shared delete waits for write-throughs in flight)
    must still clear the namespace from Redis, here a block another node put. Regression: the Redis part was
    spawned only after the local deletes, so the cancellation skipped it and the next get served the block."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_a, \
            TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_b:
        hashes, blocks = make_blocks(2, seed=33)
        await node_b.put(NS, hashes[:1], blocks[:1])  # A: in Redis, not in node_a's memory
        await node_b.drain()
        slow_first_put(node_a, 0.3)
        await node_a.put(NS, hashes[1:], blocks[1:])  # B: its write-through is slow
        await asyncio.sleep(0.01)
        clear = asyncio.create_task(node_a.clear(NS))
        await asyncio.sleep(0.05)  # the clear's delete of B waits for B's write-through
        clear.cancel()
        try:
            await clear
        except asyncio.CancelledError:
            pass
        await node_a.drain()
        in_redis = bool(redis_server.client().exists(store_key(node_a, hashes[0])))
        assert not in_redis, "a cancelled clear left the namespace in Redis"


def slow_shared(store: TieredStore, method: str, delay: float) -> None:
    """Delay each call of the shared tier's ``method`` (``delete``: the UNLINK, ``clear_namespace``: the SCAN)
    by ``delay`` s before it is sent: a slow Redis."""
    real = getattr(store._shared, method)

    async def slow(arg):  # type: ignore[no-untyped-def]
        await asyncio.sleep(delay)
        return await real(arg)

    setattr(store._shared, method, slow)


async def test_a_read_during_a_cancelled_clear_does_not_promote_a_cleared_block(
        redis_server: RedisProcess) -> None:
    """A read made while a (cancelled) clear's Redis part still runs finds a block there, and must not promote
    it into memory. Regression: the clear's end was recorded at the cancellation, copies opened after it saw no
    clear, and the cleared namespace's block stayed in memory after Redis dropped it."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_a, \
            TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as node_b:
        hashes, blocks = make_blocks(1, seed=34)
        await node_b.put(NS, hashes, blocks)  # in Redis, not in node_a's memory
        await node_b.drain()
        slow_shared(node_a, "clear_namespace", 0.3)
        clear = asyncio.create_task(node_a.clear(NS))
        await asyncio.sleep(0.05)  # in its shielded Redis part
        clear.cancel()
        try:
            await clear
        except asyncio.CancelledError:
            pass
        assert await node_a.get(NS, hashes) == blocks  # from Redis, still there; promoted
        await node_a.drain()
        in_redis = bool(redis_server.client().exists(store_key(node_a, hashes[0])))
        local = (await node_a.lookup(NS, hashes)).tiers
        assert (local, in_redis) == ((), False), (local, in_redis)


async def test_a_write_back_spill_made_after_a_delete_began_survives_its_unlink(redis_server: RedisProcess) -> None:
    """write_back, a block that fits no local tier goes to Redis. P1 spills K (its SET slow); D(K) begins and
    waits for P1's write; P2 puts K after D began, so it is the newer and must win. Regression: D's UNLINK
    landed after P2's SET and the newer block was lost everywhere; newer writes now wait for D's UNLINK."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(PAGE, page_bytes=PAGE)  # fits no block
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=71)
        slow_first_put(store, 0.3)
        p1 = asyncio.create_task(store.put(NS, hashes, blocks))
        await asyncio.sleep(0.05)  # P1's spill registered, its SET delayed
        d = asyncio.create_task(store.delete(NS, hashes))
        await asyncio.sleep(0.02)  # D began; its Redis part waits for P1's write
        assert await store.put(NS, hashes, blocks) == 1  # P2: after D began, SET lands now
        await p1
        await d
        await store.drain()
        got = await store.get(NS, hashes)
        assert got == blocks, "a put made after the delete began was undone by the delete's UNLINK"


async def test_a_write_through_put_made_after_a_delete_began_keeps_its_redis_copy(
        redis_server: RedisProcess) -> None:
    """The write_through twin: P2 (made after D began) is in memory and must be in Redis too. Regression: D's
    late UNLINK removed P2's Redis copy, so memory and Redis disagreed for good."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=72)
        slow_first_put(store, 0.3)
        await store.put(NS, hashes, blocks)  # P1: its write-through SET delayed
        await asyncio.sleep(0.01)
        d = asyncio.create_task(store.delete(NS, hashes))
        await asyncio.sleep(0.02)  # D forgot K; its Redis part waits for P1's write
        assert await store.put(NS, hashes, blocks) == 1  # P2: after D began
        await d
        await store.drain()
        local = (await store.lookup(NS, hashes)).tiers
        in_redis = bool(redis_server.client().exists(store_key(store, hashes[0])))
        assert (local, in_redis) == (("memory",), True), (local, in_redis)


async def test_a_put_made_after_a_clear_began_survives_it(redis_server: RedisProcess) -> None:
    """The clear twin (a write_back spill): P2, made after the clear began, must survive the clear. Regression:
    the clear's late SCAN and UNLINK removed it."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(PAGE, page_bytes=PAGE)
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=73)
        slow_first_put(store, 0.3)
        p1 = asyncio.create_task(store.put(NS, hashes, blocks))
        await asyncio.sleep(0.05)
        c = asyncio.create_task(store.clear(NS))
        await asyncio.sleep(0.02)
        assert await store.put(NS, hashes, blocks) == 1  # P2: after the clear began
        await p1
        await c
        await store.drain()
        assert await store.get(NS, hashes) == blocks, "a put made after the clear began was cleared"


async def test_a_newer_put_demoted_during_a_delete_in_progress_reaches_redis(
        redis_server: RedisProcess) -> None:
    """K, put after D(K) began, is evicted while D's Redis part is still in flight, and must be demoted into Redis.
    Regression: the demotion counted K as deleted (a delete of it was in progress) and dropped it: K ended up in
    no tier."""
    config = redis_config(redis_server.url, "write_back")
    memory = MemoryTier(2 * PAGE, page_bytes=PAGE)  # one block
    async with TieredStore([memory], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(2, seed=75)
        await store.put(NS, hashes[:1], blocks[:1])
        slow_shared(store, "delete", 0.3)
        d = asyncio.create_task(store.delete(NS, hashes[:1]))
        await asyncio.sleep(0.02)  # D forgot K, its UNLINK not sent yet
        assert await store.put(NS, hashes[:1], blocks[:1]) == 1  # P2: after D began
        assert await store.put(NS, hashes[1:], blocks[1:]) == 1  # evicts K: demotion into Redis
        await d
        await store.drain()
        in_redis = bool(redis_server.client().exists(store_key(store, hashes[0])))
        local = (await store.lookup(NS, hashes[:1])).num_blocks
        assert (local, in_redis) != (0, False), "K, put after the delete began, is in no tier"


async def test_a_clear_with_redis_down_logs_no_error(redis_server: RedisProcess, caplog) -> None:  # type: ignore[no-untyped-def]
    """Redis down (breaker open): the clear's Redis part fails, which the caller is told; a cache's Redis being
    down is expected, so nothing is logged at ERROR. Regression: "background store task failed" at ERROR."""
    config = redis_config(redis_server.url, "write_through")
    async with TieredStore([memory_tier(8)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=76)
        await store.put(NS, hashes, blocks)
        await store.drain()
        redis_server.kill()
        try:
            for _ in range(3):  # open the breaker
                await store.get(NS, make_blocks(1, seed=77)[0])
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                try:
                    await store.clear(NS)
                except Exception as exc:  # noqa: BLE001
                    raised = type(exc).__name__
                else:
                    raised = None
                await store.drain()
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(store._tombstones) == 0
            assert not errors, (raised, errors)
        finally:
            redis_server.start()


NS2 = Namespace(model="other-model", dtype="float16", block_size=BLOCK_SIZE)


async def test_a_put_that_demotes_a_block_a_slow_clear_spares_does_not_wait_for_the_clear(
        redis_server: RedisProcess) -> None:
    """write_back, memory for one block. Block A, put after a slow clear began, is newer and survives it; a put
    into another namespace evicts A. Its demotion into Redis must wait for the clear's UNLINK, but not inside the
    put. Regression: the put waited for the whole clear, holding the memory tier's lock."""
    config = redis_config(redis_server.url, "write_back")
    async with TieredStore([MemoryTier(2 * PAGE, page_bytes=PAGE)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=81)
        slow_shared(store, "clear_namespace", 2.0)
        clear = asyncio.create_task(store.clear(NS))
        await asyncio.sleep(0.02)
        assert await store.put(NS, hashes, blocks) == 1  # A, newer than the clear
        other_hashes, other_blocks = make_blocks(1, seed=82, ns=NS2)
        assert await store.put(NS2, other_hashes, other_blocks) == 1  # evicts A into Redis
        assert not clear.done()  # the put did not wait for it
        await clear
        await store.drain()
        assert await store.get(NS, hashes) == blocks  # A reached Redis, after the clear's UNLINK


async def test_puts_that_need_the_tier_lock_do_not_wait_for_a_slow_delete(redis_server: RedisProcess) -> None:
    """The same with a delete of one key (slow UNLINK): K, put again after the delete began, is evicted by P2;
    P3 needs the memory tier's lock too. Regression: P2 waited for the delete holding the lock, and P3 with it."""
    config = redis_config(redis_server.url, "write_back")
    async with TieredStore([MemoryTier(2 * PAGE, page_bytes=PAGE)], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(1, seed=83)
        await store.put(NS, hashes, blocks)
        slow_shared(store, "delete", 2.0)
        delete = asyncio.create_task(store.delete(NS, hashes))
        await asyncio.sleep(0.02)
        assert await store.put(NS, hashes, blocks) == 1  # K again, newer than the delete
        h2, b2 = make_blocks(1, seed=84, ns=NS2)
        h3, b3 = make_blocks(1, seed=85, ns=NS2)
        p2 = asyncio.create_task(store.put(NS2, h2, b2))
        await asyncio.sleep(0.01)
        await store.put(NS2, h3, b3)
        await p2
        assert not delete.done()  # neither put waited for it
        await delete
        await store.drain()
        assert await store.get(NS, hashes) == blocks  # the newer K reached Redis, after the delete's UNLINK


async def test_a_victim_no_delete_covers_is_demoted_at_once_beside_one_that_waits(
        redis_server: RedisProcess) -> None:
    """Memory for two blocks: J (never deleted) and K (put again after a slow delete of K began) are evicted in
    one batch. K's write into Redis waits for the delete's UNLINK, in the background; J's does not wait, so J
    stays readable throughout. Regression: the whole batch waited in the background, and J missed meanwhile.
    (K itself misses until the UNLINK lands: the price of not holding the tier's lock for it.)"""
    config = redis_config(redis_server.url, "write_back")
    async with TieredStore([MemoryTier(4 * PAGE, page_bytes=PAGE)], config, shared=RedisTier(config.redis)) as store:
        (k,), (k_block,) = make_blocks(1, seed=21)
        (j,), (j_block,) = make_blocks(1, seed=22)
        await store.put(NS, [k], [k_block])
        slow_shared(store, "delete", 1.0)
        delete = asyncio.create_task(store.delete(NS, [k]))
        await asyncio.sleep(0.02)
        await store.put(NS, [j], [j_block])
        await store.put(NS, [k], [k_block])  # newer than the delete
        h2, b2 = make_blocks(2, seed=23, ns=NS2)
        assert await store.put(NS2, h2, b2) == 2  # evicts J and K in one batch
        assert not delete.done()
        assert await store.get(NS, [j]) == [j_block]  # from Redis, at once
        await delete
        await store.drain()
        assert await store.get(NS, [k]) == [k_block]  # the newer K, after the delete's UNLINK
