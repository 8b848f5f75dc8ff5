"""The disk tier's transactions: what its worker threads do on the LMDB environment, and the bytes its blocks take.

:class:`BlockTransactions` reads and writes the records of one open
environment (:mod:`kvstore.tiers.lmdb_records`) and keeps the count of
footprint bytes they hold; :class:`kvstore.tiers.lmdb.LMDBTier` runs its
methods in its threads (every write in its one writer thread, reads in its
reader pool) and is the Tier the store sees.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import lmdb

from kvstore.errors import CodecError
from kvstore.keys import BlockKey
from kvstore.policy import DEFAULT_PRIORITY
from kvstore.tiers.base import BlockMeta, TierFullError, touch_meta
from kvstore.tiers.compression import Compressor
from kvstore.tiers.lmdb_records import (
    MAX_KEY_BYTES,
    PAGE_HEADER_BYTES,
    RECORD_ERRORS,
    RECORD_OVERHEAD_BYTES,
    block_of_record,
    pack_meta,
    unpack_meta,
)

logger = logging.getLogger("kvstore.tiers.lmdb")  # the tier's log lines, under the tier's logger as before


class BlockTransactions:
    """The block and meta records of one open LMDB environment, in transactions, and the footprint bytes they hold.

    Every method but :meth:`footprint` runs an LMDB transaction, so it runs in a
    worker thread of the tier: those that write in its one writer thread, one at
    a time, each given the tier's pending recency updates (``touched``: key ->
    time of its last get) to save with it.

    Args:
        env: the open environment.
        blocks_db, meta_db: its ``blocks`` and ``meta`` trees.
        name: the tier's name, for log lines and errors.
        capacity_bytes: footprint bytes the blocks may take.
        compressor: what a put packs each block with (``kvstore.tiers.compression``).

    Attributes:
        page_bytes: the environment's page size, bytes.
        used_bytes: sum of :meth:`footprint` over the blocks held (read from the ``meta`` records at open).
        corrupt_records: records deleted for failing their checks, and junk records.
        repaired_records: blocks given a new meta record at the default priority.
    """

    def __init__(self, env: lmdb.Environment, blocks_db: Any, meta_db: Any, *, name: str, capacity_bytes: int,
                 compressor: Compressor) -> None:
        self.env = env
        self._blocks = blocks_db
        self._meta = meta_db
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._compressor = compressor
        self.page_bytes: int = env.stat()["psize"]
        self.corrupt_records = 0
        self.repaired_records = 0
        self.used_bytes = self._scan_used_bytes()

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a block of ``nbytes`` takes (:meth:`kvstore.tiers.lmdb.LMDBTier.footprint`)."""
        pages = -(-(nbytes + MAX_KEY_BYTES + PAGE_HEADER_BYTES) // self.page_bytes)
        return pages * self.page_bytes + RECORD_OVERHEAD_BYTES

    def _scan_used_bytes(self) -> int:
        """The footprint bytes the ``meta`` records count."""
        used = 0
        with self.env.begin(db=self._meta, buffers=True) as txn:
            for _, raw in txn.cursor():
                parsed = unpack_meta(raw)
                if parsed is not None:
                    used += self.footprint(parsed[1])
        return used

    def contains(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each key has a block record; one LMDB cannot read has none."""
        try:
            with self.env.begin(db=self._blocks, buffers=True) as txn:
                return [txn.get(key) is not None for key in keys]
        except RECORD_ERRORS:
            pass
        found = []
        for key in keys:  # a damaged page on the way to one of them: each alone
            try:
                with self.env.begin(db=self._blocks, buffers=True) as txn:
                    found.append(txn.get(key) is not None)
            except RECORD_ERRORS:
                found.append(False)
        return found

    def get(self, keys: list[BlockKey], set_aside: set[BlockKey]
                 ) -> tuple[list[bytes | None], list[BlockKey], list[BlockKey]]:
        """The checked block of each key (``None`` for a miss); the keys of corrupt records; of unreadable ones."""
        corrupt: list[BlockKey] = []
        try:
            with self.env.begin(db=self._blocks, buffers=True) as txn:
                return [None if key in set_aside else self._read(txn, key, corrupt) for key in keys], corrupt, []
        except RECORD_ERRORS as exc:  # a damaged page on the way to some record: read each alone
            logger.warning("disk tier %s: a read of %s blocks failed (%s); reading each alone", self.name, len(keys), exc)
        values: list[bytes | None] = []
        corrupt, unreadable = [], []
        for key in keys:
            if key in set_aside:
                values.append(None)
                continue
            try:
                with self.env.begin(db=self._blocks, buffers=True) as txn:
                    values.append(self._read(txn, key, corrupt))
            except RECORD_ERRORS as exc:
                logger.warning("disk tier %s: block %s cannot be read: %s", self.name, key.hex(), exc)
                unreadable.append(key)
                values.append(None)
        return values, corrupt, unreadable

    def _read(self, txn: lmdb.Transaction, key: BlockKey, corrupt: list[BlockKey]) -> bytes | None:
        """One key's checked block, copied out of the map; a record that fails its check is added to ``corrupt``."""
        record = txn.get(key)
        if record is None:
            return None
        try:
            return block_of_record(key, record)
        except CodecError as exc:
            logger.warning("disk tier %s: corrupt block %s: %s", self.name, key.hex(), exc)
            corrupt.append(key)
            return None

    def repair(self, junk: list[BlockKey], repairs: list[tuple[BlockKey, int]],
                    touched: Mapping[BlockKey, float]) -> None:
        """Delete ``junk`` records, and give each block of ``repairs`` a new meta record at the default priority."""
        unique = list(dict.fromkeys(junk))
        keys = unique + [key for key, _ in repairs]
        dropped: list[BlockKey] = []

        def fix_one(txn: lmdb.Transaction, i: int) -> int:
            if i < len(unique):
                key = unique[i]
                logger.warning("disk tier %s: junk record %s deleted", self.name, key.hex())
                dropped.append(key)
                return self._remove(txn, key)
            key, nbytes = repairs[i - len(unique)]
            held = self._held_nbytes(txn, key)
            txn.put(key, pack_meta(BlockMeta(DEFAULT_PRIORITY, 0.0, 0.0), nbytes), db=self._meta)
            return self.footprint(nbytes) - (0 if held is None else self.footprint(held))

        failed = set(self._transact(keys, fix_one, touched))
        self.corrupt_records += len(set(dropped) - failed)
        self.repaired_records += len({key for key, _ in repairs} - failed)
        if repairs:
            logger.warning("disk tier %s: %s blocks had lost their meta record; kept at the default priority",
                           self.name, len(repairs))

    def _held_nbytes(self, txn: lmdb.Transaction, key: BlockKey) -> int | None:
        """nbytes the accounting counts for ``key``: from its meta record, ``None`` if it has none."""
        parsed = unpack_meta(txn.get(key, db=self._meta))
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
            parsed = unpack_meta(txn.get(key, db=self._meta))
            if parsed is not None and parsed[0].last_access < when:
                meta, nbytes = parsed
                txn.put(key, pack_meta(touch_meta(meta, when), nbytes), db=self._meta)

    def _transact(self, keys: list[BlockKey], apply: Callable[[lmdb.Transaction, int], int],
                  touched: Mapping[BlockKey, float]) -> list[BlockKey]:
        """Run ``apply(txn, i)`` for every key (it returns the change of used bytes) in one write transaction that
        also saves the pending recency updates; returns the keys that could not be written.

        That is none, unless a damaged page stops the transaction (``MDB_CORRUPTED``
        and the like, from a file changed while the node runs): then each key is
        written in a transaction of its own, and those that fail are returned.

        Raises:
            TierFullError: raised by ``apply`` in the one transaction (nothing is written).
            lmdb.Error: any other LMDB failure.
        """
        try:
            with self.env.begin(write=True, buffers=True) as txn:
                delta = sum(apply(txn, i) for i in range(len(keys)))
                self._flush_touched(txn, touched, skip=set(keys))
        except RECORD_ERRORS as exc:
            logger.warning("disk tier %s: a write of %s blocks failed (%s); writing each alone", self.name, len(keys), exc)
        else:
            self.used_bytes += delta
            return []
        failed: list[BlockKey] = []
        for i, key in enumerate(keys):
            try:
                with self.env.begin(write=True, buffers=True) as txn:
                    delta = apply(txn, i)
            except (*RECORD_ERRORS, TierFullError, lmdb.MapFullError) as exc:
                logger.warning("disk tier %s: block %s cannot be written: %s", self.name, key.hex(), exc)
                failed.append(key)
            else:
                self.used_bytes += delta
        for key, when in touched.items():  # recency is advisory: what cannot be saved is dropped
            try:
                with self.env.begin(write=True, buffers=True) as txn:
                    self._flush_touched(txn, {key: when})
            except RECORD_ERRORS:
                pass
        return failed

    def put(self, batch: list[tuple[BlockKey, bytes, BlockMeta]], touched: Mapping[BlockKey, float]
                 ) -> list[BlockKey]:
        """Write a put batch; returns the keys a damaged page kept from being written (see :meth:`_transact`)."""
        capacity = self.capacity_bytes
        pending = [0]  # footprint bytes the transaction adds so far

        def put_one(txn: lmdb.Transaction, i: int) -> int:
            key, value, meta = batch[i]
            value = self._compressor.pack(value)
            nbytes = memoryview(value).nbytes
            held = self._held_nbytes(txn, key)
            delta = self.footprint(nbytes) - (0 if held is None else self.footprint(held))
            if delta > 0 and self.used_bytes + pending[0] + delta > capacity:
                raise TierFullError(f"disk tier {self.name}: {delta} more bytes needed, "
                                    f"{capacity - self.used_bytes - pending[0]} of {capacity} free")
            pending[0] += delta
            txn.put(key, b"".join((value, key)), db=self._blocks)  # the block, then its key (module docstring)
            txn.put(key, pack_meta(meta, nbytes), db=self._meta)
            return delta

        try:
            return self._transact([key for key, _, _ in batch], put_one, touched)
        except lmdb.MapFullError as exc:
            logger.warning("disk tier %s: LMDB map full (%s); batch of %s blocks refused", self.name, exc, len(batch))
            raise TierFullError(f"disk tier {self.name}: LMDB map is full") from exc
        finally:
            pending[0] = 0

    def delete(self, keys: list[BlockKey], touched: Mapping[BlockKey, float]) -> list[BlockKey]:
        """Delete both records of each key; returns the keys a damaged page kept from being deleted."""
        unique = list(dict.fromkeys(keys))
        return self._transact(unique, lambda txn, i: self._remove(txn, unique[i]), touched)

    def drop_corrupt(self, keys: list[BlockKey], touched: Mapping[BlockKey, float]
                          ) -> tuple[list[BlockKey], list[BlockKey]]:
        """Delete the records of ``keys`` that are still corrupt; returns their keys, and those LMDB could not delete."""
        unique = list(dict.fromkeys(keys))
        dropped: list[BlockKey] = []

        def drop_one(txn: lmdb.Transaction, i: int) -> int:
            key = unique[i]
            record = txn.get(key, db=self._blocks)
            if record is None:
                return 0
            try:
                block_of_record(key, record)
                return 0  # replaced by a good block since it was read
            except CodecError:
                pass
            dropped.append(key)
            return self._remove(txn, key)

        failed = self._transact(unique, drop_one, touched)
        dropped = [key for key in dict.fromkeys(dropped) if key not in failed]
        self.corrupt_records += len(dropped) + len(failed)
        return dropped, failed

    def flush(self, touched: Mapping[BlockKey, float]) -> None:
        """Save the pending recency updates (at close); a failure is logged, not raised (recency is advisory)."""
        if not touched:
            return
        try:
            with self.env.begin(write=True, buffers=True) as txn:
                self._flush_touched(txn, touched)
        except lmdb.Error as exc:  # recency is advisory: losing it must not stop the close
            logger.warning("disk tier %s: recency of %s blocks not saved on close: %s", self.name, len(touched), exc)

    def set_pins(self, keys: list[BlockKey], pins: list[tuple[float, float]],
                 touched: Mapping[BlockKey, float]) -> None:
        """Set the ``(ttl_s, pinned_until)`` of each key held in its meta record; a key not held is skipped."""
        def set_one(txn: lmdb.Transaction, i: int) -> int:
            parsed = unpack_meta(txn.get(keys[i], db=self._meta))
            if parsed is not None:
                meta, nbytes = parsed
                ttl_s, until = pins[i]
                last = max(meta.last_access, touched.get(keys[i], 0.0))
                txn.put(keys[i], pack_meta(BlockMeta(meta.priority, meta.expires_at, last, ttl_s, until), nbytes),
                        db=self._meta)
            return 0

        self._transact(keys, set_one, touched)
