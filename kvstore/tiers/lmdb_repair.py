"""Repair of a damaged disk tier file: quarantine ``data.mdb`` and salvage the blocks that still verify."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import time
from typing import Any

import lmdb

from kvstore.errors import CodecError
from kvstore.policy import DEFAULT_PRIORITY
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.lmdb_file import check_data_file, salvage_records
from kvstore.tiers.lmdb_records import (
    DISK_FORMAT,
    QUARANTINE_DIR,
    REBUILD_DIR,
    block_of_record,
    pack_meta,
    remove_environment_files,
    unpack_meta,
)

logger = logging.getLogger(__name__)


def _file_bytes(data_file: str) -> int:
    try:
        return os.path.getsize(data_file)
    except OSError:
        return 0


def check_and_repair(path: str, map_size_bytes: int, name: str) -> None:
    """Check ``data.mdb`` before LMDB maps it; move a damaged one aside and open what can be salvaged instead.

    No other process has the directory (the lock is held), so the file does not change meanwhile.

    Args:
        path: the tier's directory.
        map_size_bytes: the tier's LMDB map size, bytes (the bound of the salvaged file).
        name: the tier's name, for the log.
    """
    data_file = os.path.join(path, "data.mdb")
    shutil.rmtree(os.path.join(path, REBUILD_DIR), ignore_errors=True)  # left by a crash mid-repair
    if _file_bytes(data_file) == 0:
        return  # none yet (LMDB creates it), or an empty one LMDB treats as new
    started = time.monotonic()
    problems = check_data_file(data_file)
    if not problems:
        logger.info("disk tier %s: %s passed its check in %.2f s", name, data_file,
                    time.monotonic() - started)
        return
    repair(path, map_size_bytes, name, problems)


def repair(path: str, map_size_bytes: int, name: str, problems: list[str]) -> None:
    """Quarantine a damaged ``data.mdb`` and put a file of every block salvaged from it in its place.

    Logs at ERROR what was wrong, where the damaged file went, and how many blocks were kept.
    Arguments as :func:`check_and_repair`'s; ``problems`` are what the check (or LMDB) found.
    """
    data_file = os.path.join(path, "data.mdb")
    rebuild = os.path.join(path, REBUILD_DIR)
    os.makedirs(rebuild)
    try:
        kept, lost = _salvage_into(data_file, rebuild, map_size_bytes)
    except (lmdb.Error, OSError) as exc:  # e.g. no room for the new file: start empty
        logger.error("disk tier %s: salvaging %s failed (%s); starting empty", name, data_file, exc)
        kept, lost = 0, -1
    quarantine = os.path.join(path, QUARANTINE_DIR)
    os.makedirs(quarantine, exist_ok=True)
    for old in os.listdir(quarantine):  # one damaged file is kept at most: the latest
        os.unlink(os.path.join(quarantine, old))
        logger.warning("disk tier %s: deleted the older quarantined file %s", name, old)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    moved = os.path.join(quarantine, f"data-{stamp}.mdb")
    os.replace(data_file, moved)
    remove_environment_files(path)
    if kept:
        os.replace(os.path.join(rebuild, "data.mdb"), data_file)
    shutil.rmtree(rebuild, ignore_errors=True)
    where = f"moved to {moved}"
    if shutil.disk_usage(path).free < map_size_bytes - _file_bytes(data_file):  # the new file may need
        # that room to grow to its bound: keep no copy
        os.unlink(moved)
        where = f"deleted, not quarantined: {path} has no room beside the new file for it ({moved})"
    logger.error(
        "disk tier %s: %s failed its check (%s%s); %s; %s blocks salvaged into a new file%s",
        name, data_file, problems[0], f", and {len(problems) - 1} more problems" if problems[1:] else "",
        where, kept, f", {lost} records could not be read or verified" if lost >= 0 else "",
    )


def _salvage_into(data_file: str, directory: str, map_size_bytes: int) -> tuple[int, int]:
    """Copy every block of the damaged file that still verifies, with its meta, into a new environment.

    Returns:
        Blocks copied, and records that were found but dropped (unverifiable, or of disk format 1).
    """
    metas = {record.key: record.value for record in salvage_records(data_file, {b"meta"})}  # 25 bytes each (41 with a TTL)
    kept = found = 0
    env = lmdb.open(directory, map_size=map_size_bytes, max_dbs=3, sync=True, metasync=True)
    try:
        blocks_db, meta_db, info_db = (env.open_db(name) for name in (b"blocks", b"meta", b"info"))
        with env.begin(write=True) as txn:
            txn.put(b"format", DISK_FORMAT, db=info_db)
        batch: list[tuple[bytes, bytes, bytes]] = []
        for record in salvage_records(data_file, {b"blocks"}):  # one block at a time
            found += 1
            try:
                block = block_of_record(record.key, record.value)
            except CodecError:
                continue
            parsed = unpack_meta(metas.pop(record.key, None))
            stored = len(record.value) - len(record.key)  # the block, or its compressed frame
            if parsed is None or parsed[1] != stored:  # the meta is gone: the block is still good
                parsed = BlockMeta(DEFAULT_PRIORITY, 0.0, 0.0), stored
            batch.append((record.key, record.value, pack_meta(*parsed)))
            if len(batch) >= 256:
                kept += _write_salvaged(env, blocks_db, meta_db, batch)
                batch = []
        kept += _write_salvaged(env, blocks_db, meta_db, batch)
    finally:
        env.close()
    return kept, found + len(metas) - kept


def _write_salvaged(env: lmdb.Environment, blocks_db: Any, meta_db: Any,
                    batch: list[tuple[bytes, bytes, bytes]]) -> int:
    if not batch:
        return 0
    try:
        with env.begin(write=True) as txn:
            for key, record, meta in batch:
                txn.put(key, record, db=blocks_db)
                txn.put(key, meta, db=meta_db)
    except lmdb.MapFullError:
        return 0  # more than the map holds (the capacity was lowered): the rest is dropped
    return len(batch)


def drop_other_format(env: lmdb.Environment, blocks_db: Any, meta_db: Any, info_db: Any, path: str, name: str) -> bool:
    """Drop an environment of another disk format (logged), and mark a new one with :data:`DISK_FORMAT`.

    A file of disk format 1 is deleted; one of a newer format is moved into
    ``quarantine/`` for that version to use again.

    Args:
        env: the open environment, closed here when it is dropped.
        blocks_db: its ``blocks`` sub-database.
        meta_db: its ``meta`` sub-database.
        info_db: its ``info`` sub-database.
        path: the tier's directory.
        name: the tier's name, for the log.

    Returns:
        Whether the environment was dropped (closed, its files gone): the caller opens a new one.
    """
    with env.begin(write=True) as txn:
        found = txn.get(b"format", db=info_db)
        num_records = txn.stat(blocks_db)["entries"] + txn.stat(meta_db)["entries"]
        if found is None and not num_records:
            txn.put(b"format", DISK_FORMAT, db=info_db)
            return False
    if found == DISK_FORMAT:
        return False
    env.close()
    if found is None:  # format 1: blocks of codec version 1, which this build does not read
        logger.warning("disk tier %s at %s holds %s records of disk format 1 (codec version 1 blocks, whose "
                       "checksum did not cover the header); dropped, the tier starts empty",
                       name, path, num_records)
        remove_environment_files(path)
    else:  # a newer kvstore's: kept aside, not deleted, for that version to use again
        quarantine = os.path.join(path, QUARANTINE_DIR)
        os.makedirs(quarantine, exist_ok=True)
        moved = os.path.join(quarantine, f"data-format-{found.decode(errors='replace')}.mdb")
        os.replace(os.path.join(path, "data.mdb"), moved)
        remove_environment_files(path)
        logger.error("disk tier %s at %s is of disk format %r, which this build does not read; moved to %s, "
                     "the tier starts empty", name, path, found, moved)
    return True
