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
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.codec import BlockHeader, Layout, check_one_shape, decode_header, verify_block
from kvstore.config import StoreConfig
from kvstore.continuations import Continuations
from kvstore.errors import CodecError, InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kvstore.index import Entry, Index, NoRoomError, State
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockHash, BlockKey, Namespace, block_keys
from kvstore.mover import Mover, TierCounts
from kvstore.policy import check_priority, make_policy
from kvstore.tiers.base import (
    CHAIN_STEP_S,
    BlockMeta,
    Buffer,
    Framing,
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
        await check_at_start(self._shared)  # a shared tier that is down at start is named in a warning now
        self._mover.start()

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
        return BlockRead(self, namespace, block_hashes, lend)

    def _open_now(self, read: BlockRead) -> list[Buffer] | None:
        """A read's prepare, I/O and complete with no await: the top tier lends the whole cached prefix.

        ``None`` (nothing taken) when that is not the case. The recency comes
        first, so a block being read is no early victim, held or not; the hit
        counts wait for :meth:`BlockRead.close`, which the service's Get runs
        once its reply is on the way (``benchmarks/bench_service.py``).
        """
        self._check_open()
        lender = self._lenders[0] if self._lenders else None
        if not read.lend or lender is None:
            return None
        keys = block_keys(read.namespace, read.block_hashes)
        top = self.index.policies[0]
        if False in top.contains_many(keys):  # lent only if the rest is in no tier at all
            levels = self.index.locate(keys)
            if (self._shared is not None and len(levels) < len(keys)) or levels.strip(b"\0"):
                return None
            keys = keys[:len(levels)]
            read.top_misses = True
        else:
            read.top_misses = False
        lease = lender.lease(keys)
        if lease is None or None in lease.values:
            if lease is not None:
                lease.release()
            read.top_misses = None
            return None
        if not lender.lends_references:  # views of pages the tier reuses: hold them
            read.held = [self.index.hold(0, key) for key in keys]
            read.releases = [lease.release]
        for key in reversed(keys):  # tail first: the head ends most recent
            top.touch(key)
        read.num_lent = len(keys)
        read.framed = lease.framed
        return lease.values  # type: ignore[return-value]  # no None: checked above

    async def _open(self, read: BlockRead) -> list[Buffer]:
        """A read's prepare; its I/O and complete step run in a task of their own (:meth:`_read_prefix`)."""
        values = self._open_now(read)
        if values is not None:
            return values
        keys = block_keys(read.namespace, read.block_hashes)
        index = self.index
        sources: list[int | None] = list(index.locate(keys))  # the local prefix, then (with a shared tier) every
        local: Sequence[int] = range(len(sources))  # later block: past a block in Redis the next may be local again
        wanted: list[int] = []
        if self._shared is not None and len(sources) < len(keys):
            sources += index.levels_of(keys[len(sources):])
            local = [i for i, level in enumerate(sources) if level is not None]
            wanted = [i for i, level in enumerate(sources) if level is None]
        read.held = [index.hold(sources[i], keys[i]) for i in local]  # type: ignore[arg-type]
        generation = index.namespace_generation(read.namespace.tag)
        task = asyncio.ensure_future(self._read_prefix(read, keys, sources, list(local), wanted, generation))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the I/O goes on, so that its complete step runs; then the read closes
            self._mover.adopt(task)
            read.abandon(task)
            raise

    async def _read_prefix(self, read: BlockRead, keys: list[BlockKey], sources: list[int | None],
                           local: list[int], wanted: list[int], generation: int) -> list[Buffer]:
        """A read's I/O (the shared tier first, then each local tier's part in one batch) and complete step."""
        found: list[Buffer | None] = [None] * len(sources)
        if wanted:  # the shared tier first: local blocks past its first miss would be read for nothing
            shared = self._shared
            for i, value in zip(wanted, await shared.get([keys[i] for i in wanted])):  # type: ignore[union-attr]
                if value is None or not self._fits(read.namespace, keys[i], value, shared.name):  # type: ignore[union-attr]
                    local = [j for j in local if j < i]
                    break
                found[i] = value
        held = {id(entry): entry for entry in read.held}
        by_level: dict[int, list[int]] = {}
        for i in local:
            by_level.setdefault(sources[i], []).append(i)  # type: ignore[arg-type]
        batches = [self._read_tier(level, [keys[i] for i in positions], read) for level, positions in by_level.items()]
        results = [await batches[0]] if len(batches) == 1 else await asyncio.gather(*batches)
        for positions, values in zip(by_level.values(), results):
            for i, value in zip(positions, values):
                found[i] = value
        # complete: a located block its tier could not serve (gone, unreadable), or a block of a persistent tier
        # that does not fit the namespace, is a miss, forgotten at once and its record deleted
        entries = {entry.key: entry for entry in held.values()}
        for i in local:
            entry = entries[keys[i]]
            if entry.state is not State.RESIDENT:
                continue  # deleted or moved out meanwhile: what the read got (or not) is not the index's business
            value = found[i]
            if value is None:
                self._counts[entry.level].lost_records += 1
                logger.warning("tier %s: block %s is indexed but could not be read; forgotten",
                               self._tiers[entry.level].name, keys[i].hex())
            elif self._tiers[entry.level].persistent and not self._fits(read.namespace, keys[i], value,
                                                                        self._tiers[entry.level].name):
                found[i] = None
                self._counts[entry.level].mismatched += 1
            else:
                continue
            if self.index.forget(entry.level, entry.key, reason="lost"):
                self._mover.discard(entry.level, [entry.key])
        hit = found.index(None) if None in found else len(found)
        values: list[Buffer] = found[:hit]  # type: ignore[assignment]
        self._count_get([len(self._tiers) if s is None else s for s in sources[:hit]], len(keys))
        policies = self.index.policies
        for key, level in reversed(list(zip(keys[:hit], sources[:hit]))):  # tail first: the head ends most recent
            if level is not None and key in policies[level]:
                policies[level].touch(key)
        if self.config.promote_on_hit and self._tiers:
            read.promotions = self._promotions(keys, sources[:hit], values, generation)
        return values

    async def _read_tier(self, level: int, keys: list[BlockKey], read: BlockRead) -> list[Buffer | None]:
        """One tier's values of ``keys``: lent views where ``read`` may take them and the tier lends, else copies."""
        lender = self._lenders[level]
        if read.lend and lender is not None:
            lease = lender.lease(keys)
            if lease is not None:
                read.releases.append(lease.release)
                return lease.values
        return await self._tiers[level].get(keys)

    def _count_get(self, hit_tiers: list[int], num_asked: int) -> None:
        """Count one get: ``hit_tiers`` are the tiers (indexes into :attr:`tier_names`) of the blocks it served.

        A block served from tier ``t`` is a hit there and a miss in every tier
        above; the first block it did not find (if it asked for more) is a miss
        in every tier. These are the definitions of ``docs/service.md``.
        """
        counts = self._counts
        for t in hit_tiers:
            counts[t].hits += 1
            for above in range(t):
                counts[above].misses += 1
        if len(hit_tiers) < num_asked:
            for c in counts:
                c.misses += 1

    def _promotions(self, keys: list[BlockKey], sources: Sequence[int | None], values: list[Buffer],
                    generation: int) -> list[tuple[int | None, list[BlockKey], list[bytes], int]]:
        """The lower-tier hits to offer for promotion, by source tier (``None``: shared), views copied to bytes."""
        moves: dict[int | None, list[int]] = {}
        for position, level in enumerate(sources[:len(values)]):
            if level != 0:
                moves.setdefault(level, []).append(position)
        return [(level, [keys[p] for p in positions],
                 [v if type(v) is bytes else bytes(v) for v in (values[p] for p in positions)], generation)
                for level, positions in moves.items()]

    def _close_read(self, read: BlockRead) -> None:
        """A read's last step: count a lent read, give back its leases and references, offer its promotions."""
        if read.top_misses is not None:
            self._counts[0].hits += read.num_lent
            if read.top_misses:  # the first miss was looked for in every tier
                for counts in self._counts:
                    counts.misses += 1
            read.top_misses = None
        for release in read.releases:
            release()
        self._mover.release(read.held)
        if not self._closed:  # once released, so that the promotion's room is made by evicting others
            for source, keys, values, generation in read.promotions:
                self._mover.promote(source, keys, values, generation)

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
        makes room and touches it again after (:meth:`_place`); if a Get is
        still promoting that prefix, the put first waits for the promotion
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
        if len(blocks) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} hashes but {len(blocks)} blocks")
        meta = self._meta(priority, retention_s)
        for position, block in enumerate(blocks):
            self._validate_block(namespace, position, block)
            if not self._fits_somewhere(len(block)):
                raise ResourceExhaustedError(f"block {position}: {len(block)} bytes is larger than every tier")
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
                await asyncio.shield(self._mover.run(self._place(entries, list(fresh.values()), meta, generations,
                                                                 protect)))
                num_new += len(fresh)
            for entry in waits:
                error = await asyncio.shield(entry.wait())
                if error is not None and entry.key not in retired:
                    raise error
            pending = retired
        return num_new

    async def _place(self, entries: list[Entry], values: list[bytes], meta: BlockMeta,
                     generations: tuple[int, int], protect: Sequence[BlockKey] = ()) -> None:
        """A put's I/O and complete step: each block into the first local tier it fits, in batches that fit the
        tier at once, tail first, so a head written last evicts the tail; blocks that fit no local tier go to the
        shared tier in ``write_back`` mode. In ``write_through`` mode every block is then offered to the shared tier.

        ``protect``: the cached prefix this put continues (``kvstore.continuations``, recorded by the lookup). It
        is held while room is made, so the new blocks cannot push out their own head, and touched again, tail
        first, once they are in, so the whole chain ends ordered tail (least recent) to head, as a request's
        blocks are freed tail first in vLLM. ``kvstore.sim.model`` replays exactly this order.

        The write-through belongs to the placement, not to the caller: a put failed part-way has still published
        blocks, and the last local tier drops its victims, counting on the shared tier's copy. It is offered
        first, before any I/O, for the blocks no delete has retired yet: a delete from then on drops the queued
        copy or waits for the one on the wire before it unlinks (:meth:`delete`), so no copy lands after it.
        """
        metas = _chain_metas(meta, len(entries))
        if self._write_through:
            live = [i for i, entry in enumerate(entries) if entry.state is State.PLACING]  # not deleted meanwhile
            if live:
                self._mover.write_through([entries[i].key for i in live], [values[i] for i in live],
                                          [meta] * len(live), *generations)
        try:
            by_level: dict[int | None, list[int]] = {}
            for i, value in enumerate(values):
                by_level.setdefault(self._first_fit(len(value)), []).append(i)
            for level, positions in by_level.items():
                await self._place_down(level, [entries[i] for i in positions], [values[i] for i in positions],
                                       [metas[i] for i in positions], protect, generations[1])
            index = self.index
            for key in reversed(protect):  # tail first: the chain's head ends the most recent
                level = index.level_of(key)
                if level is not None:
                    index.policies[level].touch(key)
        except BaseException as exc:
            for entry in entries:
                if not entry.ended:
                    self.index.abandon(entry, exc if isinstance(exc, Exception) else None)
            raise

    async def _place_down(self, level: int | None, entries: list[Entry], values: list[bytes],
                          metas: list[BlockMeta], protect: Sequence[BlockKey], shared_generation: int) -> None:
        """Blocks into local tier ``level``; those the protected prefix leaves no room for there go on to the next
        tier they fit, and past the last one to the shared tier in ``write_back`` mode, or nowhere (not stored;
        no error). ``level`` ``None``: no local tier is left for them."""
        if level is None:
            if self._shared is not None and not self._write_through:
                await self._spill(entries, values, metas, shared_generation)
            else:
                for entry in entries:
                    self.index.abandon(entry)
            return
        declined = await self._place_in(level, entries, values, metas, protect)
        if not declined:
            return
        below: dict[int | None, list[int]] = {}
        for i in declined:
            below.setdefault(self._first_fit(len(values[i]), level + 1), []).append(i)
        for target, positions in below.items():
            await self._place_down(target, [entries[i] for i in positions], [values[i] for i in positions],
                                   [metas[i] for i in positions], protect, shared_generation)

    async def _place_in(self, level: int, entries: list[Entry], values: list[bytes], metas: list[BlockMeta],
                        protect: Sequence[BlockKey] = ()) -> list[int]:
        """Write blocks into tier ``level`` with the protected blocks resident there held, so no victim; the room
        is the tier's capacity less theirs. Returns the positions of the blocks that room cannot take: all of
        them (one of them is larger than the room), or none."""
        index = self.index
        held = [index.hold(level, key) for key in dict.fromkeys(protect) if index.level_of(key) == level]
        try:
            room = None
            if held:
                tier = self._tiers[level]
                room = (tier.capacity_bytes or 0) - sum(entry.nbytes for entry in held
                                                        if not index.leaving(level, entry.key))
                if max(tier.footprint(len(v)) for v in values) > room:
                    return list(range(len(entries)))
            await self._mover.place(level, entries, values, metas, room=room)
            return []
        finally:
            self._mover.release(held)

    async def _spill(self, entries: list[Entry], values: list[bytes], metas: list[BlockMeta],
                     generation: int) -> None:
        """Blocks that fit no local tier, in ``write_back`` mode: straight into the shared tier."""
        live = [i for i, entry in enumerate(entries) if entry.state is State.PLACING]  # not deleted meanwhile
        if live:
            tag = entries[0].key[:NAMESPACE_TAG_BYTES]
            await self._mover.write_shared([entries[i].key for i in live], [values[i] for i in live],
                                           [metas[i] for i in live], {tag: generation})
        for entry in entries:
            self.index.abandon(entry)

    def _first_fit(self, nbytes: int, start: int = 0) -> int | None:
        """The first local tier from ``start`` a block of ``nbytes`` fits, ``None`` for none (it goes to the shared
        tier)."""
        for level in range(start, len(self._tiers)):
            tier = self._tiers[level]
            if tier.footprint(nbytes) <= (tier.capacity_bytes or 0):
                return level
        return None

    def _fits_somewhere(self, nbytes: int) -> bool:
        if self._shared is not None and not self._write_through:
            return True
        return self._first_fit(nbytes) is not None

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
        clear_namespace = getattr(self._shared, "clear_namespace", None)
        if clear_namespace is not None:
            generation = await clear_namespace(tag)
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
            result.append(TierStats(
                name=tier.name,
                blocks=len(self.index.policies[level]) if local else -1,
                bytes=self.index.policies[level].nbytes if local else 0,
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
        priority = self.config.default_priority if priority is None else priority
        try:
            check_priority(priority)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if retention_s is not None and not retention_s >= 0:
            raise InvalidArgumentError(f"retention_s must be >= 0, got {retention_s}")
        now = self._clock()
        return BlockMeta(priority, now + retention_s if retention_s else 0.0, now)

    def _validate_block(self, namespace: Namespace, position: int, block: bytes) -> None:
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"block {position}: expected encoded bytes, got {type(block).__name__}")
        if len(block) > self.config.max_block_bytes:
            raise ResourceExhaustedError(
                f"block {position}: {len(block)} bytes is over max_block_bytes={self.config.max_block_bytes}"
            )
        try:
            header = verify_block(block)
        except CodecError as exc:
            raise type(exc)(f"block {position}: {exc}") from None
        mismatch = _namespace_mismatch(namespace, header)
        if mismatch:
            raise InvalidArgumentError(f"block {position}: {mismatch}")

    def _fits(self, namespace: Namespace, key: BlockKey, block: Buffer, tier_name: str) -> bool:
        """Whether a block read from a tier that outlives this process (disk, Redis) has the namespace's dtype,
        layout and block size.

        Such a tier verifies only the block's checksum, and Redis is shared with
        other nodes (maybe of another version) and anything that can reach it: a
        block a put would have refused here is a miss (logged), never served.
        """
        try:
            mismatch = _namespace_mismatch(namespace, decode_header(block))
        except CodecError as exc:
            mismatch = str(exc)
        if mismatch:
            logger.warning("tier %s: block %s does not fit its namespace (%s); a miss", tier_name, key.hex(), mismatch)
        return not mismatch


class BlockRead:
    """One read of :meth:`TieredStore.read`: ``async with store.read(namespace, hashes) as blocks``.

    Entering holds the longest cached prefix and returns its blocks; leaving,
    also by an error or a cancelled call, gives everything back. A plain class
    rather than ``contextlib.asynccontextmanager``: it runs on every Get, and a
    generator-based manager costs several microseconds more.

    Attributes:
        namespace: namespace of the blocks.
        block_hashes: the hashes asked for, in prefix order.
        lend: whether a tier that lends may return views (``False``: copies).
        held: the index entries this read holds references on, once entered.
        releases: the tier leases to give back, once entered.
        promotions: lower-tier hits to offer the mover on leaving.
        framed: once entered, per block, its stored framed value (the server's
            value encoding, e.g. a ready Get reply) where the top tier holds one
            (:attr:`~kvstore.tiers.base.TierLease.framed`), valid as long as the
            blocks are; ``None`` when none was lent.
        num_lent: the blocks of a read the top tier lent whole.
        top_misses: for such a read, until it is closed, whether it asked for
            more blocks than were cached (its counts are made then); else ``None``.
    """

    __slots__ = ("_store", "namespace", "block_hashes", "lend", "held", "releases", "promotions", "framed",
                 "num_lent", "top_misses", "_closed")

    def __init__(self, store: TieredStore, namespace: Namespace, block_hashes: Sequence[BlockHash], lend: bool) -> None:
        self._store = store
        self.namespace = namespace
        self.block_hashes = block_hashes
        self.lend = lend
        self.held: list[Entry] = []
        self.releases: list[Callable[[], None]] = []
        self.promotions: list[tuple[int | None, list[BlockKey], list[bytes], int]] = []
        self.framed: list[bytes | None] | None = None
        self.num_lent = 0
        self.top_misses: bool | None = None
        self._closed = False

    async def open(self) -> list[Buffer]:
        """Hold and lease the prefix and return its blocks (``async with`` calls it); pair it with :meth:`close`.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        try:
            return await self._store._open(self)
        except asyncio.CancelledError:
            raise  # the read's I/O goes on, and closes the read when it ends (abandon)
        except BaseException:
            self.close()
            raise

    def open_now(self) -> list[Buffer] | None:
        """:meth:`open` without waiting, in the common case: the top tier lends the whole cached prefix.

        ``None`` when that is not the case; then call :meth:`open`. The
        service's Get takes this path first: a coroutine less on every call.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        return self._store._open_now(self)

    def abandon(self, task: asyncio.Future[object]) -> None:
        """The caller was cancelled while the read's I/O ran: close the read once that I/O has ended."""
        if task.done():
            self.close()
        else:
            task.add_done_callback(lambda _: self.close())

    def close(self) -> None:
        """Give back what :meth:`open` took, count the read, and offer its promotions; a second call does nothing.

        A plain call, so that a caller may run it a moment later (the service's
        Get, with ``loop.call_soon``, once its reply is on the way).
        """
        if not self._closed:
            self._closed = True
            self._store._close_read(self)

    async def __aenter__(self) -> list[Buffer]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _held_bytes(lender: LeasingTier | None) -> Callable[[], int] | None:
    """The reader of a lending tier's ``held_bytes``, ``None`` for a tier that lends nothing."""
    if lender is None:
        return None
    return lambda: lender.held_bytes


def _chain_metas(meta: BlockMeta, num_blocks: int) -> list[BlockMeta]:
    """``meta`` for each of ``num_blocks`` blocks in prefix order, the head most recent.

    A restart rebuilds the eviction order by sorting on ``last_access``
    (:meth:`TieredStore.start`); a step of :data:`~kvstore.tiers.base.CHAIN_STEP_S`
    per block keeps the rule that a chain's tail goes before its head.
    """
    return [dataclasses.replace(meta, last_access=meta.last_access - i * CHAIN_STEP_S) for i in range(num_blocks)]


def _namespace_mismatch(namespace: Namespace, header: BlockHeader) -> str:
    """How a block's header contradicts its namespace (dtype, layout, tokens per block); ``""`` if it does not."""
    if header.dtype != namespace.dtype or header.layout.value != namespace.layout:
        return (f"{header.dtype}/{header.layout.value} does not match the namespace's "
                f"{namespace.dtype}/{namespace.layout}")
    tokens = header.shape[3] if header.layout is Layout.KV else header.shape[2]
    if tokens != namespace.block_size:
        return f"holds {tokens} tokens, the namespace's block size is {namespace.block_size}"
    return ""


async def open_async_store(config: StoreConfig | None = None, *, framing: Framing | None = None,
                           events: StoreObserver | None = None) -> TieredStore:
    """Build the tiers named by ``config`` and open a started :class:`TieredStore`.

    The memory tier comes first when enabled, then the LMDB tier when
    ``disk.path`` is set, then Redis as the shared tier when ``redis.url`` is set.

    Args:
        config: the store's configuration; the defaults when ``None``.
        framing: the server's value encoding (``kvstore serve`` passes its Get
            reply's head, ``kvstore.wire.reply_head``); with it, a ``cpu`` memory
            tier of ``storage: auto`` is the heap tier, which stores every block
            behind its framing, so the server sends it with no copy of its own.
        events: the store's observer (``kvstore.events.EventLog``), told of blocks restored at start too.

    Raises:
        ConfigError: if no tier is enabled.
    """
    from kvstore.errors import ConfigError

    config = config or StoreConfig()
    tiers: list[Tier] = []
    memory = config.memory
    if memory.enabled and memory.capacity_bytes > 0:
        if memory.storage == "heap" or (memory.storage == "auto" and framing is not None and memory.device == "cpu"):
            from kvstore.tiers.heap import HeapTier

            tiers.append(HeapTier.from_config(memory, framing=framing))
        else:
            from kvstore.tiers.memory import MemoryTier

            tiers.append(MemoryTier.from_config(memory))
    if config.disk.path:
        from kvstore.tiers.lmdb import LMDBTier

        tiers.append(LMDBTier.from_config(config.disk))
    shared = None
    if config.redis.url:
        from kvstore.tiers.redis import RedisTier

        shared = RedisTier.from_config(config.redis)
    if not tiers and shared is None:
        raise ConfigError("store", "no tier is enabled: enable memory, or set disk.path or redis.url")
    store = TieredStore(tiers, config, shared=shared, events=events)
    await store.start()
    return store


def _owned(block: Buffer) -> bytes | memoryview:
    """``block`` as memory no caller can change: ``bytes`` as it is, a read-only view of ``bytes`` as it is
    (a same-host Put's copy behind its framing head, ``kvstore.shm.node.SharedMemoryNode.copy_in``), else a copy."""
    if type(block) is bytes:
        return block
    if isinstance(block, memoryview) and block.readonly and type(block.obj) is bytes and block.c_contiguous:
        return block
    return bytes(block)
