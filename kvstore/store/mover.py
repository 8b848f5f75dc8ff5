"""The mover: every copy of blocks between a store's tiers that makes room, and the copies into the shared tier.

A write into a tier that is full first claims victims there
(:meth:`kvstore.store.index.Index.reserve`) and awaits :meth:`Mover.make_room`. Each
victim at or above ``demote_min_priority`` is demoted: copied into the next
local tier (which may need room of its own: the mover moves its victims
first), or into the shared tier from the last local one in ``write_back``
mode; the rest are dropped. A victim stays resident, and readable, until its
copy is published below. A put thus never writes into a tier other than its own.

Every copy is prepare -> I/O -> complete (``kvstore.store.index``): the source and
target entries are checked at the complete step, so a copy whose block was
deleted or cleared meanwhile publishes nothing and discards what it wrote.
The background copies (promotions, write-through) are queued in
``kvstore.store.copies``, which writes through :meth:`Mover.place` and
:meth:`Mover.write_shared` too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence, cast

from kvstore.api import Buffer
from kvstore.blocks.copying import TensorBlock, encoded_values
from kvstore.store.counts import TierCounts, count
from kvstore.errors import ResourceExhaustedError, UnavailableError
from kvstore.store.index import Entry, Index, NoRoomError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.store.misses import DROPPED
from kvstore.policy import EvictionPolicy
from kvstore.ratelog import WARNING_INTERVAL_S, RateLimitedLog
from kvstore.store.records import Records
from kvstore.tiers.base import BlockMeta, CompressingTier, SharedTier, TensorWritingTier, Tier, TierFullError

logger = logging.getLogger(__name__)

SHARED = "shared"
"""The history's cause of a block that left the last local tier for the shared tier (``Index.forget``)."""

BlockMove = tuple[int, float, float, float]
"""What a block takes with it to another tier (:meth:`Mover.meta_of`): its priority, retention end, TTL and the
TTL's end."""


def block_meta(meta: BlockMove, last_access: float) -> BlockMeta:
    """The :class:`BlockMeta` a tier stores for a block moved with ``meta`` (:meth:`Mover.meta_of`)."""
    priority, expires_at, ttl_s, until = meta
    return BlockMeta(priority, expires_at, last_access, ttl_s, until)


PutValue = Buffer | TensorBlock
"""A block as a put or a move hands it to the mover: encoded (``bytes``, or a view of memory that outlives the
write), or a put's tensor not yet encoded (:class:`~kvstore.blocks.copying.TensorBlock`, for a
:class:`~kvstore.tiers.base.TensorWritingTier`; any other tier gets it encoded)."""


def as_stored(values: Sequence[PutValue]) -> Sequence[bytes]:
    """``values`` as :class:`~kvstore.tiers.base.Tier` declares a put's (``bytes``). Every tier takes any buffer,
    and a :class:`~kvstore.tiers.base.TensorWritingTier` a :class:`~kvstore.blocks.copying.TensorBlock` too; the mover
    hands each only what it takes (:meth:`Mover.place`), and says so here, once."""
    return cast("Sequence[bytes]", values)


class Mover:
    """Moves blocks between a store's tiers to make room (see the module docstring); one per store, on its loop.

    Args:
        index: the store's index.
        tiers: the local tiers, fastest first.
        shared: the shared tier (Redis), or ``None``.
        counts: one :class:`TierCounts` per tier, the shared one last; the mover counts into them.
        records: deletes the records of blocks moved out (:class:`~kvstore.store.records.Records`).
        demote_min_priority: victims below this priority are dropped, not demoted.
        write_back: whether the last local tier demotes into the shared tier.
        clock: the store's clock, seconds.
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, counts: Sequence[TierCounts],
                 records: Records, *, demote_min_priority: int, write_back: bool,
                 clock: Callable[[], float]) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._counts = list(counts)
        self._records = records
        self._floor = demote_min_priority
        self._write_back = write_back and shared is not None
        self._clock = clock
        self._shared_writes: dict[BlockKey, asyncio.Future[None]] = {}  # keys on their way into the shared tier
        self._evicting: list[set[asyncio.Future[None]]] = [set() for _ in self._tiers]  # evictions in flight, by tier
        # what each tier's put takes, asked once (a Protocol's isinstance costs tens of microseconds)
        self._packers = [tier if isinstance(tier, CompressingTier) else None for tier in self._tiers]
        self._tensor_writers = [isinstance(tier, TensorWritingTier) for tier in self._tiers]
        self._warnings = RateLimitedLog(logger, WARNING_INTERVAL_S)

    # ------------------------------------------------------------------ room

    async def make_room(self, level: int, victims: list[BlockKey]) -> None:
        """Move ``victims`` (claimed by :meth:`Index.reserve`) out of tier ``level``, and more while the tier is still
        over its capacity (a reader kept a victim's record); returns once they are out.

        Raises:
            ResourceExhaustedError: if what is left to evict is in use.
        """
        while victims:
            await self._evict(level, victims)
            victims = await self.reserve(level, 0)

    async def reserve(self, level: int, nbytes: int) -> list[BlockKey]:
        """:meth:`Index.reserve`, waiting while what is left to evict is claimed by evictions in flight.

        Their victims leave the tier when their moves end: the room a put may
        count on, so a put that fits once they end waits for them rather than
        fail (issue 32: concurrent puts were refused while demotions ran).

        Raises:
            ResourceExhaustedError: if the rest is held (references) by reads, with no eviction in flight to wait
                for.
        """
        while True:
            try:
                return self._index.reserve(level, nbytes)
            except NoRoomError:
                if not await self._evictions_ended(level):
                    raise ResourceExhaustedError(self._no_room(level, nbytes, "the rest is leased by reads in flight")
                                                 ) from None

    async def _evictions_ended(self, level: int) -> bool:
        """Wait until the evictions from tier ``level`` in flight now have ended; whether there were any."""
        evicting = self._evicting[level]
        if not evicting:
            return False
        await asyncio.wait(set(evicting))
        return True

    def _no_room(self, level: int, nbytes: int, why: str) -> str:
        """The message of a put refused for room in tier ``level``: which limit, and what to change."""
        tier = self._tiers[level]
        return (f"no room in tier {tier.name}: {nbytes} bytes needed of its capacity of {tier.capacity_bytes} bytes "
                f"({self._index.used_bytes(level)} in use), {why}; raise the tier's capacity "
                f"(store.{tier.name}.capacity_bytes), or put fewer or smaller blocks per call")

    async def place(self, level: int, entries: list[Entry], values: Sequence[PutValue], metas: Sequence[BlockMeta],
                    sources: Sequence[Entry] | None = None, *, room: int | None = None,
                    declined: list[int] | None = None) -> list[BlockKey]:
        """Write placing ``entries`` into tier ``level`` and publish those still current; returns the keys published.

        In batches that fit the tier at once, tail first, so a head written last
        evicts the tail. Each batch is a prepare (room reserved, victims claimed),
        an I/O (victims moved out, then the write) and a complete step (publish).
        With ``sources`` (a move: one held resident entry per block) each source
        leaves its tier as its copy is published, so tiers stay exclusive.
        ``room`` bounds a batch's bytes (the tier's capacity by default; less
        where a put holds its cached prefix in the tier). With ``declined``, a
        batch the tier cannot make room for (once the evictions in flight end)
        is not an error: the positions of it and of the blocks not yet written
        are added to ``declined``, still placing and charged to no tier, for
        the caller to place in the next tier. A tier that compresses
        (``pack_values``) compresses the batch first, and its room counts the
        stored lengths, so it holds as many more blocks as they are smaller.

        Raises:
            ResourceExhaustedError: if the tier cannot make room; entries not yet written are abandoned.
            UnavailableError: if the tier fails.
        """
        tier, index = self._tiers[level], self._index
        index.logical.learn([entry.key for entry in entries], values)
        for entry, value in zip(entries, values):  # the length as put (a move's: read back as put), before packing
            entry.block_nbytes = len(value)
        published: list[BlockKey] = []
        try:
            if not self._tensor_writers[level]:  # a put's tensors encoded here, for a tier of bytes
                values = encoded_values(values)
            packer = self._packers[level]
            if packer is not None:  # its room is what it stores
                values = await packer.pack_values(as_stored(values))
            sizes = [tier.footprint(len(v)) for v in values]
            capacity = tier.capacity_bytes or 0
            room = capacity if room is None else room
            end = len(entries)
            while end > 0:
                start, need = end, 0
                while start > 0 and need + sizes[start - 1] <= room:
                    start -= 1
                    need += sizes[start]
                first, last = start, end
                end = start
                if not any(index.is_current(entries[i]) for i in range(first, last)):
                    continue
                placing = []
                try:
                    # prepare: room reserved and victims claimed, once the evictions in flight end if need be
                    victims = await self.reserve(level, sum(sizes[i] for i in range(first, last)
                                                            if index.is_current(entries[i])))
                    batch = [i for i in range(first, last) if index.is_current(entries[i])]  # not deleted
                    if not batch:  # all deleted while it waited: the victims it claimed go all the same
                        await self.make_room(level, victims)
                        continue
                    placing = [entries[i] for i in batch]
                    index.charge(placing, level, [sizes[i] for i in batch])
                    stored = await self._write(level, placing, [values[i] for i in batch],
                                               [metas[i] for i in batch], victims)
                except ResourceExhaustedError:
                    if declined is None:
                        raise
                    index.uncharge(placing)  # nothing of the batch was written: it and the rest go elsewhere
                    declined += [i for i in range(last) if index.is_current(entries[i])]
                    return published
                published += self.settle(placing, stored, None if sources is None else [sources[i] for i in batch])
        except BaseException:
            for entry in entries:
                if not entry.ended:
                    index.abandon(entry)
            raise
        return published

    async def _write(self, level: int, entries: list[Entry], values: Sequence[PutValue], metas: Sequence[BlockMeta],
                     victims: list[BlockKey]) -> list[bool]:
        """The I/O of one batch: move its victims out, then write it into tier ``level``; whether each was stored.

        Raises:
            ResourceExhaustedError: if the tier cannot make room.
            UnavailableError: if the tier fails.
        """
        tier = self._tiers[level]
        await self.make_room(level, victims)
        keys = [entry.key for entry in entries]
        while True:
            try:
                return await tier.put(keys, as_stored(values), metas)
            except TierFullError:
                # the room the index promised frees as the evictions in flight end (their victims' pages are
                # the tier's until their moves end): wait for them, then write again
                if not await self._evictions_ended(level):
                    break
        # room the index could not see (a full LMDB map): evict as much again, once
        nbytes = sum(entry.nbytes for entry in entries)
        more = await self.reserve(level, nbytes)
        await self.make_room(level, more)
        try:
            return await tier.put(keys, as_stored(values), metas)
        except TierFullError as exc:
            raise ResourceExhaustedError(self._no_room(level, nbytes, f"the tier is full ({exc})")) from exc

    def settle(self, entries: Sequence[Entry], written: Sequence[bool],
               sources: Sequence[Entry] | None = None) -> list[BlockKey]:
        """A placement's or move's complete step (:meth:`Index.complete_put`); the stale records it names go.

        Returns:
            The keys published, in prefix order.
        """
        published, stale = self._index.complete_put(entries, written, sources)
        if stale:
            self._records.discard(entries[0].level, stale)
        return published

    async def _evict(self, level: int, victims: list[BlockKey]) -> None:
        """Move claimed victims out of tier ``level``: demote those at or above the floor where there is a tier
        below (or a write-back shared tier), drop the rest."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._evicting[level].add(done)
        try:
            await self._move_victims(level, victims)
        finally:
            self._evicting[level].discard(done)
            done.set_result(None)

    async def _move_victims(self, level: int, victims: list[BlockKey]) -> None:
        index = self._index
        policy = index.policies[level]
        entries = [index.held(level, key) for key in victims]
        sources = [e for e in entries if e is not None and index.is_current(e)]
        below = level + 1 < len(self._tiers)
        demote: list[Entry] = []
        if below or (self._write_back and level == len(self._tiers) - 1):
            demote = [e for e in sources if policy.priority_of(e.key) >= self._floor]
        keep = {id(e) for e in demote}
        generations = self.shared_generations([e.key for e in demote]) if not below else None  # as claimed
        under_floor = below or (self._write_back and level == len(self._tiers) - 1)  # dropped though a tier is below
        await self._retire([e for e in sources if id(e) not in keep], DROPPED if under_floor else None)
        self._counts[level].evictions += len(victims)
        if demote:
            await self._demote(level, demote, level + 1 if below else None, generations=generations)

    async def _demote(self, level: int, sources: list[Entry], target: int | None, *, flush: bool = False,
                      generations: dict[bytes, int] | None = None) -> None:
        """Copy held resident ``sources`` of tier ``level`` into local tier ``target`` (``None``: the shared tier,
        under the namespace ``generations`` of when they were claimed), then retire them. With ``flush`` (closing
        the store) those below the floor go only into free room."""
        index = self._index
        policy = index.policies[level]
        metas = {e.key: self.meta_of(policy, e.key) for e in sources}
        try:
            values = await self._tiers[level].get([e.key for e in sources])
        except UnavailableError as exc:
            self._dropped(level, "unavailable", len(sources), exc)
            values = [None] * len(sources)
        found = [(e, v) for e, v in zip(sources, values) if v is not None and index.is_current(e)]
        now = self._clock()
        if target is None:
            shared = await self._demote_to_shared(found, metas, now, generations or {})
            await self._retire([e for e in sources if e.key in shared], SHARED)  # it left for the shared tier
        else:
            await self._demote_to(level, found, metas, target, now, flush)
        await self._retire(sources, DROPPED)  # given up on (the moved ones are gone already): out of this tier

    @staticmethod
    def meta_of(policy: EvictionPolicy[BlockKey], key: BlockKey) -> BlockMove:
        """What a block takes with it to another tier: its priority, retention end, TTL and the TTL's end (a TTL
        survives demotion and promotion; ``docs/agentic.md``)."""
        return (policy.priority_of(key), policy.expiry_of(key), *policy.pin_of(key))

    async def _demote_to(self, level: int, found: list[tuple[Entry, bytes]],
                         metas: dict[BlockKey, BlockMove], target: int, now: float,
                         flush: bool) -> None:
        index = self._index
        tier = self._tiers[target]
        capacity = tier.capacity_bytes or 0
        found = [(e, v) for e, v in found if tier.footprint(len(v)) <= capacity]
        if flush:
            found = self._fit_flush(found, metas, target)
        found = [(e, v) for e, v in found if index.placing(e.key) is None]
        if not found:
            return
        placing = [index.place(e.key, *metas[e.key]) for e, _ in found]
        try:
            published = await self.place(target, placing, [v for _, v in found],
                                         [block_meta(metas[e.key], now) for e, _ in found], [e for e, _ in found])
        except (ResourceExhaustedError, UnavailableError) as exc:  # the victims are dropped; the put goes on
            self._dropped(level, "no_room" if isinstance(exc, ResourceExhaustedError) else "unavailable",
                          len(found), exc)
            return
        self._counts[target].demotions += len(published)

    def _dropped(self, level: int, reason: str, num_blocks: int, exc: Exception) -> None:
        """Count (``TierCounts.dropped_demotions``) and log, rate-limited, victims of ``level`` dropped, not demoted."""
        count(self._counts[level].dropped_demotions, reason, num_blocks)
        self._warnings.warning(f"dropped:{level}:{reason}", "demotion from %s dropped %d blocks (%s): %s",
                               self._tiers[level].name, num_blocks, reason, exc)

    def refused(self, level: int, reason: str, num_blocks: int, exc: Exception) -> None:
        """Count (``TierCounts.refused_puts``) and log, rate-limited, blocks of a put tier ``level`` refused."""
        count(self._counts[level].refused_puts, reason, num_blocks)
        self._warnings.warning(f"refused:{level}:{reason}", "put of %d blocks refused by tier %s (%s): %s",
                               num_blocks, self._tiers[level].name, reason, exc)

    async def _demote_to_shared(self, found: list[tuple[Entry, bytes]],
                                metas: dict[BlockKey, BlockMove], now: float,
                                generations: dict[bytes, int]) -> set[BlockKey]:
        """Write-back: copy ``found`` into the shared tier; returns the keys it stored."""
        found = [(e, v) for e, v in found if self._index.is_current(e)]  # not deleted meanwhile
        if not found or self._shared is None:
            return set()
        keys = [e.key for e, _ in found]
        stored = await self.write_shared(keys, [v for _, v in found], [block_meta(metas[k], now) for k in keys],
                                         generations)
        self._counts[-1].demotions += sum(stored)
        return {key for key, ok in zip(keys, stored) if ok}

    def shared_generations(self, keys: Sequence[BlockKey]) -> dict[bytes, int]:
        """The shared tier's generation of each namespace among ``keys`` now: what a copy prepared now writes under."""
        shared = self._shared
        if shared is None:
            return {}
        return {key[:NAMESPACE_TAG_BYTES]: shared.generation(key[:NAMESPACE_TAG_BYTES]) for key in keys}

    async def write_shared(self, keys: list[BlockKey], values: Sequence[Buffer], metas: Sequence[BlockMeta],
                           generations: dict[bytes, int]) -> list[bool]:
        """Every copy into the shared tier: under ``generations``, and registered while it is on its way, so that
        a delete of its keys sends its unlink after it (:meth:`shared_writes_of`). Only for a store with one."""
        shared = self._shared
        assert shared is not None, "no shared tier to write into"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in keys:
            self._shared_writes[key] = done
        try:
            return await shared.put(keys, as_stored(values), metas, generations=generations)
        finally:
            for key in keys:
                if self._shared_writes.get(key) is done:
                    del self._shared_writes[key]
            done.set_result(None)

    def shared_writes_of(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """The copies into the shared tier on their way now that carry any of ``keys`` (a delete waits for them)."""
        writes = self._shared_writes
        return list({id(writes[k]): writes[k] for k in keys if k in writes}.values())

    async def _retire(self, entries: Sequence[Entry], cause: str | None = None) -> None:
        """Take the mover's claimed sources out of their tier, give back its references, and delete the records
        no reader still holds, before returning: that is the room the caller waits for. ``cause``: what the history
        remembers of those still current (``Index.forget``; ``None``: evicted)."""
        index = self._index
        for entry in entries:
            if index.is_current(entry):
                index.retire(entry, cause=cause)
        for level, keys in index.release_all(entries).items():
            await self._records.delete(level, keys)

    def _fit_flush(self, found: list[tuple[Entry, bytes]], metas: dict[BlockKey, BlockMove],
                   target: int) -> list[tuple[Entry, bytes]]:
        """Of the blocks a close flushes into tier ``target`` (in eviction order): every one at or above the floor,
        then those below it, most valuable first, that fit the room left free."""
        tier = self._tiers[target]
        chosen = {e.key for e, _ in found if metas[e.key][0] >= self._floor}
        free = (tier.capacity_bytes or 0) - self._index.used_bytes(target)
        free -= sum(tier.footprint(len(v)) for e, v in found if e.key in chosen)
        for entry, value in reversed(found):  # most valuable first
            if entry.key not in chosen and tier.footprint(len(value)) <= free:
                chosen.add(entry.key)
                free -= tier.footprint(len(value))
        return [(e, v) for e, v in found if e.key in chosen]

    async def flush(self, level: int, target: int) -> None:
        """Copy every block of the volatile tier ``level`` into the persistent tier ``target`` (closing the store).

        In eviction order, read or not; blocks below the floor go only into the room left free there.
        """
        index = self._index
        index.policies[level].expire(self._clock())  # ended retentions count as default
        keys = [key for key in index.resident_keys(level) if not index.leaving(level, key)]
        sources = [index.hold(level, key) for key in keys]
        self._counts[level].evictions += len(sources)  # each leaves the tier: demoted (and counted so), or dropped
        if sources:
            await self._demote(level, sources, target, flush=True)
