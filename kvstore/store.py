"""The tiered store: the API over the index (``kvstore.index``) and the mover (``kvstore.mover``).

Tiers are ordered fastest first. Each bounded local tier (memory, disk) has an
eviction policy in the index, and a block lives in exactly one local tier (tiers
are exclusive, so capacity is not spent twice). An optional shared tier (Redis)
sits below them: it is not indexed, because other nodes write to it too, so
lookups and gets ask it for what the local tiers miss.

Every operation is prepare -> I/O -> complete:

* **prepare** (synchronous) validates, reserves room and claims victims, makes
  placing entries and takes references on the blocks it reads;
* **I/O** (awaited) moves bytes, and never touches the index; once prepared, it
  runs to its end even if its caller is cancelled, so a batch is never half-indexed;
* **complete** (synchronous) publishes what is still current (a delete or clear
  removes entries at once, so a copy still in flight loses here) and gives back
  the references.

A put writes into the first tier its blocks fit, after the mover has moved that
tier's victims out; a get reads its prefix under references and offers its
lower-tier hits to the mover for promotion; write-through copies into the shared
tier go through the mover's queue as well. All of this runs on one asyncio loop,
which owns the index, so nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.codec import check_one_shape, decode_header
from kvstore.config import StoreConfig
from kvstore.continuations import Continuations
from kvstore.errors import CodecError, ResourceExhaustedError, UnavailableError
from kvstore.index import Entry, Index, State
from kvstore.keys import BlockHash, BlockKey, Namespace, block_keys
from kvstore.counts import TierCounts
from kvstore.mover import Mover
from kvstore.placement import Placement
from kvstore.reads import BlockRead, ReadPath
from kvstore.policy import make_policy
from kvstore.validation import check_block, check_counts, check_priority, check_retention_s, namespace_mismatch
from kvstore.tiers.base import (
    BlockMeta,
    Buffer,
    LeasingTier,
    SharedTier,
    Tier,
    check_at_start,
    tier_status,
)

if TYPE_CHECKING:
    from kvstore.events.log import StoreObserver

logger = logging.getLogger(__name__)


class TieredStore:
    """KV blocks under chained prefix hashes, across ordered tiers. Use from one asyncio loop.

    Args:
        tiers: bounded local tiers, fastest first (e.g. memory, then disk).
        config: store settings (promotion, demotion floor, size limit, default priority).
        shared: an optional shared tier below the local ones (Redis), with
            ``config.redis.mode`` deciding write-back or write-through.
        clock: wall clock in seconds, for retention; ``time.time`` by default.
        events: told of every block that enters or leaves a local tier (``kvstore.events.EventLog``); none by default.

    Raises:
        ValueError: if no tier is given or a local tier is unbounded.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        *,
        shared: SharedTier | None = None,
        clock: Callable[[], float] = time.time,
        events: StoreObserver | None = None,
    ) -> None:
        if not tiers and shared is None:
            raise ValueError("a store needs at least one tier")
        for tier in tiers:
            if tier.capacity_bytes is None:
                raise ValueError(f"local tier {tier.name!r} must be bounded; pass it as shared=")
        self.config = config or StoreConfig()
        self._tiers = list(tiers)
        self._shared = shared
        self._lenders = [tier if isinstance(tier, LeasingTier) else None for tier in self._tiers]
        self._tier_names = tuple(t.name for t in self._tiers) + ((shared.name,) if shared is not None else ())
        self._write_through = shared is not None and self.config.redis.mode == "write_through"
        self._clock = clock
        policies = [make_policy(self.config.policy, default_priority=self.config.default_priority,
                                capacity_bytes=tier.capacity_bytes or 0, demotes=level + 1 < len(self._tiers))
                    for level, tier in enumerate(self._tiers)]
        self.index = Index(policies,
                           [tier.capacity_bytes or 0 for tier in self._tiers], clock,
                           [_held_bytes(lender) for lender in self._lenders])
        if events is not None:
            events.bind(tuple(t.name for t in self._tiers))
            self.index.observer = events
        self._counts = [TierCounts() for _ in self._tier_names]
        self._mover = Mover(self.index, self._tiers, shared, self._counts,
                            demote_min_priority=self.config.demote_min_priority,
                            write_back=shared is not None and not self._write_through,
                            default_priority=self.config.default_priority, clock=clock)
        self._placement = Placement(self.index, self._tiers, shared, self._mover, self._write_through)
        self._reads = ReadPath(self.index, self._tiers, shared, self._mover, self._counts, self.config, self._fits,
                               self._check_open, lambda: self._closed)
        self._continuations: Continuations[BlockKey] = Continuations()  # lookups' prefixes, by a put's start
        self._lookup_hit_blocks = 0
        self._lookup_miss_blocks = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Rebuild the index from what persistent tiers hold (e.g. LMDB after a restart), and start the mover.

        Entries are inserted oldest access first, so the eviction order survives
        the restart. A block held by two tiers (a crash mid-move) stays in the upper one.
        """
        index = self.index
        for level, tier in enumerate(self._tiers):
            entries = await tier.resident()
            entries.sort(key=lambda e: e.meta.last_access)
            stale = []
            for found in entries:
                if index.level_of(found.key) is not None:
                    stale.append(found.key)
                    continue
                entry = index.place(found.key, found.meta.priority, found.meta.expires_at)
                index.charge([entry], level, [tier.footprint(found.nbytes)])
                index.publish(entry)
            if stale:
                await tier.delete(stale)
            if entries:
                policy = index.policies[level]
                logger.info("tier %s: restored %d blocks (%d bytes)", tier.name, len(policy), policy.nbytes)
        await self._learn_logical_sizes()
        await check_at_start(self._shared)  # a shared tier that is down at start is named in a warning now
        self._mover.start()

    async def _learn_logical_sizes(self) -> None:
        """Read one restored block of each namespace, for its logical bytes per block (``kvstore.logical``)."""
        for level, key in self.index.logical.unknown():
            try:
                [block] = await self._tiers[level].get([key])
            except Exception as exc:  # noqa: BLE001 - stats only: the blocks count their stored bytes meanwhile
                logger.warning("tier %s: could not read a block for its logical size: %s", self._tiers[level].name, exc)
                continue
            if block is not None:
                self.index.logical.learn([key], [block])

    async def close(self) -> None:
        """Stop taking calls, finish the work in flight, demote volatile tiers, and close every tier.

        Blocks in a volatile tier (memory) above a persistent one (LMDB) are
        copied on close straight into the persistent tier, so a restart on the
        same disk path serves them, those still being read included (a Get
        stream that outlived the server's grace period may still hold its
        prefix). Blocks below ``demote_min_priority`` go only into the room left
        free there, so they push nothing out.
        """
        if self._closed:
            return
        self._closed = True
        await self._mover.drain()  # puts in flight (a cancelled put's too) publish before memory is copied down
        for level, tier in enumerate(self._tiers[:-1]):
            persistent = next((i for i in range(level + 1, len(self._tiers)) if self._tiers[i].persistent), None)
            if not tier.persistent and persistent is not None:
                try:
                    await self._mover.flush(level, persistent)
                except Exception:
                    logger.exception("demoting tier %s on close failed", tier.name)
        await self._mover.close()
        for tier in [*self._tiers, *([self._shared] if self._shared else [])]:
            try:
                await tier.close()
            except Exception:  # close the others all the same
                logger.exception("closing tier %s failed", tier.name)

    async def __aenter__(self) -> TieredStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until the operations in flight and the mover's background copies have finished (tests, shutdown)."""
        await self._mover.drain()

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Names of the tiers, fastest first, the shared tier last."""
        return self._tier_names

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The local tiers, fastest first, then the shared tier if there is one."""
        return (*self._tiers, *((self._shared,) if self._shared is not None else ()))

    # ------------------------------------------------------------------ lookup

    async def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks.

        Lookup does not change recency; a following :meth:`get` does.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        return LookupResult.from_block_tiers(await self.locate(namespace, block_hashes), self._tier_names)

    async def locate(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> bytes:
        """:meth:`lookup` in its compact form: the tier of each block of the longest cached prefix, as a byte.

        Returns:
            One byte per block of the prefix (``len`` is the prefix length, blocks):
            the index of its tier in :attr:`tier_names`. The service sends it as
            is (``LookupResponse.block_tiers``).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        located = self.index.locate(keys)
        if self._shared is not None and len(located) < len(keys):
            rest = keys[len(located):]  # past the local prefix a block may be in Redis and the next one local again
            shared, tail = len(self._tiers), bytearray()
            for level, in_shared in zip(self.index.levels_of(rest), await self._shared.contains(rest)):
                if level is None and not in_shared:
                    break
                tail.append(shared if level is None else level)  # a local copy is the faster one
            located += bytes(tail)
        self._lookup_hit_blocks += len(located)
        self._lookup_miss_blocks += len(keys) - len(located)
        if 0 < len(located) < len(keys):  # the put of the rest protects this prefix (``put``)
            self._continuations.record(keys, len(located))
        return located

    # ------------------------------------------------------------------ get

    async def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix, in order, stopping at the first miss; copies the caller owns.

        A block its tier turns out not to have (deleted behind the store's back,
        corrupt, unreadable) ends the prefix there and is forgotten. Lower-tier
        hits are promoted to the top tier in the background when ``promote_on_hit`` is set.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        async with self.read(namespace, block_hashes, lend=False) as blocks:
            return blocks  # type: ignore[return-value]  # without lending, every block is bytes

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, lend: bool = True) -> BlockRead:
        """The blocks of the longest cached prefix, held for the body of ``async with store.read(...) as blocks``.

        While the body runs, the prefix holds references, so eviction cannot
        take it, and blocks of a tier that lends (:class:`~kvstore.tiers.base.LeasingTier`)
        are read-only views of its memory, not copies: they are valid only
        inside the body. Leaving the body, also by an error or a cancelled call,
        gives everything back. Otherwise as :meth:`get` (recency, promotion, counters).

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            lend: ``False`` to copy every block (what :meth:`get` returns).

        Returns:
            A :class:`BlockRead`, whose ``async with`` yields the blocks, ``bytes``
            or ``memoryview``, in order up to the first miss.

        Raises:
            InvalidArgumentError: (on entering) on a hash of the wrong length.
            UnavailableError: (on entering) if the store is closed.
        """
        return BlockRead(self._reads, namespace, block_hashes, lend)

    # ------------------------------------------------------------------ put

    async def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[bytes],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store encoded blocks in the top tier they fit; returns how many were newly stored.

        A block already resident, or being written by a concurrent put, is not
        written twice (a resident one counts as accessed): the concurrent caller
        waits for the first write and both succeed. Every block is validated
        first, so a bad batch stores nothing; once validated, the batch is
        written to its end even if the caller is cancelled.

        A put that continues the cached prefix a :meth:`lookup` found (its first
        new block is the one after that prefix) protects the prefix while it
        makes room and touches it again after (``kvstore.placement``); if a Get
        is still promoting that prefix, the put first waits for the promotion
        (``kvstore.sim.model`` replays the same order, ``docs/simulate.md``).

        Args:
            namespace: namespace of the blocks.
            block_hashes: one chained hash per block.
            blocks: encoded blocks (``kvstore.codec``), matching the namespace's
                dtype, layout and block size.
            priority: retention priority in ``[0, 100]``; the configured default when ``None``.
            retention_s: seconds the priority holds before it reverts to the default.

        Raises:
            InvalidArgumentError: on a malformed hash, a block that fails to decode
                (a ``CodecError`` naming the cause), a block that does not match
                the namespace, or a bad priority or retention.
            ResourceExhaustedError: on a block over ``max_block_bytes`` or larger than
                every tier, or when nothing can be evicted to make room.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        check_counts(len(keys), len(blocks))
        meta = self._meta(priority, retention_s)
        for position, block in enumerate(blocks):
            check_block(namespace, position, block, self.config.max_block_bytes)
            if not self._fits_somewhere(len(block)):
                exc = ResourceExhaustedError(f"block {position}: {len(block)} bytes is larger than every tier")
                if self._tiers:
                    self._mover.refused(0, "too_large", len(blocks), exc)
                raise exc
        check_one_shape(blocks)
        index = self.index
        first_new = next((key for key in keys if index.level_of(key) is None), None)
        protect = self._continuations.pop(first_new) if first_new is not None else ()
        promoting = self._mover.promotions_of(protect)
        if promoting:  # the Get before this put is still promoting its prefix: this put continues that prefix
            await asyncio.wait(promoting)
            self._check_open()
        for key in reversed(keys):  # a block put again is in use: it counts as accessed, tail first
            level = index.level_of(key)
            if level is not None:
                index.policies[level].touch(key)
        num_new = 0
        pending = dict(zip(keys, blocks))
        while pending:
            # prepare: new blocks get a placing entry; a block another put is placing is waited for, and one whose
            # placement a delete retired (this put is the newer) is placed again once that placement has ended
            fresh: dict[BlockKey, bytes] = {}
            waits: list[Entry] = []
            retired: dict[BlockKey, bytes] = {}
            for key, block in pending.items():
                if index.level_of(key) is not None:
                    continue
                placing = index.placing(key)
                if placing is None:
                    fresh[key] = _owned(block)
                elif placing.state is State.PLACING:
                    waits.append(placing)
                else:
                    waits.append(placing)
                    retired[key] = block
            if fresh:
                entries = [index.place(key, meta.priority, meta.expires_at) for key in fresh]
                generations = (index.namespace_generation(namespace.tag),
                               self._mover.shared_generations(keys[:1]).get(namespace.tag, 0))
                await asyncio.shield(self._mover.run(self._placement.place(entries, list(fresh.values()), meta,
                                                                           generations,
                                                                 protect)))
                num_new += len(fresh)
            for entry in waits:
                error = await asyncio.shield(entry.wait())
                if error is not None and entry.key not in retired:
                    raise error
            pending = retired
        return num_new

    def _fits_somewhere(self, nbytes: int) -> bool:
        if self._shared is not None and not self._write_through:
            return True
        return self._placement.first_fit(nbytes) is not None

    # ------------------------------------------------------------------ delete and clear

    async def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier; returns how many local blocks were found.

        The local tiers forget them at once, so a put or copy of them still in
        flight publishes nothing. The shared tier's copies are unlinked as well,
        best effort: a copy into it already on the wire may land after the
        unlink (keys are content hashes, so it holds the same bytes).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        records, found = self.index.delete(keys)
        deleting = self._delete_records(records)  # in the same step: a put made after this call is not deleted
        self._mover.forget_queued(keys=set(keys))
        copies = self._mover.shared_writes_of(keys)  # copies of them into the shared tier on their way now
        await asyncio.shield(self._mover.run(self._delete_everywhere(deleting, keys if self._shared else None,
                                                                     copies)))
        return found

    async def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace`` from every tier; returns how many local blocks went.

        Locally the blocks go at once, and every copy of them in flight loses. In
        the shared tier the namespace moves to a new generation, part of every
        key, so no node serves its old blocks from there; the old keys are
        removed in the background (``docs/redis.md``).

        Raises:
            UnavailableError: if the store is closed, or the shared tier cannot be reached (the local blocks
                are gone; those in the shared tier stay until a later clear reaches it, or they expire).
        """
        self._check_open()
        tag = namespace.tag
        records, found = self.index.clear(tag)
        deleting = self._delete_records(records)
        self._mover.forget_queued(tag=tag)
        await asyncio.shield(self._mover.run(self._clear(deleting, tag)))
        return found

    async def _clear(self, deleting: list[Awaitable[None]], tag: bytes) -> None:
        await self._delete_everywhere(deleting, None)
        if self._shared is not None:
            generation = await self._shared.clear_namespace(tag)
            self._mover.sweep(tag, generation)

    def _delete_records(self, records: dict[int, list[BlockKey]]) -> list[Awaitable[None]]:
        """Delete records from their local tiers now (each takes effect at the call); returns what to await."""
        return [self._tiers[level].delete(keys) for level, keys in records.items()]

    async def _delete_everywhere(self, deleting: list[Awaitable[None]], shared_keys: list[BlockKey] | None,
                                 copies: Sequence[asyncio.Future[None]] = ()) -> None:
        """Await the local deletes, and delete ``shared_keys`` from the shared tier once the ``copies`` of them into
        it that were on their way have landed."""
        work = list(deleting)
        if shared_keys:
            work.append(self._delete_shared(shared_keys, copies))
        if work:
            await asyncio.gather(*work)

    async def _delete_shared(self, keys: list[BlockKey], copies: Sequence[asyncio.Future[None]]) -> None:
        if copies:
            await asyncio.gather(*copies)
        await self._shared.delete(keys)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        """Blocks, bytes, capacity and event counts of every tier, fastest first; blocks hit and missed by lookups."""
        result = []
        for level, (tier, counts) in enumerate(zip(self.tiers, self._counts)):
            extra = dict(tier.counters())
            local = level < len(self._tiers)
            if local:
                extra["lost_records"] = counts.lost_records
            if counts.copies_dropped:
                extra["copies_dropped"] = counts.copies_dropped
            for reason, num_blocks in counts.dropped_demotions.items():
                extra[f"dropped_demotions_{reason}"] = num_blocks
            for reason, num_blocks in counts.refused_puts.items():
                extra[f"refused_puts_{reason}"] = num_blocks
            result.append(TierStats(
                name=tier.name,
                blocks=len(self.index.policies[level]) if local else -1,
                bytes=self.index.policies[level].nbytes if local else 0,
                logical_bytes=self.index.logical.logical_bytes(level, self.index.policies[level].nbytes) if local else 0,
                capacity_bytes=tier.capacity_bytes or 0,
                hits=counts.hits,
                misses=counts.misses,
                evictions=counts.evictions,
                demotions=counts.demotions,
                promotions=counts.promotions,
                corrupt_records=extra.pop("corrupt_records", 0) + counts.mismatched,
                counters=extra,
                **tier_status(tier),
            ))
        return StoreStats(tuple(result), self._lookup_hit_blocks, self._lookup_miss_blocks)

    def namespace_bytes(self, tag: bytes) -> int:
        """Capacity bytes the blocks of one namespace (by its :attr:`Namespace.tag`) hold in local tiers."""
        return self.index.namespace_bytes(tag)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the store is closed")

    def _meta(self, priority: int | None, retention_s: float | None) -> BlockMeta:
        checked = check_priority(priority)  # kvstore.validation: the clients' checks too
        priority = self.config.default_priority if checked is None else checked
        retention_s = check_retention_s(retention_s)
        now = self._clock()
        return BlockMeta(priority, now + retention_s if retention_s else 0.0, now)

    def _fits(self, namespace: Namespace, key: BlockKey, block: Buffer, tier_name: str) -> bool:
        """Whether a block read from a tier that outlives this process (disk, Redis) has the namespace's dtype,
        layout and block size.

        Such a tier verifies only the block's checksum, and Redis is shared with
        other nodes (maybe of another version) and anything that can reach it: a
        block a put would have refused here is a miss (logged), never served.
        """
        try:
            mismatch = namespace_mismatch(namespace, decode_header(block))
        except CodecError as exc:
            mismatch = str(exc)
        if mismatch:
            logger.warning("tier %s: block %s does not fit its namespace (%s); a miss", tier_name, key.hex(), mismatch)
        return not mismatch


def _held_bytes(lender: LeasingTier | None) -> Callable[[], int] | None:
    """The reader of a lending tier's ``held_bytes``, ``None`` for a tier that lends nothing."""
    if lender is None:
        return None
    return lambda: lender.held_bytes




def _owned(block: Buffer) -> bytes | memoryview:
    """``block`` as memory no caller can change: ``bytes`` as it is, a read-only view of ``bytes`` as it is
    (a same-host Put's copy behind its framing head, ``kvstore.shm.node.SharedMemoryNode.copy_in``), else a copy."""
    if type(block) is bytes:
        return block
    if isinstance(block, memoryview) and block.readonly and type(block.obj) is bytes and block.c_contiguous:
        return block
    return bytes(block)
