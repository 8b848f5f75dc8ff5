"""Tests of the LMDB tier: the shared contract, then restarts, corruption, capacity and a full map."""

from __future__ import annotations

import os
import struct
import time

import lmdb
import pytest

from kvstore.config import DiskTierConfig
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.tiers.base import BlockMeta, TierFullError
from kvstore.tiers.lmdb import LMDBTier, default_map_size_bytes
from tests.support.tier_contract import TierContract, make_block, make_key, make_sized_block, meta

MiB = 1024 * 1024


class TestLMDBTierContract(TierContract):
    @pytest.fixture
    async def tier(self, tmp_path):
        tier = LMDBTier(tmp_path / "env", 4 * MiB)
        yield tier
        await tier.close()


def _edit_records(path, edit):
    """Open the environment through the lmdb module (the tier closed) and run ``edit(txn, blocks, meta)``."""
    env = lmdb.open(str(path), max_dbs=2)
    try:
        blocks, meta_db = env.open_db(b"blocks"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            edit(txn, blocks, meta_db)
    finally:
        env.close()


async def _stored_tier(path, num_blocks=3, capacity_bytes=4 * MiB):
    tier = LMDBTier(path, capacity_bytes)
    keys = [make_key(i) for i in range(num_blocks)]
    values = [make_block(i, shape=(2, 2, 4, 16, 32)) for i in range(num_blocks)]
    await tier.put(keys, values, [meta(40 + i) for i in range(num_blocks)])
    return tier, keys, values


async def test_reopen_serves_every_block_with_its_priority_and_recency(tmp_path):
    path = tmp_path / "env"
    tier = LMDBTier(path, 4 * MiB)
    keys = [make_key(i) for i in range(3)]
    values = [make_block(i) for i in range(3)]
    metas = [BlockMeta(10, 0.0, 1000.0), BlockMeta(90, 5000.0, 2000.0), BlockMeta(35, 0.0, 3000.0)]
    await tier.put(keys, values, metas)
    before_get = time.time()
    assert await tier.get([keys[0]]) == [values[0]]
    used = tier.used_bytes
    await tier.close()

    tier = LMDBTier(path, 4 * MiB)
    assert tier.used_bytes == used
    assert await tier.get(keys) == values
    entries = {e.key: e for e in await tier.resident()}
    assert set(entries) == set(keys)
    assert [entries[k].nbytes for k in keys] == [len(v) for v in values]
    assert [entries[k].meta.priority for k in keys] == [10, 90, 35]
    assert entries[keys[1]].meta.expires_at == 5000.0
    assert entries[keys[0]].meta.last_access >= before_get  # the get before close was saved
    await tier.close()


async def test_recency_of_gets_goes_into_the_next_write_not_a_write_per_get(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    await tier.put([make_key(0)], [make_block(0)], [BlockMeta(35, 0.0, 1000.0)])
    txnid = tier._env.info()["last_txnid"]
    for _ in range(5):
        await tier.get([make_key(0)])
    await tier.contains([make_key(0)])
    assert tier._env.info()["last_txnid"] == txnid  # gets opened no write transaction

    def stored_last_access():
        with tier._env.begin(db=tier._meta) as txn:
            return struct.unpack("<BddQ", txn.get(make_key(0)))[2]

    assert stored_last_access() == 1000.0
    [entry] = await tier.resident()
    assert entry.meta.last_access > 1000.0  # resident() already reports it
    await tier.put([make_key(1)], [make_block(1)], [meta()])
    assert tier._env.info()["last_txnid"] == txnid + 1
    assert stored_last_access() > 1000.0
    await tier.close()


async def test_recency_is_kept_when_a_write_fails(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    await tier.put([make_key(0)], [make_block(0)], [BlockMeta(35, 0.0, 1000.0)])
    await tier.get([make_key(0)])
    with pytest.raises(TierFullError):
        await tier.put([make_key(1)], [make_sized_block(1, 8 * MiB)], [meta()])
    await tier.close()
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    [entry] = await tier.resident()
    assert entry.meta.last_access > 1000.0
    await tier.close()


@pytest.mark.parametrize("damage", ["payload_bit", "bad_magic", "truncated", "trailing_bytes"])
async def test_a_damaged_record_is_a_miss_deleted_and_counted(tmp_path, damage):
    path = tmp_path / "env"
    tier, keys, values = await _stored_tier(path)
    await tier.close()

    def corrupt(txn, blocks, _meta):
        raw = bytearray(txn.get(keys[1], db=blocks))
        if damage == "payload_bit":
            raw[-100] ^= 0x01
        elif damage == "bad_magic":
            raw[0] ^= 0xFF
        elif damage == "truncated":
            raw = raw[: len(raw) // 2]
        else:
            raw += b"\x00" * 64
        txn.put(keys[1], bytes(raw), db=blocks)

    _edit_records(path, corrupt)
    tier = LMDBTier(path, 4 * MiB)
    used = tier.used_bytes
    assert await tier.get(keys) == [values[0], None, values[2]]
    assert tier.counters()["corrupt_records"] == 1
    assert await tier.contains(keys) == [True, False, True]
    assert tier.used_bytes == used - tier.footprint(len(values[1]))
    assert {e.key for e in await tier.resident()} == {keys[0], keys[2]}
    assert await tier.get([keys[1]]) == [None]
    assert tier.counters()["corrupt_records"] == 1  # counted once: it is gone
    await tier.close()

    tier = LMDBTier(path, 4 * MiB)  # the deletion was committed
    assert await tier.contains(keys) == [True, False, True]
    await tier.close()


async def test_resident_skips_deletes_and_counts_junk_records(tmp_path):
    path = tmp_path / "env"
    tier, keys, values = await _stored_tier(path, num_blocks=4)
    await tier.close()
    good = make_block(50)

    def add_junk(txn, blocks, meta_db):
        txn.put(keys[0], b"\x01\x02\x03", db=meta_db)  # meta that does not decode
        txn.delete(keys[1], db=meta_db)  # block without meta
        txn.delete(keys[2], db=blocks)  # meta without block
        txn.put(make_key(60), good, db=blocks)  # orphan block
        txn.put(make_key(61), struct.pack("<BddQ", 35, 0.0, 0.0, len(good) + 1), db=meta_db)
        txn.put(make_key(61), good, db=blocks)  # length differs from meta

    _edit_records(path, add_junk)
    tier = LMDBTier(path, 4 * MiB)
    entries = await tier.resident()
    assert [e.key for e in entries] == [keys[3]]
    assert tier.counters()["corrupt_records"] == 5
    assert tier.used_bytes == tier.footprint(len(values[3]))
    assert await tier.resident() == entries
    assert tier.counters()["corrupt_records"] == 5
    assert await tier.get([keys[3]]) == [values[3]]
    await tier.close()


async def test_a_full_map_raises_tier_full_stores_nothing_and_the_tier_stays_usable(tmp_path):
    path = tmp_path / "env"
    tier = LMDBTier(path, 1024 * MiB, map_size_bytes=2 * MiB)
    small = [make_key(i) for i in range(3)]
    await tier.put(small[:1], [make_block(0)], [meta()])
    with pytest.raises(TierFullError):
        await tier.put([small[1], make_key(10)], [make_block(1), make_sized_block(10, 4 * MiB)], [meta()] * 2)
    assert await tier.contains([small[1], make_key(10)]) == [False, False]
    assert tier.used_bytes == tier.footprint(len(make_block(0)))
    assert await tier.put(small[1:], [make_block(1), make_block(2)], [meta()] * 2) == [True, True]
    assert await tier.get(small) == [make_block(i) for i in range(3)]
    await tier.close()
    tier = LMDBTier(path, 1024 * MiB, map_size_bytes=2 * MiB)
    assert await tier.get(small) == [make_block(i) for i in range(3)]
    await tier.close()


async def test_stored_bytes_stay_under_capacity_across_puts_deletes_and_reopen(tmp_path):
    path = tmp_path / "env"
    capacity = 2 * MiB
    tier = LMDBTier(path, capacity)
    sizes = [100_000, 300_000, 50_000, 700_000, 200_000]
    held: dict[bytes, bytes] = {}
    refused = 0
    for i in range(40):
        key = make_key(i % 12)
        value = make_sized_block(i, sizes[i % len(sizes)])
        try:
            await tier.put([key], [value], [meta()])
            held[key] = value
        except TierFullError:
            refused += 1
            await tier.delete(list(held)[:2])
            for k in list(held)[:2]:
                del held[k]
        entries = await tier.resident()
        assert tier.used_bytes == sum(tier.footprint(e.nbytes) for e in entries) <= capacity
        assert {e.key for e in entries} == set(held)
    assert refused > 0
    await tier.close()
    tier = LMDBTier(path, capacity)
    assert tier.used_bytes == sum(tier.footprint(len(v)) for v in held.values())
    assert await tier.get(list(held)) == list(held.values())
    await tier.close()


async def test_sync_mode_round_trips_across_reopen(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB, sync=True)
    await tier.put([make_key(0)], [make_block(0)], [meta()])
    await tier.close()
    tier = LMDBTier(tmp_path / "env", 4 * MiB, sync=True)
    assert await tier.get([make_key(0)]) == [make_block(0)]
    await tier.close()


def test_from_config_and_map_size(tmp_path):
    tier = LMDBTier.from_config(DiskTierConfig(path=str(tmp_path / "env"), capacity_bytes=8 * MiB))
    assert (tier.name, tier.capacity_bytes, tier.persistent, tier.sync) == ("disk", 8 * MiB, True, False)
    assert tier._env.info()["map_size"] == default_map_size_bytes(8 * MiB) >= 8 * MiB + 64 * MiB
    assert os.path.isdir(tmp_path / "env")
    with pytest.raises(InvalidArgumentError):
        LMDBTier.from_config(DiskTierConfig(path=""))


def test_footprint_models_overflow_pages(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    assert tier.page_bytes == 4096
    assert tier.footprint(4096 - 16) == 4096 + 256
    assert tier.footprint(4096 - 15) == 2 * 4096 + 256
    assert tier.footprint(2 * MiB + 128) == (2 * MiB // 4096 + 1) * 4096 + 256


async def test_use_after_close_raises_unavailable(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    await tier.close()
    for call in (lambda: tier.get([make_key(0)]), lambda: tier.contains([make_key(0)]),
                 lambda: tier.delete([make_key(0)]), lambda: tier.put([make_key(0)], [make_block(0)], [meta()]),
                 tier.resident):
        with pytest.raises(UnavailableError):  # a delete raises at the call, the others when awaited
            await call()


async def test_priority_outside_0_to_100_is_refused(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    with pytest.raises(InvalidArgumentError):
        await tier.put([make_key(0)], [make_block(0)], [BlockMeta(101)])
    assert await tier.contains([make_key(0)]) == [False]
    await tier.close()


async def test_a_second_tier_on_the_same_directory_is_refused(tmp_path) -> None:
    """Two processes (or tiers) on one LMDB directory would each count its capacity on their own."""
    first = LMDBTier(tmp_path / "d", 1 << 20)
    with pytest.raises(UnavailableError, match="in use"):
        LMDBTier(tmp_path / "d", 1 << 20)
    await first.close()
    second = LMDBTier(tmp_path / "d", 1 << 20)  # the lock went with the first tier
    await second.close()
