"""The disk tier's records and directory: the ``blocks`` and ``meta`` record formats, map sizing, the directory lock.

Layout of the environment (a directory holding ``data.mdb`` and ``lock.mdb``),
disk format :data:`DISK_FORMAT`:

* sub-database ``blocks``: key -> the encoded block (``kvstore.blocks.tensors`` format),
  then the key itself. The trailing key binds the record to its key: a damaged
  page number that points a leaf at another block's pages yields a value that
  does not end with the key asked for, never another block;
* sub-database ``meta``: key -> ``<BddQ`` little-endian struct of 25 bytes:
  priority (u8), expires_at (f64, ``time.time()`` seconds, 0 for none),
  last_access (f64, seconds), nbytes (u64, length of the block); a block with a
  TTL (``docs/agentic.md``) has 16 bytes more, ``<dd``: ttl_s (f64, seconds) and
  pinned_until (f64, ``time.time()`` seconds), so a restart keeps the TTL (a
  release before TTLs reads such a record as a lost meta, and keeps the block);
* sub-database ``info``: ``format`` -> the disk format, ``b"2"``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import struct
from typing import Any

import lmdb

from kvstore.tiers.compression import block_nbytes, unpack
from kvstore.blocks.format import verify_block
from kvstore.errors import CodecError, ConfigError, UnavailableError
from kvstore.policy import MAX_PRIORITY
from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, ResidentEntry

logger = logging.getLogger(__name__)

MiB = 1024 * 1024

_META = struct.Struct("<BddQ")
"""priority u8, expires_at f64, last_access f64, nbytes u64: the ``meta`` record of one block (25 bytes)."""

DISK_FORMAT = b"2"
"""The layout of the environment (see the module docstring); format 1 stored bare codec-version-1 blocks."""

MAX_KEY_BYTES = 40
"""The longest tier key (an 8-byte namespace tag and a 32-byte SHA-256 block hash): each record ends with its key."""

RECORD_OVERHEAD_BYTES = 256
"""Bytes :meth:`LMDBTier.footprint` adds per block for its two leaf nodes and their share of branch pages."""

DISK_FILL_FRACTION = 0.75
"""Of a large map size (``disk.capacity_bytes``), the share blocks may fill; LMDB's own pages need the rest
(``benchmarks/bench_disk_capacity.py`` measures how much they take)."""

MIN_SLACK_BYTES = 32 * MiB
"""Map bytes left to LMDB however small the map, up to half of it: pages freed by the last two write
transactions are reused only after them, so a small map needs room for a few large batches beyond its blocks."""

FLOOR_SLACK_BYTES = 256 * 1024
"""Map bytes always left to LMDB, even in a tiny map: its meta pages, a copy of each tree's path, the free list."""

MIN_MAP_BYTES = FLOOR_SLACK_BYTES
"""The smallest map (and ``disk.capacity_bytes``) the tier uses; it holds no block."""

QUARANTINE_DIR = "quarantine"
"""Where a damaged data file is kept for an operator to look at: the latest only, and only while the filesystem
keeps room for the new file to grow to its map size."""
REBUILD_DIR = ".rebuild"
"""Where a repair writes the environment it rebuilds (inside the tier's directory), before it replaces the old one."""

PAGE_HEADER_BYTES = 16
"""LMDB's ``PAGEHDRSZ``: the first overflow page of a value starts with a page header."""

RECORD_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError, lmdb.InvalidError,
                 lmdb.IncompatibleError, lmdb.BadTxnError)
"""LMDB errors that mean a page of the file is not what LMDB wrote: the records they stop are lost, the tier is not."""

MIN_FREE_BYTES = 1 << 20
"""Free bytes the disk tier's filesystem must have when it opens (for LMDB's lock and meta pages)."""


def usable_bytes(map_size_bytes: int) -> int:
    """The bytes of block footprints a disk tier whose map (and file) is ``map_size_bytes`` may hold.

    All but ``max(256 KiB, map / 4, min(map / 2, 32 MiB))`` (:data:`FLOOR_SLACK_BYTES`,
    :data:`DISK_FILL_FRACTION`, :data:`MIN_SLACK_BYTES`): three quarters of a map of
    128 MiB or more, half of one from 512 KiB to 64 MiB, 32 MiB less in between.
    """
    slack = max(FLOOR_SLACK_BYTES, map_size_bytes // 4, min(map_size_bytes // 2, MIN_SLACK_BYTES))
    return max(0, map_size_bytes - slack)


def default_map_size_bytes(capacity_bytes: int) -> int:
    """The LMDB map size (the bound of ``data.mdb``) for ``capacity_bytes`` of footprints, rounded up to a page.

    The inverse of :func:`usable_bytes`, so that a tier built from ``disk.capacity_bytes``
    (:meth:`LMDBTier.from_config`) and one built from the footprints it holds agree.
    """
    if capacity_bytes <= FLOOR_SLACK_BYTES:
        map_size = capacity_bytes + FLOOR_SLACK_BYTES
    elif capacity_bytes <= MIN_SLACK_BYTES:
        map_size = 2 * capacity_bytes
    elif capacity_bytes <= 3 * MIN_SLACK_BYTES:
        map_size = capacity_bytes + MIN_SLACK_BYTES
    else:
        map_size = -(-capacity_bytes * 4 // 3)
    return max(MIN_MAP_BYTES, -(-map_size // mmap.PAGESIZE) * mmap.PAGESIZE)


LOCK_FILE = "kvstore.lock"


def prepare_directory(path: str, map_size_bytes: int) -> None:
    """Create the disk tier's directory, and check that it is one this process can write and that it can hold the tier.

    A capacity over what the filesystem can give (its free space plus what the
    tier's files already take) is accepted with a WARNING, not refused: free
    space changes, and the tier turns a full disk into eviction; but until then
    the node competes with everything else on that filesystem.

    Args:
        path: ``store.disk.path``.
        map_size_bytes: the bound of ``data.mdb``: ``store.disk.capacity_bytes`` (page-rounded), of which
            blocks get :func:`usable_bytes`; a warning is logged when the filesystem has less room than that.

    Raises:
        ConfigError: naming ``store.disk.path`` and the path, if it exists and is not a directory, cannot
            be created, or is not writable.
    """
    flag = "--disk-path (store.disk.path, KVSTORE_DISK_PATH)"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("store.disk.path", f"{path} exists and is not a directory; point {flag} at a directory "
                                             "for the LMDB files (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError("store.disk.path", f"cannot create the directory {path}: {exc.strerror or exc}; "
                                             f"point {flag} at a directory this user can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("store.disk.path", f"{path} is not writable by this user (uid {os.getuid()}); "
                                             f"point {flag} at a directory it can write, or change its owner")
    own_bytes = sum(os.path.getsize(os.path.join(path, name)) for name in ("data.mdb",)
                    if os.path.isfile(os.path.join(path, name)))
    available_bytes = shutil.disk_usage(path).free + own_bytes
    if map_size_bytes > available_bytes:
        logger.warning(
            "disk tier at %s: store.disk.capacity_bytes is %.1f GiB but its filesystem has %.1f GiB for it: the tier "
            "may fill the filesystem before it reaches its capacity and starts to evict; lower --disk-capacity "
            "(store.disk.capacity_bytes, KVSTORE_DISK_CAPACITY) below that",
            path, map_size_bytes / 2**30, available_bytes / 2**30,
            extra={"fields": {"path": path, "capacity_bytes": map_size_bytes, "available_bytes": available_bytes}},
        )


def lock_directory(path: str) -> int:
    """Take an exclusive ``flock`` on ``path/kvstore.lock``; returns its descriptor.

    Each tier keeps its own byte count and eviction index, so two processes (or
    two tiers) on one directory would overrun its capacity; the lock refuses the
    second one. The kernel drops the lock when the holder exits, even by a crash.

    Raises:
        UnavailableError: if another tier holds the directory.
    """
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UnavailableError(
            f"the disk tier at {path} is in use by another kvstore process; give each node its own disk path"
        ) from None
    return fd


_PIN = struct.Struct("<dd")
"""ttl_s f64, pinned_until f64: what a ``meta`` record of a block with a TTL has after :data:`_META`."""


def pack_meta(meta: BlockMeta, nbytes: int) -> bytes:
    """The ``meta`` record of a block of ``nbytes`` (see the module docstring): :data:`_PIN` follows only with a TTL."""
    packed = _META.pack(meta.priority, meta.expires_at, meta.last_access, nbytes)
    return packed + _PIN.pack(meta.ttl_s, meta.pinned_until) if meta.ttl_s > 0 else packed


def unpack_meta(raw: bytes | memoryview | None) -> tuple[BlockMeta, int] | None:
    """The meta and nbytes of a ``meta`` record, or ``None`` for a missing or malformed one."""
    if raw is None or len(raw) not in (_META.size, _META.size + _PIN.size):
        return None
    priority, expires_at, last_access, nbytes = _META.unpack_from(raw)
    if priority > MAX_PRIORITY:
        return None
    ttl_s, pinned_until = _PIN.unpack_from(raw, _META.size) if len(raw) > _META.size else (0.0, 0.0)
    return BlockMeta(priority, expires_at, last_access, ttl_s, pinned_until), nbytes


def block_of_record(key: bytes, record: bytes | memoryview) -> bytes:
    """The block a ``blocks`` record holds, copied out and checked: the record ends with ``key``, the block verifies.

    Raises:
        CodecError: naming what is wrong with it.
    """
    view = memoryview(record)
    nbytes = view.nbytes - len(key)
    if nbytes <= 0 or view[nbytes:] != key:
        raise CodecError("the record does not end with its own key (a damaged page points it elsewhere)")
    block = unpack(bytes(view[:nbytes]))  # a compressed frame's block (kvstore.tiers.compression)
    verify_block(block)
    return block


def _ends_with(record: bytes | memoryview, key: bytes) -> bool:
    """Whether a ``blocks`` record is long enough to hold a block and ends with ``key`` (reads only its tail)."""
    view = memoryview(record)
    return view.nbytes > len(key) and view[view.nbytes - len(key):] == key


def remove_environment_files(path: str) -> None:
    """Delete an environment's ``data.mdb`` and ``lock.mdb`` in ``path``, those that exist."""
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


def scan_records(env: lmdb.Environment, blocks_db: Any, meta_db: Any, frames: bool = False
                 ) -> tuple[list[ResidentEntry], list[BlockKey], list[tuple[BlockKey, int]]]:
    """Every block that pairs up with its meta; the junk keys; the blocks whose meta must be rewritten, with
    the length of each (see :meth:`kvstore.tiers.lmdb.LMDBTier.resident`). One read transaction, in a worker thread.

    With ``frames`` (the tier compresses) each entry's ``block_nbytes`` is the length of the block its value
    holds (a frame's header's), which reads the first bytes of every record; without, only lengths are read.
    """
    entries: list[ResidentEntry] = []
    junk: list[BlockKey] = []
    repairs: list[tuple[BlockKey, int]] = []
    with env.begin(buffers=True) as txn:
        for raw_key, raw in txn.cursor(db=meta_db):
            key = BlockKey(bytes(raw_key))
            parsed = unpack_meta(raw)
            record = txn.get(key, db=blocks_db)
            if parsed is not None and record is not None and len(record) == parsed[1] + len(key):
                entries.append(ResidentEntry(key, parsed[1], parsed[0],  # the stored length: a frame's own
                                             block_nbytes(memoryview(record)[:parsed[1]]) if frames else 0))
            elif record is not None and _ends_with(record, key):
                repairs.append((key, len(record) - len(key)))
            else:
                junk.append(key)
        for raw_key, record in txn.cursor(db=blocks_db):
            if txn.get(raw_key, db=meta_db) is None:
                key = BlockKey(bytes(raw_key))
                if _ends_with(record, key):
                    repairs.append((key, len(record) - len(key)))
                else:
                    junk.append(key)
    return entries, junk, repairs
