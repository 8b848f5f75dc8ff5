"""Blocks that go missing or bad on disk while a store runs (issue 18, findings 3 and 4), through the public API only.

A record deleted behind the store's back (a disk fault, an operator) or one
LMDB can no longer read or delete (pages of the file zeroed while the store
runs) must be a miss for that block and every later one of its prefix, be
counted, and be forgotten by the index at once: lookups stop claiming it, the
next put stores it again, and the store and its other blocks stay in service.
The damage is done by another process (``lmdb`` in a child, or plain writes to
``data.mdb``), as it would be in production.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import DiskTierConfig, MemoryTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore, open_store
from kvstore.keys import Namespace, block_key, hash_blocks
from tests.support.lmdb_pages import page_map

NS = Namespace(model="tests/lost-blocks", dtype="float16", block_size=16)
MiB = 1 << 20


def chains(num_chains: int, length: int, seed: int = 0) -> list[tuple[list[bytes], list[bytes]]]:
    """``num_chains`` prefixes of ``length`` blocks: their chained hashes and ``[2, 2, 4, 16, 64]`` blocks (~16 KiB)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_chains):
        tokens = torch.randint(0, 50_000, (length * NS.block_size,), generator=generator)
        blocks = [encode_block(torch.randn(2, 2, 4, NS.block_size, 64, generator=generator).half())
                  for _ in range(length)]
        out.append((hash_blocks(NS, tokens), blocks))
    return out


def disk_only(path: Path) -> StoreConfig:
    return StoreConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(path), capacity_bytes=64 * MiB))


def disk_counters(store: EmbeddedStore) -> dict[str, int]:
    stats = store.stats().tier("disk")
    return {"corrupt_records": stats.corrupt_records, **stats.counters}


def delete_records_in_another_process(path: Path, keys: list[bytes]) -> None:
    """Delete the LMDB records of ``keys`` from a child process, as a disk fault or an operator would."""
    script = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], max_dbs=3)\n"
        "blocks, meta = env.open_db(b'blocks'), env.open_db(b'meta')\n"
        "with env.begin(write=True) as txn:\n"
        "    for key in sys.argv[2:]:\n"
        "        assert txn.delete(bytes.fromhex(key), db=blocks) and txn.delete(bytes.fromhex(key), db=meta)\n"
        "env.close()\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path), *(k.hex() for k in keys)], check=True, timeout=60)


def test_a_record_deleted_behind_the_stores_back_is_forgotten_counted_and_put_again(tmp_path: Path) -> None:
    """Regression (finding 4): get returned 2 blocks, lookup kept answering 5, a re-put stored nothing ("already
    stored") so the prefix stayed broken for good, and the miss was not counted."""
    (hashes, blocks), = chains(1, 5)
    with open_store(disk_only(tmp_path / "disk")) as store:
        assert store.put(NS, hashes, blocks) == 5
        delete_records_in_another_process(tmp_path / "disk", [block_key(NS, hashes[2])])
        assert store.get(NS, hashes) == blocks[:2]
        assert store.lookup(NS, hashes).num_blocks == 2  # forgotten at once: lookups stop claiming it
        assert disk_counters(store)["lost_records"] == 1
        assert store.get(NS, hashes[3:]) == blocks[3:]  # the blocks after it are still there
        assert store.put(NS, hashes, blocks) == 1  # the next put stores it again
        assert store.get(NS, hashes) == blocks
        assert store.lookup(NS, hashes).num_blocks == 5
        assert disk_counters(store)["lost_records"] == 1


def test_a_record_lmdb_cannot_delete_is_a_miss_and_the_store_stays_in_service(tmp_path: Path) -> None:
    """Regression (finding 3): after 64 KiB of data.mdb were zeroed, a get of a block there failed with
    UNAVAILABLE ('mdb_del: MDB_CORRUPTED'), every time, and lookup still reported the block."""
    prefixes = chains(8, 5)
    with open_store(disk_only(tmp_path / "disk")) as store:
        for hashes, blocks in prefixes:
            assert store.put(NS, hashes, blocks) == 5
        data_file = tmp_path / "disk" / "data.mdb"
        layout = page_map(data_file)
        target = layout.records[b"blocks"][block_key(NS, prefixes[0][0][2])].overflow.start
        zeroed = set(range(target, target + 64 * 1024 // layout.page_bytes))
        with open(data_file, "r+b") as data:  # while the store runs, as a failing disk or a stray write would
            data.seek(target * layout.page_bytes)
            data.write(bytes(64 * 1024))

        for attempt in range(2):  # the second time, it is a plain miss: nothing is left to fail on
            for hashes, blocks in prefixes:
                hit = [layout.hit(b"blocks", block_key(NS, h), zeroed) for h in hashes]
                intact = hit.index(True) if True in hit else len(hashes)
                assert store.get(NS, hashes) == blocks[:intact], attempt  # no error, no wrong byte
                assert store.lookup(NS, hashes).num_blocks == intact
        assert store.get(NS, prefixes[0][0]) == prefixes[0][1][:2]
        counts = disk_counters(store)
        assert counts["corrupt_records"] + counts["unreadable_records"] >= 1
        assert store.put(NS, *chains(1, 3, seed=7)[0]) == 3  # the store still takes new blocks

    with open_store(disk_only(tmp_path / "disk")) as store:  # the restart checks the file and repairs it
        for hashes, blocks in prefixes:
            hit = [layout.hit(b"blocks", block_key(NS, h), zeroed) for h in hashes]
            intact = hit.index(True) if True in hit else len(hashes)
            assert store.get(NS, hashes)[:intact] == blocks[:intact]
        hashes, blocks = prefixes[0]
        assert store.put(NS, hashes, blocks) >= 1  # the lost blocks can be stored again
        assert store.get(NS, hashes) == blocks


def test_a_block_on_disk_that_does_not_fit_its_namespace_is_refused_deleted_and_counted(tmp_path: Path) -> None:
    """Regression (finding 1): the Redis read path checked a block's dtype against the namespace, the LMDB path did
    not. Here a whole, valid block of another dtype (bfloat16) sits under a float16 block's key, as a record
    written by another program would: its checksum holds, its namespace does not."""
    (hashes, blocks), = chains(1, 3)
    other = encode_block(torch.randn(2, 2, 4, NS.block_size, 64).to(torch.bfloat16))
    with open_store(disk_only(tmp_path / "disk")) as store:
        assert store.put(NS, hashes, blocks) == 3
        key = block_key(NS, hashes[1])
        script = (
            "import lmdb, sys\n"
            "env = lmdb.open(sys.argv[1], max_dbs=3)\n"
            "blocks = env.open_db(b'blocks')\n"
            "key, value = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])\n"
            "with env.begin(write=True) as txn:\n"
            "    bound = txn.get(key, db=blocks).endswith(key)\n"  # records end with their key (disk format 2)
            "    txn.put(key, value + key if bound else value, db=blocks)\n"  # a well-formed record
            "env.close()\n"
        )
        subprocess.run([sys.executable, "-c", script, str(tmp_path / "disk"), key.hex(), other.hex()], check=True,
                       timeout=60)
        assert store.get(NS, hashes) == blocks[:1]
        assert store.lookup(NS, hashes).num_blocks == 1
        assert disk_counters(store)["corrupt_records"] == 1
        assert store.put(NS, hashes, blocks) == 1
        assert store.get(NS, hashes) == blocks
