"""The disk tier: encoded blocks in an LMDB environment that survives restarts with their priority and recency.

Layout of the environment (a directory holding ``data.mdb`` and ``lock.mdb``):

* sub-database ``blocks``: key -> the encoded block (``kvstore.codec`` format);
* sub-database ``meta``: key -> ``<BddQ`` little-endian struct of 25 bytes:
  priority (u8), expires_at (f64, ``time.time()`` seconds, 0 for none),
  last_access (f64, seconds), nbytes (u64, length of the block).

Every LMDB call runs off the event loop: writes in one dedicated writer thread
(one write transaction per put or delete batch, so writers never wait on
LMDB's writer lock), reads in a small reader pool. Gets do not write: the
keys they hit are remembered in memory with the time and their new
``last_access`` goes into the next write transaction, or into the last one on
:meth:`LMDBTier.close`. A process that dies without closing loses only those
recency updates, never a block.

Reads verify the block checksum; a block that fails (any ``CodecError``) is a
miss, is deleted and is counted as ``corrupt_records``. :meth:`LMDBTier.resident`
checks structure only (meta decodes, block present with the recorded length),
not checksums, so that a restart does not read the whole database.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import lmdb

from kvstore.codec import verify_block
from kvstore.config import DiskTierConfig
from kvstore.errors import CodecError, ConfigError, InvalidArgumentError, UnavailableError
from kvstore.keys import BlockKey
from kvstore.policy import MAX_PRIORITY
from kvstore.tiers.base import CHAIN_STEP_S, BlockMeta, ResidentEntry, TierFullError, done, put_order

logger = logging.getLogger(__name__)

MiB = 1024 * 1024

_META = struct.Struct("<BddQ")
"""priority u8, expires_at f64, last_access f64, nbytes u64: the ``meta`` record of one block (25 bytes)."""

RECORD_OVERHEAD_BYTES = 256
"""Bytes :meth:`LMDBTier.footprint` adds per block for its two leaf nodes and their share of branch pages."""

_PAGE_HEADER_BYTES = 16  # LMDB's PAGEHDRSZ: the first overflow page of a value starts with a page header

_T = TypeVar("_T")


MIN_FREE_BYTES = 1 << 20
"""Free bytes the disk tier's filesystem must have when it opens (for LMDB's lock and meta pages)."""


def _consume_outcome(future: asyncio.Future[Any]) -> None:
    """Observe the outcome of a write whose caller was cancelled; an LMDB failure is still logged."""
    if not future.cancelled() and isinstance(future.exception(), lmdb.Error):
        logger.error("LMDB write failed after its caller was cancelled: %s", future.exception())


def _check_not_truncated(env: lmdb.Environment, path: str) -> None:
    """Refuse a ``data.mdb`` shorter than the pages its meta page says are in use.

    LMDB maps the file and would read past its end: the process dies of SIGBUS
    with nothing logged (a copy cut short, a disk that filled up).

    Raises:
        UnavailableError: naming the file and both sizes.
    """
    data_file = os.path.join(path, "data.mdb")
    needed_bytes = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    file_bytes = os.path.getsize(data_file)
    if file_bytes < needed_bytes:
        raise UnavailableError(f"LMDB file {data_file} is truncated: {file_bytes} bytes, but its pages need "
                               f"{needed_bytes}; restore it from a copy, or move it away to start empty")


def default_map_size_bytes(capacity_bytes: int) -> int:
    """The LMDB map size for a capacity: 1.5x plus 64 MiB, rounded up to 1 MiB.

    The slack covers what :meth:`LMDBTier.footprint` does not model: pages freed
    by the last write transaction, which LMDB reuses only one transaction later,
    the free-page list itself, and runs of free pages too short for a new
    overflow value.
    """
    return -(-(capacity_bytes * 3 // 2 + 64 * MiB) // MiB) * MiB


LOCK_FILE = "kvstore.lock"


def prepare_directory(path: str, capacity_bytes: int) -> None:
    """Create the disk tier's directory, and check that it is one this process can write and that it can hold the tier.

    A capacity over what the filesystem can give (its free space plus what the
    tier's files already take) is accepted with a WARNING, not refused: free
    space changes, and the tier turns a full disk into eviction; but until then
    the node competes with everything else on that filesystem.

    Args:
        path: ``store.disk.path``.
        capacity_bytes: ``store.disk.capacity_bytes``.

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
    if capacity_bytes > available_bytes:
        logger.warning(
            "disk tier at %s: store.disk.capacity_bytes is %.1f GiB but its filesystem has %.1f GiB for it: the tier "
            "may fill the filesystem before it reaches its capacity and starts to evict; lower --disk-capacity "
            "(store.disk.capacity_bytes, KVSTORE_DISK_CAPACITY) below that",
            path, capacity_bytes / 2**30, available_bytes / 2**30,
            extra={"fields": {"path": path, "capacity_bytes": capacity_bytes, "available_bytes": available_bytes}},
        )


def _lock_directory(path: str) -> int:
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


def _pack_meta(meta: BlockMeta, nbytes: int) -> bytes:
    return _META.pack(meta.priority, meta.expires_at, meta.last_access, nbytes)


def _unpack_meta(raw: bytes | memoryview | None) -> tuple[BlockMeta, int] | None:
    """The meta and nbytes of a ``meta`` record, or ``None`` for a missing or malformed one."""
    if raw is None or len(raw) != _META.size:
        return None
    priority, expires_at, last_access, nbytes = _META.unpack(raw)
    if priority > MAX_PRIORITY:
        return None
    return BlockMeta(priority, expires_at, last_access), nbytes


class LMDBTier:
    """Encoded blocks in an LMDB environment on local disk.

    Implements :class:`kvstore.tiers.base.Tier`. It never evicts: it keeps its
    own count of :meth:`footprint` bytes held and refuses a batch that would
    take it over ``capacity_bytes``, and it turns a full LMDB map into
    :class:`TierFullError`; either way nothing of the batch is stored. A put of
    a key already held replaces its value and meta (last writer wins); within
    one batch the last occurrence of a key wins.

    A put or delete whose caller is cancelled is still committed: once
    submitted, a write runs to its end in the writer thread, in the order
    writes were submitted (see :meth:`kvstore.tiers.base.Tier.delete`).

    A corrupt record that a get finds is deleted (and is a miss, which the store
    forgets).

    Args:
        path: directory of the environment; created if missing.
        capacity_bytes: bytes of :meth:`footprint` the tier may hold.
        sync: fsync data and meta pages at every commit (``lmdb.open(sync=, metasync=)``);
            without it a commit survives a process crash but not an OS crash.
        name: tier name in stats and metrics.
        map_size_bytes: LMDB map size, bytes; :func:`default_map_size_bytes` of the
            capacity when ``None``. An existing larger environment keeps its size.
        num_reader_threads: threads that run read transactions.

    Raises:
        InvalidArgumentError: on a negative capacity.
        UnavailableError: if the environment cannot be opened.
    """

    persistent = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        sync: bool = False,
        name: str = "disk",
        map_size_bytes: int | None = None,
        num_reader_threads: int = 4,
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self.path = os.fspath(path)
        self.sync = sync
        map_size = default_map_size_bytes(capacity_bytes) if map_size_bytes is None else map_size_bytes
        prepare_directory(self.path, capacity_bytes)
        free_bytes = shutil.disk_usage(self.path).free
        if free_bytes < MIN_FREE_BYTES:  # LMDB maps its files: growing one on a full disk is a SIGBUS, not an error
            raise UnavailableError(f"cannot open LMDB environment at {self.path}: {free_bytes} bytes free on its "
                                   f"filesystem, fewer than {MIN_FREE_BYTES}")
        self._lock_fd = _lock_directory(self.path)
        try:
            self._env = lmdb.open(
                self.path, map_size=map_size, max_dbs=2, sync=sync, metasync=sync,
                max_readers=126 + num_reader_threads,
            )
            _check_not_truncated(self._env, self.path)
            self._blocks = self._env.open_db(b"blocks")
            self._meta = self._env.open_db(b"meta")
        except (lmdb.Error, UnavailableError) as exc:
            if hasattr(self, "_env"):
                self._env.close()
            os.close(self._lock_fd)
            if isinstance(exc, UnavailableError):
                raise
            raise UnavailableError(f"cannot open LMDB environment at {self.path}: {exc}") from exc
        self.page_bytes: int = self._env.stat()["psize"]
        self._used_bytes = self._scan_used_bytes()
        self._corrupt_records = 0
        self._touched: dict[BlockKey, float] = {}  # keys hit by gets since the last write txn -> time
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"lmdb-{name}-w")
        self._readers = ThreadPoolExecutor(num_reader_threads, thread_name_prefix=f"lmdb-{name}-r")
        self._closed = False
        logger.info(
            "disk tier %s at %s: map %s bytes, %s of %s bytes used",
            name, self.path, self._env.info()["map_size"], self._used_bytes, capacity_bytes,
        )

    @classmethod
    def from_config(cls, cfg: DiskTierConfig, *, name: str = "disk") -> LMDBTier:
        """Build the tier from its config section (``store.disk``); ``cfg.path`` must be set.

        Raises:
            InvalidArgumentError: if ``cfg.path`` is empty (the tier is disabled).
        """
        if not cfg.path:
            raise InvalidArgumentError("store.disk.path is empty: the disk tier is disabled")
        return cls(cfg.path, cfg.capacity_bytes, sync=cfg.sync, name=name)

    # -- accounting ---------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a block of ``nbytes`` takes.

        LMDB keeps a large value in a run of overflow pages whose first page
        starts with a 16-byte header (``ceil((nbytes + 16) / page_bytes)`` pages),
        plus :data:`RECORD_OVERHEAD_BYTES` for its leaf nodes in ``blocks`` and ``meta``.
        """
        pages = -(-(nbytes + _PAGE_HEADER_BYTES) // self.page_bytes)
        return pages * self.page_bytes + RECORD_OVERHEAD_BYTES

    @property
    def used_bytes(self) -> int:
        """Sum of :meth:`footprint` over the blocks held, bytes."""
        return self._used_bytes

    def counters(self) -> dict[str, int]:
        """Event counts since start: ``corrupt_records`` (blocks failing their checksum, junk records), deleted."""
        return {"corrupt_records": self._corrupt_records}

    # -- the Tier protocol --------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a block record (its checksum is checked only by :meth:`get`).

        Raises:
            UnavailableError: if the tier is closed or LMDB fails.
        """
        self._check_open()
        if not keys:
            return []
        return await self._run(self._readers, self._contains_txn, list(keys))

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The verified value of each key, or ``None`` for a miss.

        A value that fails verification is a miss; it is deleted (in a write
        transaction, before this returns) and counted as ``corrupt_records``.

        Raises:
            UnavailableError: if the tier is closed or LMDB fails.
        """
        self._check_open()
        if not keys:
            return []
        values, corrupt = await self._run(self._readers, self._get_txn, list(keys))
        now = time.time()
        for position, (key, value) in enumerate(zip(keys, values)):
            if value is not None:  # the keys of a read are a prefix in order: its head is the most recent
                self._touched[key] = now - position * CHAIN_STEP_S
        if corrupt:
            await self._write(self._drop_corrupt_txn, corrupt)
        return values

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value with its meta in one write transaction.

        Args:
            keys: block keys.
            values: encoded blocks (any bytes-like object), one per key.
            metas: priority and recency, one per key.

        Returns:
            ``True`` for every key.

        Raises:
            InvalidArgumentError: if the three sequences differ in length or a
                priority is outside ``[0, 100]``.
            TierFullError: if the batch would take the tier over ``capacity_bytes``
                or the LMDB map is full; the transaction is aborted and nothing of
                the batch is stored.
            UnavailableError: if the tier is closed or LMDB fails otherwise.
        """
        self._check_open()
        order = put_order(keys, values, metas)
        if not keys:
            return []
        batch = [(keys[i], values[i], metas[i]) for i in order]
        await self._write(self._put_txn, batch)
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key in one write transaction, submitted now (it takes effect for later calls at once);
        missing keys are ignored.

        Raises:
            UnavailableError: if the tier is closed (at the call) or LMDB fails (awaiting it).
        """
        self._check_open()
        if not keys:
            return done()
        for key in keys:
            self._touched.pop(key, None)
        return self._write(self._delete_txn, list(keys))

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta as of the last get; junk records are deleted and counted.

        Junk is a ``meta`` record that does not decode, a block without meta or
        meta without block, or a block whose length differs from its meta.

        Raises:
            UnavailableError: if the tier is closed or LMDB fails.
        """
        self._check_open()
        entries, junk = await self._run(self._readers, self._scan_txn)
        if junk:
            await self._write(self._drop_junk_txn, junk)
        touched = self._touched
        return [
            ResidentEntry(e.key, e.nbytes, BlockMeta(e.meta.priority, e.meta.expires_at, touched[e.key]))
            if e.key in touched and touched[e.key] > e.meta.last_access
            else e
            for e in entries
        ]

    async def close(self) -> None:
        """Flush pending recency updates, sync and close the environment; idempotent.

        Waits for reads and writes in flight.
        """
        if self._closed:
            return
        self._closed = True
        touched, self._touched = self._touched, {}
        try:
            await asyncio.wrap_future(self._writer.submit(self._close_txn, touched))
        finally:
            await asyncio.to_thread(self._shutdown)
            os.close(self._lock_fd)  # releases the directory for the next process
        logger.info("disk tier %s closed", self.name)

    # -- helpers on the loop ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"disk tier {self.name} is closed")

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` in ``pool``; a cancelled caller also cancels the call if it has not started yet
        (``asyncio.wrap_future``), which suits reads."""
        try:
            future = pool.submit(fn, *args)
        except RuntimeError as exc:  # the pool was shut down by close()
            raise UnavailableError(f"disk tier {self.name} is closed") from exc
        return await self._outcome(asyncio.wrap_future(future))

    async def _outcome(self, waited: asyncio.Future[_T], finish: bool = False) -> _T:
        """The result of a call submitted to a worker thread, LMDB errors as :class:`UnavailableError`; with
        ``finish``, a cancelled caller leaves the call to run to its end."""
        try:
            if finish:
                try:
                    return await asyncio.shield(waited)
                except asyncio.CancelledError:
                    waited.add_done_callback(_consume_outcome)  # ends unobserved: no "never retrieved" warning
                    raise
            return await waited
        except TierFullError:
            raise
        except lmdb.Error as exc:
            logger.error("disk tier %s: LMDB error: %s", self.name, exc)
            raise UnavailableError(f"disk tier {self.name}: LMDB error: {exc}") from exc

    def _write(self, fn: Callable[..., _T], *args: Any) -> Awaitable[_T]:
        """Submit ``fn(txn_args..., touched)`` to the writer thread now, with the pending recency updates; returns
        an awaitable of its result.

        Writes run one at a time, in the order they were submitted, and each runs to its end once submitted,
        even if the caller is cancelled (see :meth:`kvstore.tiers.base.Tier.delete`).

        Raises:
            UnavailableError: if the tier is closed.
        """
        touched, self._touched = self._touched, {}
        try:
            future = self._writer.submit(fn, *args, touched)
        except RuntimeError as exc:  # the pool was shut down by close()
            self._touched.update(touched)
            raise UnavailableError(f"disk tier {self.name} is closed") from exc
        return self._written(asyncio.wrap_future(future), touched)

    async def _written(self, waited: asyncio.Future[_T], touched: Mapping[BlockKey, float]) -> _T:
        try:  # runs to its end once submitted: see Tier.delete
            return await self._outcome(waited, finish=True)
        except asyncio.CancelledError:
            raise  # the write goes on, with the recency updates
        except BaseException:
            for key, when in touched.items():  # not written: keep them for the next write
                if self._touched.get(key, 0.0) < when:
                    self._touched[key] = when
            raise

    # -- transactions (worker threads) ----------------------------------------------------

    def _scan_used_bytes(self) -> int:
        used = 0
        with self._env.begin(db=self._meta, buffers=True) as txn:
            for _, raw in txn.cursor():
                parsed = _unpack_meta(raw)
                if parsed is not None:
                    used += self.footprint(parsed[1])
        return used

    def _contains_txn(self, keys: list[BlockKey]) -> list[bool]:
        with self._env.begin(db=self._blocks, buffers=True) as txn:
            return [txn.get(key) is not None for key in keys]

    def _get_txn(self, keys: list[BlockKey]) -> tuple[list[bytes | None], list[BlockKey]]:
        values: list[bytes | None] = []
        corrupt: list[BlockKey] = []
        with self._env.begin(db=self._blocks) as txn:
            for key in keys:
                value = txn.get(key)
                if value is not None:
                    try:
                        verify_block(value)
                    except CodecError as exc:
                        logger.warning("disk tier %s: corrupt block %s: %s", self.name, key.hex(), exc)
                        corrupt.append(key)
                        value = None
                values.append(value)
        return values, corrupt

    def _scan_txn(self) -> tuple[list[ResidentEntry], list[BlockKey]]:
        entries: list[ResidentEntry] = []
        junk: list[BlockKey] = []
        with self._env.begin(buffers=True) as txn:
            for key, raw in txn.cursor(db=self._meta):
                key = BlockKey(bytes(key))
                parsed = _unpack_meta(raw)
                block = txn.get(key, db=self._blocks)
                if parsed is None or block is None or len(block) != parsed[1]:
                    junk.append(key)
                else:
                    entries.append(ResidentEntry(key, parsed[1], parsed[0]))
            for key in txn.cursor(db=self._blocks).iternext(keys=True, values=False):
                if txn.get(key, db=self._meta) is None:
                    junk.append(BlockKey(bytes(key)))
        return entries, junk

    def _is_junk(self, txn: lmdb.Transaction, key: BlockKey) -> bool:
        parsed = _unpack_meta(txn.get(key, db=self._meta))
        block = txn.get(key, db=self._blocks)
        if parsed is None and block is None:
            return False  # gone already
        return parsed is None or block is None or len(block) != parsed[1]

    def _held_nbytes(self, txn: lmdb.Transaction, key: BlockKey) -> int | None:
        """nbytes the accounting counts for ``key``: from its meta record, ``None`` if it has none."""
        parsed = _unpack_meta(txn.get(key, db=self._meta))
        return None if parsed is None else parsed[1]

    def _remove(self, txn: lmdb.Transaction, key: BlockKey) -> int:
        """Delete both records of ``key``; return the change of used bytes (<= 0)."""
        held = self._held_nbytes(txn, key)
        txn.delete(key, db=self._blocks)
        txn.delete(key, db=self._meta)
        return 0 if held is None else -self.footprint(held)

    def _flush_touched(self, txn: lmdb.Transaction, touched: Mapping[BlockKey, float], skip: Any = ()) -> None:
        for key, when in touched.items():
            if key in skip:
                continue
            parsed = _unpack_meta(txn.get(key, db=self._meta))
            if parsed is not None and parsed[0].last_access < when:
                meta, nbytes = parsed
                txn.put(key, _pack_meta(BlockMeta(meta.priority, meta.expires_at, when), nbytes), db=self._meta)

    def _put_txn(self, batch: list[tuple[BlockKey, bytes, BlockMeta]], touched: Mapping[BlockKey, float]) -> None:
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                delta = 0
                for key, value, _ in batch:
                    held = self._held_nbytes(txn, key)
                    delta += self.footprint(memoryview(value).nbytes) - (0 if held is None else self.footprint(held))
                assert self.capacity_bytes is not None
                if delta > 0 and self._used_bytes + delta > self.capacity_bytes:
                    raise TierFullError(
                        f"disk tier {self.name}: batch needs {delta} more bytes, "
                        f"{self.capacity_bytes - self._used_bytes} of {self.capacity_bytes} free"
                    )
                for key, value, meta in batch:
                    txn.put(key, value, db=self._blocks)
                    txn.put(key, _pack_meta(meta, memoryview(value).nbytes), db=self._meta)
                self._flush_touched(txn, touched, skip={key for key, _, _ in batch})
        except lmdb.MapFullError as exc:
            logger.warning("disk tier %s: LMDB map full (%s); batch of %s blocks refused", self.name, exc, len(batch))
            raise TierFullError(f"disk tier {self.name}: LMDB map is full") from exc
        self._used_bytes += delta

    def _delete_txn(self, keys: list[BlockKey], touched: Mapping[BlockKey, float]) -> None:
        with self._env.begin(write=True, buffers=True) as txn:
            delta = sum(self._remove(txn, key) for key in set(keys))
            self._flush_touched(txn, touched, skip=set(keys))
        self._used_bytes += delta

    def _drop_corrupt_txn(self, keys: list[BlockKey], touched: Mapping[BlockKey, float]) -> list[BlockKey]:
        """Delete the records of ``keys`` that are still corrupt; returns their keys."""
        dropped: list[BlockKey] = []
        with self._env.begin(write=True, buffers=True) as txn:
            delta = 0
            for key in set(keys):
                value = txn.get(key, db=self._blocks)
                if value is None:
                    continue
                try:
                    verify_block(value)
                    continue  # replaced by a good block since it was read
                except CodecError:
                    pass
                delta += self._remove(txn, key)
                dropped.append(key)
            self._flush_touched(txn, touched, skip=set(keys))
        self._used_bytes += delta
        self._corrupt_records += len(dropped)
        return dropped

    def _drop_junk_txn(self, keys: list[BlockKey], touched: Mapping[BlockKey, float]) -> None:
        dropped = 0
        with self._env.begin(write=True, buffers=True) as txn:
            delta = 0
            for key in set(keys):
                if self._is_junk(txn, key):
                    logger.warning("disk tier %s: junk record %s deleted", self.name, key.hex())
                    delta += self._remove(txn, key)
                    dropped += 1
            self._flush_touched(txn, touched, skip=set(keys))
        self._used_bytes += delta
        self._corrupt_records += dropped

    def _close_txn(self, touched: Mapping[BlockKey, float]) -> None:
        if not touched:
            return
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                self._flush_touched(txn, touched)
        except lmdb.Error as exc:  # recency is advisory: losing it must not stop the close
            logger.warning("disk tier %s: recency of %s blocks not saved on close: %s", self.name, len(touched), exc)

    def _shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._env.sync(True)
        self._env.close()
