"""The disk tier: encoded blocks in an LMDB environment that survives restarts with their priority and recency.

The environment's layout and records (disk format :data:`DISK_FORMAT`): :mod:`kvstore.tiers.lmdb_records`; the
transactions that read and write them, and the count of bytes held: :mod:`kvstore.tiers.lmdb_txns`. This module is
the Tier the store sees: its threads, its pending recency updates, and the records it stops serving.

Every LMDB call runs off the event loop: writes in one dedicated writer thread
(one write transaction per put or delete batch, so writers never wait on
LMDB's writer lock), reads in a small reader pool. Gets do not write: the
keys they hit are remembered in memory with the time and their new
``last_access`` goes into the next write transaction, or into the last one on
:meth:`LMDBTier.close`. A process that dies without closing loses only those
recency updates, never a block.

Integrity (``docs/disk.md``). LMDB keeps no checksums and trusts every byte it
maps, so the tier protects itself in three places:

* at open, before LMDB maps the file, ``data.mdb`` is checked page by page
  without a map (:func:`kvstore.tiers.lmdb_file.check_data_file`). A file that
  fails (a flipped byte in a tree page, a truncated file, a zeroed meta page)
  is moved aside into ``quarantine/`` with an ERROR log line naming it and the
  reason, and the blocks that can still be read and verified are copied into a
  fresh file (:mod:`kvstore.tiers.lmdb_repair`, from the newest snapshot whose
  meta page is valid); the tier opens that, so the node always starts. A file
  of disk format 1 (codec version 1 blocks, no key binding) is dropped, logged;
* on every read, a record must end with its key and its block must pass
  :func:`kvstore.blocks.format.verify_block` (the checksum covers header and payload);
  one that fails is a miss, is deleted and is counted as ``corrupt_records``;
* a record LMDB cannot read or delete (``MDB_CORRUPTED`` and the like, from a
  file changed while the node runs) is a miss for that record alone, is counted
  as ``unreadable_records`` and is not served again until a restart checks the file.

Every record the tier stops serving on its own is a miss of the get that
found it, and the store forgets a block its get missed.
:meth:`LMDBTier.resident` checks structure only (meta decodes, block present
with the recorded length), not checksums, so that a restart does not read the
whole database.

Capacity. ``disk.capacity_bytes`` is LMDB's map size, which bounds ``data.mdb``:
the file never grows past it. Blocks fill :func:`usable_bytes` of it (their
:meth:`LMDBTier.footprint`; :data:`DISK_FILL_FRACTION` of a large map); the rest
is LMDB's own: branch pages, pages freed by the last two write transactions,
which LMDB reuses only after them, and runs of free pages too short for a new value. When LMDB runs out of map all the same,
a put raises :class:`~kvstore.tiers.base.TierFullError` and the store evicts
more. A damaged file moved to ``quarantine/`` is extra: one at most, kept only
while the filesystem still has room for the new file to reach its bound.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar

import lmdb

from kvstore.tiers.compression import Codec, Compressor, pack_all
from kvstore.config import DiskTierConfig
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import BlockKey
from kvstore.policy import DEFAULT_PRIORITY
from kvstore.tiers.base import CHAIN_STEP_S, BlockMeta, ResidentEntry, TierFullError, done, put_order, touch_meta
# the public names are re-exported: kvstore.tiers.lmdb is their old home
from kvstore.tiers.lmdb_records import (
    DISK_FILL_FRACTION,
    DISK_FORMAT,
    MAX_KEY_BYTES,
    MIN_FREE_BYTES,
    MIN_MAP_BYTES,
    PAGE_HEADER_BYTES,
    RECORD_ERRORS,
    RECORD_OVERHEAD_BYTES,
    default_map_size_bytes,
    lock_directory,
    prepare_directory,
    scan_records,
    usable_bytes,
)
from kvstore.tiers.lmdb_repair import check_and_repair, drop_other_format, repair
from kvstore.tiers.lmdb_txns import BlockTransactions

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _consume_outcome(future: asyncio.Future[Any]) -> None:
    """Observe the outcome of a write whose caller was cancelled; an LMDB failure is still logged."""
    if not future.cancelled() and isinstance(future.exception(), lmdb.Error):
        logger.error("LMDB write failed after its caller was cancelled: %s", future.exception())


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

    A record a get finds corrupt is deleted, and one LMDB cannot read or delete
    is set aside until the next restart; either is a miss, which the store
    forgets.

    Args:
        path: directory of the environment; created if missing. Its ``data.mdb``
            is checked, and repaired when damaged, before LMDB opens it (module docstring).
        capacity_bytes: bytes of :meth:`footprint` the tier may hold.
        sync: fsync data and meta pages at every commit (``lmdb.open(sync=, metasync=)``);
            without it a commit survives a process crash but not an OS crash.
        name: tier name in stats and metrics.
        map_size_bytes: LMDB map size, bytes: the most ``data.mdb`` grows to;
            :func:`default_map_size_bytes` of the capacity when ``None``. A file
            already larger keeps its size (LMDB never shrinks one).
        num_reader_threads: threads that run read transactions.
        compressor: compresses the blocks stored (``kvstore.tiers.compression``); none by default.
        clock: the time of a get, wall-clock seconds: a block's recency, and its TTL's renewal, as a restart
            finds them (the store's clock; ``time.time`` by default).

    Raises:
        InvalidArgumentError: on a negative capacity.
        UnavailableError: if the environment cannot be opened (a full filesystem,
            another process on the directory).
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
        compressor: Compressor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._compressor = compressor or Compressor()  # blocks stored compressed (kvstore.tiers.compression)
        self._clock = clock  # a get's time: the block's recency, and its TTL's renewal, across a restart
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self._capacity = capacity_bytes
        self.path = os.fspath(path)
        self.sync = sync
        self.map_size_bytes = default_map_size_bytes(capacity_bytes) if map_size_bytes is None else map_size_bytes
        self._num_reader_threads = num_reader_threads
        prepare_directory(self.path, self.map_size_bytes)  # the bound of data.mdb: the setting, page-rounded
        free_bytes = shutil.disk_usage(self.path).free
        if free_bytes < MIN_FREE_BYTES:  # LMDB maps its files: growing one on a full disk is a SIGBUS, not an error
            raise UnavailableError(f"cannot open LMDB environment at {self.path}: {free_bytes} bytes free on its "
                                   f"filesystem, fewer than {MIN_FREE_BYTES}")
        self._lock_fd = lock_directory(self.path)
        self._unreadable_records = 0
        self._set_aside: set[BlockKey] = set()  # records LMDB could not read or delete: not served until a restart
        try:
            self._prepare_file()
            try:
                self._open_environment()
            except RECORD_ERRORS as exc:  # the file passed the check, and LMDB refuses it all the same
                if hasattr(self, "_env"):
                    self._env.close()
                self._repair([f"LMDB refused to open it: {exc}"])
                self._open_environment()
        except (lmdb.Error, OSError, UnavailableError) as exc:
            if hasattr(self, "_env"):
                self._env.close()
            os.close(self._lock_fd)
            if isinstance(exc, UnavailableError):
                raise
            raise UnavailableError(f"cannot open LMDB environment at {self.path}: {exc}") from exc
        self._touched: dict[BlockKey, float] = {}  # keys hit by gets since the last write txn -> time
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"lmdb-{name}-w")
        self._readers = ThreadPoolExecutor(num_reader_threads, thread_name_prefix=f"lmdb-{name}-r")
        self._closed = False
        logger.info(
            "disk tier %s at %s: map %s bytes, %s of %s bytes used",
            name, self.path, self._env.info()["map_size"], self.used_bytes, capacity_bytes,
        )

    @classmethod
    def from_config(cls, cfg: DiskTierConfig, *, name: str = "disk") -> LMDBTier:
        """Build the tier from its config section (``store.disk``); ``cfg.path`` must be set.

        ``cfg.capacity_bytes`` is the map size, the bound of ``data.mdb``; blocks
        take :func:`usable_bytes` of it (:attr:`capacity_bytes`).

        Raises:
            InvalidArgumentError: if ``cfg.path`` is empty (the tier is disabled).
        """
        if not cfg.path:
            raise InvalidArgumentError("store.disk.path is empty: the disk tier is disabled")
        map_size = max(MIN_MAP_BYTES, cfg.capacity_bytes // mmap.PAGESIZE * mmap.PAGESIZE)
        return cls(cfg.path, usable_bytes(map_size), sync=cfg.sync, name=name, map_size_bytes=map_size,
                   compressor=Compressor(Codec(cfg.compression)))

    # -- opening ------------------------------------------------------------------

    @property
    def _data_file(self) -> str:
        return os.path.join(self.path, "data.mdb")

    def _open_environment(self) -> None:
        """Open the environment and its trees, drop one of another disk format, and count the bytes held."""
        self._env = lmdb.open(
            self.path, map_size=self.map_size_bytes, max_dbs=3, sync=self.sync, metasync=self.sync,
            max_readers=126 + self._num_reader_threads,
        )
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._info = self._env.open_db(b"info")
        self._check_format()
        self._txns = BlockTransactions(self._env, self._blocks, self._meta, name=self.name,
                                       capacity_bytes=self._capacity, compressor=self._compressor)
        self.page_bytes = self._txns.page_bytes

    def _prepare_file(self) -> None:
        """Check ``data.mdb`` before LMDB maps it; repair a damaged one (:func:`~kvstore.tiers.lmdb_repair.check_and_repair`)."""
        check_and_repair(self.path, self.map_size_bytes, self.name)

    def _repair(self, problems: list[str]) -> None:
        """Quarantine a damaged ``data.mdb`` and salvage it (:func:`~kvstore.tiers.lmdb_repair.repair`)."""
        repair(self.path, self.map_size_bytes, self.name, problems)

    def _check_format(self) -> None:
        """Drop an environment of another disk format (:func:`~kvstore.tiers.lmdb_repair.drop_other_format`), and
        mark a new one with :data:`DISK_FORMAT`."""
        if drop_other_format(self._env, self._blocks, self._meta, self._info, self.path, self.name):
            self._open_environment()  # a new file: marked with this format there, and never dropped again

    # -- accounting ---------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a block of ``nbytes`` takes.

        LMDB keeps a large value in a run of overflow pages whose first page
        starts with a 16-byte header; the record is the block and its key (up
        to :data:`MAX_KEY_BYTES`), so it takes
        ``ceil((nbytes + 40 + 16) / page_bytes)`` pages, plus
        :data:`RECORD_OVERHEAD_BYTES` for its leaf nodes in ``blocks`` and ``meta``.
        """
        return self._txns.footprint(nbytes)

    @property
    def used_bytes(self) -> int:
        """Sum of :meth:`footprint` over the blocks held, bytes."""
        return self._txns.used_bytes

    def counters(self) -> dict[str, int]:
        """Event counts since start.

        Keys: ``corrupt_records`` (records that failed their key or checksum
        check, and junk records, deleted), ``unreadable_records`` (records
        LMDB could not read or delete, set aside until a restart checks the
        file) and ``repaired_records`` (blocks whose meta record was lost, kept
        at the default priority; :meth:`resident`).
        """
        return {"corrupt_records": self._txns.corrupt_records, "unreadable_records": self._unreadable_records,
                "repaired_records": self._txns.repaired_records}

    async def pack_values(self, values: Sequence[bytes]) -> Sequence[bytes]:
        """The values as :meth:`put` stores them: compressed frames where the tier compresses and that saves
        (``kvstore.tiers.compression``), else ``values``; what the store counts against the capacity."""
        return await pack_all(self._compressor, values)

    # -- the Tier protocol --------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a block record (its checksum is checked only by :meth:`get`).

        A record LMDB cannot read is not contained.

        Raises:
            UnavailableError: if the tier is closed or LMDB fails.
        """
        self._check_open()
        if not keys:
            return []
        found = await self._run(self._readers, self._txns.contains, list(keys))
        return [hit and key not in self._set_aside for key, hit in zip(keys, found)]

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The verified value of each key, or ``None`` for a miss.

        A record that fails its check is a miss; it is deleted (in a write
        transaction, before this returns) and counted as ``corrupt_records``. A
        record LMDB cannot read (or then delete) is a miss as well, counted as
        ``unreadable_records`` and set aside until a restart checks the file;
        the rest of the batch is read all the same.

        Raises:
            UnavailableError: if the tier is closed or LMDB fails other than on a record.
        """
        self._check_open()
        if not keys:
            return []
        values, corrupt, unreadable = await self._run(self._readers, self._txns.get, list(keys), self._set_aside.copy())
        now = self._clock()
        for position, (key, value) in enumerate(zip(keys, values)):
            if value is not None:  # the keys of a read are a prefix in order: its head is the most recent
                self._touched[key] = now - position * CHAIN_STEP_S
        if unreadable:
            self._set_apart(unreadable)
        if corrupt:
            await self._write(self._txns.drop_corrupt, corrupt, on_success=self._deleted)
        return values

    def _set_apart(self, keys: Iterable[BlockKey], *, count: bool = True) -> None:
        """Stop serving records LMDB cannot read or delete (until a restart checks the file), and count them."""
        fresh = [key for key in keys if key not in self._set_aside]
        self._set_aside.update(fresh)
        if count:
            self._unreadable_records += len(fresh)

    def _deleted(self, outcome: tuple[list[BlockKey], list[BlockKey]]) -> None:
        """What a drop of corrupt records did: set aside those LMDB could not delete."""
        _dropped, failed = outcome
        self._set_apart(failed, count=False)  # counted as corrupt_records

    def _delete_failed(self, failed: list[BlockKey]) -> None:
        """What a delete did: set aside the records LMDB could not delete."""
        self._set_apart(failed)

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value with its meta in one write transaction.

        Args:
            keys: block keys.
            values: encoded blocks (any bytes-like object), one per key.
            metas: priority and recency, one per key.

        Returns:
            ``True`` for every key stored: all of them, unless a page LMDB needs for
            a key is damaged (a file changed while the node runs), when each key
            is written alone and ``False`` marks those that could not be.

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
        failed = await self._write(self._txns.put, batch)
        self._set_aside.difference_update(key for key, _, _ in batch if key not in failed)
        self._set_apart(failed)
        return [key not in failed for key in keys]

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key in one write transaction, submitted now (it takes effect for later calls at once);
        missing keys are ignored.

        A record LMDB cannot delete is set aside (not served) until a restart checks the file.

        Raises:
            UnavailableError: if the tier is closed (at the call) or LMDB fails other than on a record (awaiting it).
        """
        self._check_open()
        if not keys:
            return done()
        for key in keys:
            self._touched.pop(key, None)
        return self._write(self._txns.delete, list(keys), on_success=self._delete_failed)

    async def set_pins(self, keys: Sequence[BlockKey], pins: Sequence[tuple[float, float]]) -> None:
        """Record the TTL of blocks this tier holds, ``(ttl_s, pinned_until)`` each, in their meta records: a TTL
        given to (or renewed on) a block after it was written here is what a restart restores
        (``kvstore.store.lifecycle.shut_down``). A key not held is skipped.

        Raises:
            UnavailableError: if the tier is closed or LMDB fails other than on a record.
        """
        self._check_open()
        if keys:
            await self._write(self._txns.set_pins, list(keys), list(pins))

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta as of the last get; records that do not pair up are repaired or dropped.

        A block record (ending with its key) whose ``meta`` record is missing,
        does not decode or gives another length gets a new one, at the default
        priority (its checksum is checked on its first get, as always): losing
        a meta record costs a block only its priority and recency, and is counted
        as ``repaired_records``. Anything else that does not pair up is junk,
        deleted and counted as ``corrupt_records``: a meta record without its
        block, or a block record that does not end with its key. With
        compression on, each entry also says the length of the block a frame
        holds (``block_nbytes``, from the frame's header).

        Raises:
            UnavailableError: if the tier is closed or LMDB fails.
        """
        self._check_open()
        entries, junk, repairs = await self._run(self._readers, scan_records, self._env, self._blocks, self._meta,
                                                 self._compressor.enabled)
        if junk or repairs:
            await self._write(self._txns.repair, junk, repairs)
            entries += [ResidentEntry(key, nbytes, BlockMeta(DEFAULT_PRIORITY, 0.0, 0.0)) for key, nbytes in repairs]
        touched, set_aside = self._touched, self._set_aside
        return [
            ResidentEntry(e.key, e.nbytes, touch_meta(e.meta, touched[e.key]), e.block_nbytes)
            if e.key in touched and touched[e.key] > e.meta.last_access
            else e
            for e in entries if e.key not in set_aside
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
            await asyncio.wrap_future(self._writer.submit(self._txns.flush, touched))
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

    def _write(self, fn: Callable[..., _T], *args: Any, on_success: Callable[[_T], None] | None = None
               ) -> Awaitable[_T]:
        """Submit ``fn(txn_args..., touched)`` to the writer thread now, with the pending recency updates; returns
        an awaitable of its result. ``on_success`` gets that result, on the event loop, whether or not the caller
        is still there.

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
        waited = asyncio.wrap_future(future)
        if on_success is not None:
            waited.add_done_callback(
                lambda ended: ended.cancelled() or ended.exception() is not None or on_success(ended.result()))
        return self._written(waited, touched)

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

    def _shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._env.sync(True)
        self._env.close()
