"""The store's event log: every put, demotion, promotion, eviction, delete, clear and restart yields its event,
checked against what each tier holds (real memory and LMDB tiers, no ZMQ)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.events.log import EventLog
from kvstore.events.schema import (
    CLEARED_NAMESPACE,
    CLEARED_OVERFLOW,
    CLEARED_START,
    REMOVED_CLEARED,
    REMOVED_DELETED,
    REMOVED_EVICTED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from kvstore.events.subscriber import TierView
from kvstore.keys import NAMESPACE_TAG_BYTES
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier

HASHES, BLOCKS = make_blocks(12, seed=3)


def open_store(path: Path, log: EventLog, *, memory_blocks: int = 3, disk_blocks: int = 5,
               config: StoreConfig | None = None) -> TieredStore:
    return TieredStore([memory_tier(memory_blocks), LMDBTier(path / "disk", disk_blocks * disk_footprint())],
                       config, events=log)


def contents(store: TieredStore) -> dict[tuple[bytes, bytes], str]:
    """What the index has resident, as a :class:`TierView`'s blocks."""
    return {(key[:NAMESPACE_TAG_BYTES], key[NAMESPACE_TAG_BYTES:]): store.tier_names[level]
            for level, policy in enumerate(store.index.policies) for key in policy}


class Follower:
    """Takes the log's events, as the publisher does, and keeps them and the view they build."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.view = TierView()
        self.events: list[object] = []

    def take(self) -> list[object]:
        taken = self.log.take(1 << 20)
        self.view.apply(KVEventBatch(ts=0.0, events=taken))  # type: ignore[arg-type]
        self.events += taken
        return taken


def hashes_of(events: list[object], kind: type, **fields: object) -> set[bytes]:
    return {h for e in events if isinstance(e, kind) and all(getattr(e, k) == v for k, v in fields.items())
            for h in e.block_hashes}  # type: ignore[attr-defined]


async def test_every_change_yields_its_event(tmp_path: Path) -> None:
    log = EventLog()
    follow = Follower(log)
    async with open_store(tmp_path, log) as store:
        first = follow.take()
        assert first == [AllBlocksCleared(reason=CLEARED_START)]  # a (re)start is announced as a clear

        await store.put(NS, HASHES[:2], BLOCKS[:2])
        await store.drain()
        taken = follow.take()
        assert hashes_of(taken, BlockStored, medium="memory", from_medium=None) == set(HASHES[:2])
        assert all(e.namespace == NS.tag for e in taken)  # type: ignore[attr-defined]
        assert follow.view.blocks == contents(store)

        await store.put(NS, HASHES[2:6], BLOCKS[2:6])  # memory holds 3: the oldest go down to disk
        await store.drain()
        taken = follow.take()
        moved = hashes_of(taken, BlockStored, medium="disk", from_medium="memory")
        assert moved == hashes_of(taken, BlockRemoved, medium="memory", reason="moved")
        assert len(moved) == 3
        assert {h for (_, h), m in contents(store).items() if m == "disk"} == moved
        assert follow.view.blocks == contents(store)

        on_disk = sorted(moved, key=HASHES.index)[0]
        assert len(await store.get(NS, [on_disk])) == 1  # a disk hit is promoted into memory
        await store.drain()
        taken = follow.take()
        assert on_disk in hashes_of(taken, BlockStored, medium="memory", from_medium="disk")
        assert on_disk in hashes_of(taken, BlockRemoved, medium="disk", reason="moved")
        assert follow.view.blocks == contents(store)

        await store.put(NS, HASHES[6:12], BLOCKS[6:12])  # 12 blocks into 3 + 5: the disk tier drops some
        await store.drain()
        taken = follow.take()
        evicted = hashes_of(taken, BlockRemoved, medium="disk", reason=REMOVED_EVICTED)
        assert evicted and not {h for _, h in contents(store)} & evicted - hashes_of(taken, BlockStored)
        assert follow.view.blocks == contents(store)

        resident = [h for h in HASHES if (NS.tag, h) in contents(store)]
        gone = resident[:2]
        levels = {h: contents(store)[(NS.tag, h)] for h in gone}
        assert await store.delete(NS, gone) == 2
        taken = follow.take()
        for h in gone:
            assert h in hashes_of(taken, BlockRemoved, medium=levels[h], reason=REMOVED_DELETED)
        assert follow.view.blocks == contents(store)

        before = contents(store)
        assert await store.clear(NS) == len(before)
        await store.drain()
        taken = follow.take()
        assert taken[0] == AllBlocksCleared(namespace=NS.tag, reason=CLEARED_NAMESPACE)
        assert hashes_of(taken, BlockRemoved, reason=REMOVED_CLEARED) == {h for _, h in before}
        assert follow.view.blocks == contents(store) == {}


async def test_restart_announces_a_clear_then_the_restored_blocks(tmp_path: Path) -> None:
    log = EventLog()
    async with open_store(tmp_path, log) as store:
        await store.put(NS, HASHES[:4], BLOCKS[:4])
    # closing moved memory down to disk: those moves were logged before the store closed
    follow = Follower(log)
    follow.take()
    assert len(follow.view.blocks) == 4 and set(follow.view.blocks.values()) == {"disk"}

    again = EventLog()
    follow = Follower(again)
    async with open_store(tmp_path, again) as store:
        taken = follow.take()
        assert taken[0] == AllBlocksCleared(reason=CLEARED_START)
        assert hashes_of(taken, BlockStored, medium="disk") == set(HASHES[:4])
        assert follow.view.blocks == contents(store)


async def test_demotion_below_the_floor_is_an_eviction(tmp_path: Path) -> None:
    log = EventLog()
    follow = Follower(log)
    async with open_store(tmp_path, log, config=StoreConfig(demote_min_priority=50)) as store:
        await store.put(NS, HASHES[:3], BLOCKS[:3], priority=10)
        await store.put(NS, HASHES[3:5], BLOCKS[3:5], priority=90)
        await store.drain()
        taken = follow.take()
        evicted = hashes_of(taken, BlockRemoved, medium="memory", reason=REMOVED_EVICTED)
        assert len(evicted) == 2 and evicted <= set(HASHES[:3])
        assert not hashes_of(taken, BlockStored, medium="disk")
        assert follow.view.blocks == contents(store)


async def test_a_full_log_drops_counts_and_announces_a_clear(tmp_path: Path) -> None:
    log = EventLog(max_events=3)  # the start's clear and two more
    follow = Follower(log)
    async with open_store(tmp_path, log) as store:
        await store.put(NS, HASHES[:3], BLOCKS[:3])  # puts go on while the log is full
        await store.drain()
        assert len(await store.get(NS, HASHES[:3])) == 3
        assert log.num_dropped == 1 and log.num_overflows == 1
        taken = follow.take()
        assert taken[-1] == AllBlocksCleared(reason=CLEARED_OVERFLOW)
        assert follow.view.blocks == {}  # under-reports after a drop, never reports what is gone
        await store.delete(NS, HASHES[:1])  # after the clear the log takes events again
        assert hashes_of(follow.take(), BlockRemoved, reason=REMOVED_DELETED) == {HASHES[0]}
        assert log.num_dropped == 1


async def test_concurrent_puts_and_deletes_leave_the_view_equal_to_the_tiers(tmp_path: Path) -> None:
    log = EventLog()
    follow = Follower(log)
    async with open_store(tmp_path, log) as store:
        for round_ in range(4):
            calls = [store.put(NS, HASHES[i:i + 3], BLOCKS[i:i + 3]) for i in range(0, 9, 3)]
            calls.append(store.delete(NS, HASHES[round_:round_ + 2]))
            calls.append(store.get(NS, HASHES[:6]))
            await asyncio.gather(*calls, return_exceptions=True)
            await store.drain()
            follow.take()
            assert follow.view.blocks == contents(store)
