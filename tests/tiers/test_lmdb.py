"""Tests of the LMDB tier: the shared contract, then restarts, corruption, capacity and a full map."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time

import lmdb
import pytest

from kvstore.config import DiskTierConfig
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.policy import DEFAULT_PRIORITY
from kvstore.tiers.base import BlockMeta, TierFullError
from kvstore.tiers.lmdb import DISK_FILL_FRACTION, LMDBTier, default_map_size_bytes, usable_bytes
from tests.support.lmdb_pages import page_map
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


async def test_resident_repairs_lost_meta_records_and_deletes_and_counts_junk(tmp_path):
    """A block whose meta record is lost or damaged is kept at the default priority (its checksum is still checked
    on its first get); what cannot be a block is deleted. Regression (issue 18): a flipped byte in a meta record,
    which leaves LMDB's structure whole, cost its block: it was deleted as junk at the next start."""
    path = tmp_path / "env"
    tier, keys, values = await _stored_tier(path, num_blocks=5)
    await tier.close()
    good = make_block(50)

    def add_junk(txn, blocks, meta_db):
        txn.put(keys[0], b"\x01\x02\x03", db=meta_db)  # meta that does not decode
        txn.delete(keys[1], db=meta_db)  # block without meta
        txn.delete(keys[2], db=blocks)  # meta without block
        txn.put(keys[4], struct.pack("<BddQ", 35, 0.0, 0.0, len(values[4]) + 1), db=meta_db)  # a wrong length
        txn.put(make_key(60), good, db=blocks)  # a record that does not end with its key
        txn.put(make_key(61), struct.pack("<BddQ", 35, 0.0, 0.0, len(good)), db=meta_db)
        txn.put(make_key(61), good, db=blocks)  # the same, with a meta record

    _edit_records(path, add_junk)
    tier = LMDBTier(path, 4 * MiB)
    entries = {e.key: e for e in await tier.resident()}
    assert set(entries) == {keys[0], keys[1], keys[3], keys[4]}
    assert [entries[k].meta.priority for k in (keys[0], keys[1], keys[4])] == [DEFAULT_PRIORITY] * 3
    assert entries[keys[3]].meta.priority == 43
    assert tier.counters()["corrupt_records"] == 3 and tier.counters()["repaired_records"] == 3
    assert tier.used_bytes == sum(tier.footprint(len(values[i])) for i in (0, 1, 3, 4))
    assert {e.key for e in await tier.resident()} == set(entries)  # repaired: nothing more to do
    assert tier.counters()["corrupt_records"] == 3 and tier.counters()["repaired_records"] == 3
    assert await tier.get([keys[0], keys[1], keys[3], keys[4]]) == [values[0], values[1], values[3], values[4]]
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
    """``disk.capacity_bytes`` is the map size, the bound of ``data.mdb``; blocks fill ``DISK_FILL_FRACTION`` of it."""
    tier = LMDBTier.from_config(DiskTierConfig(path=str(tmp_path / "env"), capacity_bytes=8 * MiB))
    assert (tier.name, tier.capacity_bytes, tier.persistent, tier.sync) == ("disk", usable_bytes(8 * MiB), True, False)
    assert tier._env.info()["map_size"] == 8 * MiB
    assert default_map_size_bytes(tier.capacity_bytes) == 8 * MiB
    for map_size in (MiB, 8 * MiB, 64 * MiB, 100 * MiB, 128 * MiB, 8 << 30, 300 * 4096):  # they agree at every scale
        assert default_map_size_bytes(usable_bytes(map_size)) == map_size
    assert usable_bytes(8 << 30) == int((8 << 30) * DISK_FILL_FRACTION)
    assert os.path.isdir(tmp_path / "env")
    with pytest.raises(InvalidArgumentError):
        LMDBTier.from_config(DiskTierConfig(path=""))


def test_footprint_models_overflow_pages(tmp_path):
    tier = LMDBTier(tmp_path / "env", 4 * MiB)
    assert tier.page_bytes == 4096
    assert tier.footprint(4096 - 16 - 40) == 4096 + 256  # the record is the block and its key (up to 40 bytes)
    assert tier.footprint(4096 - 15 - 40) == 2 * 4096 + 256
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


# -- integrity (issue 18) ------------------------------------------------------------------


async def _closed_tier_with_blocks(path, num_blocks=12, shape=(2, 2, 4, 16, 32)):
    """Blocks put in batches of 3, then a get, so the last transaction (the close's recency flush) writes no block:
    both meta pages' snapshots hold every block."""
    tier = LMDBTier(path, 16 * MiB)
    keys = [make_key(i) for i in range(num_blocks)]
    values = [make_block(i, shape=shape) for i in range(num_blocks)]
    for i in range(0, num_blocks, 3):
        await tier.put(keys[i:i + 3], values[i:i + 3], [meta()] * len(keys[i:i + 3]))
    assert await tier.get(keys[:1]) == values[:1]
    await tier.close()
    return keys, values


def _quarantined(path) -> list[str]:
    directory = path / "quarantine"
    return sorted(os.listdir(directory)) if directory.exists() else []


async def test_a_record_pointing_at_another_blocks_pages_is_a_miss_not_that_block(tmp_path):
    """A damaged page number in a leaf points a record at the pages of another, valid block. Each record ends with
    its own key, so the block is refused (today's format), never served under the wrong key."""
    path = tmp_path / "env"
    tier, keys, values = await _stored_tier(path)
    await tier.close()

    def redirect(txn, blocks, _meta):
        txn.put(keys[1], txn.get(keys[0], db=blocks), db=blocks)  # key 1's record now holds key 0's pages

    _edit_records(path, redirect)
    tier = LMDBTier(path, 4 * MiB)
    assert await tier.get(keys) == [values[0], None, values[2]]
    assert tier.counters()["corrupt_records"] == 1
    await tier.close()


@pytest.mark.parametrize("slot", [0, 1])
async def test_a_zeroed_meta_page_is_quarantined_and_the_blocks_are_salvaged(tmp_path, caplog, slot):
    """Regression (finding 2): a zeroed meta page stopped the disk tier from opening (MDB_INVALID) until an
    operator moved the file by hand. Now the file is moved aside, logged, and every block is salvaged from the
    other meta page's snapshot."""
    path = tmp_path / "env"
    keys, values = await _closed_tier_with_blocks(path)
    with open(path / "data.mdb", "r+b") as data:
        data.seek(slot * 4096)
        data.write(bytes(4096))
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.lmdb"):
        tier = LMDBTier(path, 16 * MiB)
    [moved] = _quarantined(path)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert str(path / "data.mdb") in record.getMessage() and moved in record.getMessage()
    assert "failed its check (" in record.getMessage()  # with the reason
    assert await tier.get(keys) == values
    assert {e.key for e in await tier.resident()} == set(keys)
    await tier.put([make_key(99)], [make_block(99)], [meta()])  # the new file takes writes
    await tier.close()
    tier = LMDBTier(path, 16 * MiB)  # and is clean: nothing more is quarantined
    assert len(_quarantined(path)) == 1
    assert await tier.get([*keys, make_key(99)]) == [*values, make_block(99)]
    await tier.close()


async def test_zeroed_meta_pages_and_a_file_of_junk_start_an_empty_tier(tmp_path, caplog):
    path = tmp_path / "env"
    keys, _ = await _closed_tier_with_blocks(path)
    with open(path / "data.mdb", "r+b") as data:
        data.write(bytes(2 * 4096))
    tier = LMDBTier(path, 16 * MiB)
    assert await tier.resident() == [] and await tier.get(keys) == [None] * len(keys)
    await tier.put(keys[:1], [make_block(0, shape=(2, 2, 4, 16, 32))], [meta()])
    await tier.close()
    (path / "data.mdb").write_bytes(os.urandom(3 * 4096 + 17))
    first = _quarantined(path)
    tier = LMDBTier(path, 16 * MiB)
    assert await tier.resident() == []
    assert len(_quarantined(path)) == 1 and _quarantined(path) != first  # the latest damaged file is kept
    await tier.close()


async def test_a_truncated_file_is_quarantined_and_the_blocks_it_still_holds_are_salvaged(tmp_path):
    """Regression (finding 2): a data.mdb cut short stopped the tier from opening."""
    path = tmp_path / "env"
    keys, values = await _closed_tier_with_blocks(path, num_blocks=30)
    layout = page_map(path / "data.mdb")
    size = os.path.getsize(path / "data.mdb")
    cut = size // 2 // 4096 * 4096
    os.truncate(path / "data.mdb", cut)
    tier = LMDBTier(path, 16 * MiB)
    assert len(_quarantined(path)) == 1
    got = await tier.get(keys)
    lost = set(range(cut // 4096, size // 4096))
    for key, value, found in zip(keys, values, got):
        assert found in (None, value)  # never a wrong byte
        if not layout.hit(b"blocks", key, lost) and not layout.hit(b"meta", key, lost):
            assert found == value  # every block the cut did not reach is still there
    await tier.close()


def test_old_disk_format_files_are_dropped_with_a_warning(tmp_path, caplog):
    """Disk format 1 (bare blocks of codec version 1, no ``info`` record) is not read: its blocks' headers were not
    covered by their checksum. The tier starts empty on a new file, and says so."""
    path = tmp_path / "env"
    env = lmdb.open(str(path), max_dbs=2, map_size=64 * MiB)
    blocks, meta_db = env.open_db(b"blocks"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(make_key(0), make_block(0), db=blocks)
        txn.put(make_key(0), struct.pack("<BddQ", 35, 0.0, 0.0, len(make_block(0))), db=meta_db)
    env.close()

    async def reopen():
        tier = LMDBTier(path, 4 * MiB)
        try:
            return await tier.resident(), await tier.get([make_key(0)])
        finally:
            await tier.close()

    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.lmdb"):
        assert asyncio.run(reopen()) == ([], [None])
    assert any("disk format 1" in r.getMessage() for r in caplog.records)
    assert _quarantined(path) == []  # not damage: nothing quarantined


async def test_records_lmdb_cannot_read_are_misses_set_aside_not_errors(tmp_path):
    """A leaf page zeroed while the tier runs: LMDB answers MDB_CORRUPTED for every record under it. Those are
    misses (which the store forgets), counted; the other records are served; deletes do not raise."""
    path = tmp_path / "env"
    tier = LMDBTier(path, 64 * MiB)
    keys = [make_key(i) for i in range(400)]
    values = [make_block(i, shape=(1, 2, 1, 16, 8)) for i in range(400)]  # small: several records per leaf page
    await tier.put(keys, values, [meta()] * len(keys))
    layout = page_map(path / "data.mdb")
    leaves = layout.leaf_pages(b"blocks")
    assert len(leaves) > 2
    with open(path / "data.mdb", "r+b") as data:
        data.seek(leaves[1] * layout.page_bytes)
        data.write(bytes(layout.page_bytes))
    under = {key for key in keys if layout.records[b"blocks"][key].path[-1] == leaves[1]}
    got = await tier.get(keys)
    assert [k for k, v in zip(keys, got) if v is None] == [k for k in keys if k in under]
    assert all(v == value for k, v, value in zip(keys, got, values) if k not in under)
    assert tier.counters()["unreadable_records"] == len(under)
    assert under and await tier.contains(sorted(under)) == [False] * len(under)
    await tier.delete(sorted(under))  # no error
    assert await tier.get(keys[:1]) == values[:1]
    await tier.close()
