"""Tests of the bounds-checked LMDB file reader: the check before a file is opened, and salvage."""

from __future__ import annotations

import os
import random

import lmdb
import pytest

from kvstore.tiers.lmdb_file import check_data_file, read_snapshots, salvage_records
from tests.support.lmdb_pages import page_map


def churned_environment(path, *, seed: int = 0, rounds: int = 40) -> dict[tuple[bytes, bytes], bytes]:
    """An environment after many write transactions of puts and deletes of mixed sizes; returns what it holds."""
    rng = random.Random(seed)
    env = lmdb.open(str(path), map_size=256 << 20, max_dbs=3)
    trees = {name: env.open_db(name) for name in (b"blocks", b"meta")}
    held: dict[tuple[bytes, bytes], bytes] = {}
    for _ in range(rounds):
        with env.begin(write=True) as txn:
            for _ in range(rng.randint(1, 30)):
                key = rng.randbytes(24)
                for name, size in ((b"blocks", rng.choice([100, 3000, 20_000, 200_000])), (b"meta", 25)):
                    value = rng.randbytes(size)
                    txn.put(key, value, db=trees[name])
                    held[(name, key)] = value
            for name, key in rng.sample(sorted(held), min(len(held), rng.randint(0, 15))):
                txn.delete(key, db=trees[name])
                del held[(name, key)]
    env.close()
    return held


@pytest.mark.slow
def test_a_clean_file_passes_and_salvage_reads_every_record_of_it(tmp_path) -> None:
    held = churned_environment(tmp_path)
    assert check_data_file(tmp_path / "data.mdb") == []
    salvaged = {(r.tree, r.key): r.value for r in salvage_records(tmp_path / "data.mdb")}
    assert salvaged == held
    assert {(r.tree, r.key) for r in salvage_records(tmp_path / "data.mdb", {b"meta"})} == \
        {k for k in held if k[0] == b"meta"}
    newest, older = read_snapshots(tmp_path / "data.mdb")
    assert newest.txnid == older.txnid + 1


@pytest.mark.parametrize("damage", ["truncate", "meta", "leaf", "garbage"])
@pytest.mark.slow
def test_damage_is_found_and_salvage_never_fails_on_it(tmp_path, damage: str) -> None:
    held = churned_environment(tmp_path)
    data_file = tmp_path / "data.mdb"
    layout = page_map(data_file)
    raw = bytearray(data_file.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "meta":
        raw[:4096] = bytes(4096)
    elif damage == "leaf":
        page = layout.leaf_pages(b"blocks")[0]
        raw[page * 4096 + 16: page * 4096 + 32] = b"\xff" * 16
    else:
        raw = bytearray(os.urandom(len(raw)))
    data_file.write_bytes(bytes(raw))
    assert check_data_file(data_file)
    for record in salvage_records(data_file):  # whatever it still reads, it reads without an error
        assert record.tree in (b"blocks", b"meta")
        if damage == "meta":  # the other snapshot is whole: the one before the last transaction
            assert record.tree in (b"blocks", b"meta")
