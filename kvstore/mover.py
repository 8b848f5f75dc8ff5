"""The mover: every copy of blocks between tiers, and the store's one background task.

Two kinds of work come to it:

* **Room.** A write into a tier that is full first claims victims there
  (:meth:`kvstore.index.Index.reserve`) and awaits :meth:`Mover.make_room`. Each
  victim at or above ``demote_min_priority`` is demoted: copied into the next
  local tier (which may need room of its own: the mover moves its victims
  first), or into the shared tier from the last local one in ``write_back``
  mode; the rest are dropped. A victim stays resident, and readable, until its
  copy is published below. A put thus never writes into a tier other than its own.
* **Background copies**, offered to a queue that one task drains in order:
  promotions of lower-tier hits into the top tier, write-through copies of new
  blocks into the shared tier, and the removal of a cleared namespace's old
  generation from the shared tier. The queue is bounded in bytes
  (:data:`MAX_QUEUED_BYTES`); an offer beyond it is dropped and counted
  (``copies_dropped``), as a cache may.

Every copy is prepare -> I/O -> complete (``kvstore.index``): the source and
target entries are checked at the complete step, so a copy whose block was
deleted or cleared meanwhile publishes nothing and discards what it wrote.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from kvstore.blockcopy import encoded_values
from kvstore.errors import ResourceExhaustedError, UnavailableError
from kvstore.index import Entry, Index, NoRoomError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.misses import DROPPED
from kvstore.policy import EvictionPolicy
from kvstore.counts import TierCounts, count
from kvstore.ratelog import WARNING_INTERVAL_S, RateLimitedLog
from kvstore.tiers.base import (CHAIN_STEP_S, BlockMeta, CompressingTier, SharedTier, TensorWritingTier, Tier,
                                TierFullError)

logger = logging.getLogger(__name__)

SHARED = "shared"
"""The history's cause of a block that left the last local tier for the shared tier (``Index.forget``)."""

MAX_QUEUED_BYTES = 256 << 20
"""Bytes of block values the background queue may hold; offers beyond it are dropped (and counted)."""


@dataclass(slots=True)
class _Promotion:
    source: int | None  # a local tier, or None for the shared tier
    keys: list[BlockKey]
    values: list[bytes]
    generation: int  # the namespace generation the values were read under (shared source)
    nbytes: int = field(default=0)
    done: asyncio.Future[None] | None = None  # set once the promotion ended (``Mover.promotions_of``)
    all_keys: list[BlockKey] = field(default_factory=list)  # the keys offered (a delete may drop some from keys)

    def __post_init__(self) -> None:
        self.all_keys = list(self.keys)


@dataclass(slots=True)
class _WriteThrough:
    keys: list[BlockKey]
    values: list[bytes]
    metas: list[BlockMeta]
    generation: int  # the namespace's local generation (clears on this store) when the put was prepared
    shared_generation: int  # and the shared tier's
    nbytes: int = field(default=0)


@dataclass(slots=True)
class _Sweep:
    tag: bytes
    generation: int
    nbytes: int = field(default=0)
    keys: tuple[BlockKey, ...] = ()  # a sweep carries no blocks (every job has keys and values)
    values: tuple[bytes, ...] = ()


_Job = _Promotion | _WriteThrough | _Sweep


def block_meta(meta: tuple[int, float, float, float], last_access: float) -> BlockMeta:
    """The :class:`BlockMeta` a tier stores for a block moved with ``meta`` (:meth:`Mover.meta_of`)."""
    priority, expires_at, ttl_s, until = meta
    return BlockMeta(priority, expires_at, last_access, ttl_s, until)


async def _nothing() -> None:
    return None


async def _quietly(pending: Awaitable[None], tier: Tier, num_keys: int) -> None:
    try:
        await pending
    except UnavailableError as exc:  # failing: the record is left, as after a crash
        logger.warning("deleting %d records from tier %s failed: %s", num_keys, tier.name, exc)


class Mover:
    """Moves blocks between a store's tiers (see the module docstring); one per store, on its event loop.

    Args:
        index: the store's index.
        tiers: the local tiers, fastest first.
        shared: the shared tier (Redis), or ``None``.
        counts: one :class:`TierCounts` per tier, the shared one last; the mover counts into them.
        demote_min_priority: victims below this priority are dropped, not demoted.
        write_back: whether the last local tier demotes into the shared tier.
        default_priority: priority of blocks promoted out of the shared tier (it keeps none).
        clock: the store's clock, seconds.
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, counts: Sequence[TierCounts], *,
                 demote_min_priority: int, write_back: bool, default_priority: int,
                 clock: Callable[[], float]) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._counts = list(counts)
        self._floor = demote_min_priority
        self._write_back = write_back and shared is not None
        self._default_priority = default_priority
        self._clock = clock
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[object]] = set()  # operations and record deletes in flight
        self._shared_writes: dict[BlockKey, asyncio.Future[None]] = {}  # keys on their way into the shared tier
        self._promoting: dict[BlockKey, asyncio.Future[None]] = {}  # keys of queued or running promotions
        self._evicting: list[set[asyncio.Future[None]]] = [set() for _ in self._tiers]  # evictions in flight, by tier
        # what each tier's put takes, asked once (a Protocol's isinstance costs tens of microseconds)
        self._packers = [tier if isinstance(tier, CompressingTier) else None for tier in self._tiers]
        self._tensor_writers = [isinstance(tier, TensorWritingTier) for tier in self._tiers]
        self._warnings = RateLimitedLog(logger, WARNING_INTERVAL_S)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background task (on the running loop)."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain_queue(), name="kvstore-mover")

    async def drain(self) -> None:
        """Wait until no operation, record delete or background copy is in flight, and the queue is empty."""
        while self._tasks or self._queue or not self._idle.is_set():
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._queue or not self._idle.is_set():
                await self._idle.wait()

    async def close(self) -> None:
        """Finish the queued work, then stop the background task."""
        await self.drain()
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for done in self._promoting.values():  # never run: nothing waits on them any more
            if not done.done():
                done.set_result(None)
        self._promoting.clear()

    def run(self, work: Awaitable[object]) -> asyncio.Future[object]:
        """Run ``work`` (an operation's I/O and complete step) to its end even if its caller is cancelled.

        The caller awaits ``asyncio.shield`` of the returned task; :meth:`drain` waits for it.
        """
        return self.adopt(asyncio.ensure_future(work))

    def adopt(self, task: asyncio.Future[object]) -> asyncio.Future[object]:
        """Let :meth:`drain` wait for ``task`` (a read whose caller went away while its I/O ran)."""
        if not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Future[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # observed: its caller (if any) got it; a task without one is logged by it

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
            ResourceExhaustedError: if the rest is held by reads, with no eviction in flight to wait for.
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

    async def place(self, level: int, entries: list[Entry], values: Sequence[bytes], metas: Sequence[BlockMeta],
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
                values = await packer.pack_values(values)
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

    async def _write(self, level: int, entries: list[Entry], values: Sequence[bytes], metas: Sequence[BlockMeta],
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
                return await tier.put(keys, values, metas)
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
            return await tier.put(keys, values, metas)
        except TierFullError as exc:
            raise ResourceExhaustedError(self._no_room(level, nbytes, f"the tier is full ({exc})")) from exc

    def discard(self, level: int, keys: list[BlockKey]) -> None:
        """Delete records the index no longer accounts for (stale writes, retired blocks): now, finished in the
        background (:meth:`drain` waits for it)."""
        if keys:
            self.run(self._delete(self._tiers[level], keys))

    def _delete(self, tier: Tier, keys: list[BlockKey]) -> Awaitable[None]:
        """Call ``tier.delete(keys)`` now (it takes effect at the call); the awaitable reports no tier failure."""
        try:
            pending = tier.delete(keys)
        except UnavailableError as exc:  # closed: the record is left, as after a crash
            logger.warning("deleting %d records from tier %s failed: %s", len(keys), tier.name, exc)
            return _nothing()
        return _quietly(pending, tier, len(keys))

    def settle(self, entries: Sequence[Entry], written: Sequence[bool],
               sources: Sequence[Entry] | None = None) -> list[BlockKey]:
        """A placement's or move's complete step (:meth:`Index.complete_put`); the stale records it names go.

        Returns:
            The keys published, in prefix order.
        """
        published, stale = self._index.complete_put(entries, written, sources)
        if stale:
            self.discard(entries[0].level, stale)
        return published

    def release(self, entries: Sequence[Entry]) -> None:
        """Give back references; records of retired entries whose last reference this was are deleted (soon)."""
        for level, keys in self._released(entries).items():
            self.discard(level, keys)

    def _released(self, entries: Sequence[Entry]) -> dict[int, list[BlockKey]]:
        """Give back references; returns the records whose last reference this was, by tier, for the caller to delete."""
        index = self._index
        gone: dict[int, list[BlockKey]] = {}
        for entry in reversed(entries):  # tail first: blocks held head first return with the head the most recent
            if index.release(entry):
                gone.setdefault(entry.level, []).append(entry.key)
        return gone

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
    def meta_of(policy: EvictionPolicy, key: BlockKey) -> tuple[int, float, float, float]:
        """What a block takes with it to another tier: its priority, retention end, TTL and the TTL's end (a TTL
        survives demotion and promotion; ``docs/agentic.md``)."""
        return (policy.priority_of(key), policy.expiry_of(key), *policy.pin_of(key))

    async def _demote_to(self, level: int, found: list[tuple[Entry, bytes]],
                         metas: dict[BlockKey, tuple[int, float, float, float]], target: int, now: float,
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
                                metas: dict[BlockKey, tuple[int, float, float, float]], now: float,
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

    async def write_shared(self, keys: list[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta],
                           generations: dict[bytes, int]) -> list[bool]:
        """Every copy into the shared tier: under ``generations``, and registered while it is on its way, so that
        a delete of its keys sends its unlink after it (:meth:`wait_shared_writes`)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in keys:
            self._shared_writes[key] = done
        try:
            return await self._shared.put(keys, values, metas, generations=generations)  # type: ignore[union-attr]
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
        for level, keys in self._released(entries).items():
            await self._delete(self._tiers[level], keys)

    def _fit_flush(self, found: list[tuple[Entry, bytes]], metas: dict[BlockKey, tuple[int, float, float, float]],
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

    # ------------------------------------------------------------------ background copies

    def offer(self, job: _Job) -> bool:
        """Queue a background copy; ``False`` (and counted) if the queue is full or the mover closed."""
        job.nbytes = sum(map(len, job.values))
        if self._closed or (job.nbytes and self._queued_bytes + job.nbytes > MAX_QUEUED_BYTES):
            target = 0 if isinstance(job, _Promotion) else -1
            self._counts[target].copies_dropped += len(job.keys)
            return False
        self._queue.append(job)
        self._queued_bytes += job.nbytes
        self._idle.clear()
        self._wakeup.set()
        return True

    def promote(self, source: int | None, keys: list[BlockKey], values: list[bytes], generation: int = 0) -> None:
        """Offer to copy hits from tier ``source`` (``None``: the shared tier, read under namespace ``generation``)
        into the top tier; the source keeps no copy, except the shared tier."""
        job = _Promotion(source, keys, values, generation)
        if self.offer(job):
            job.done = asyncio.get_running_loop().create_future()
            for key in keys:
                self._promoting[key] = job.done

    def promotions_of(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """The promotions queued or running now that carry any of ``keys``; each is done once its copy ended.

        A put that continues a prefix a Get is still promoting waits for them, so that it makes its room after
        the promotion made its own (``TieredStore.put``; the simulator runs the same, ``kvstore.sim.node``).
        """
        promoting = self._promoting
        if not promoting:
            return []
        return list({id(promoting[k]): promoting[k] for k in keys if k in promoting}.values())

    def _promotion_ended(self, job: _Promotion) -> None:
        if job.done is None:
            return
        for key in job.all_keys:
            if self._promoting.get(key) is job.done:
                del self._promoting[key]
        job.done.set_result(None)

    def write_through(self, keys: list[BlockKey], values: list[bytes], metas: list[BlockMeta], generation: int,
                      shared_generation: int) -> None:
        """Offer to copy new blocks into the shared tier under ``shared_generation``, unless this store clears their
        namespace first (its local ``generation`` changes). A value that is a view (of memory the put lends only
        until it ends, e.g. a range of the shared pool) is copied here, since the job outlives the put."""
        values = [v if type(v) is bytes else bytes(v) for v in values]
        self.offer(_WriteThrough(keys, values, metas, generation, shared_generation))

    def sweep(self, tag: bytes, generation: int) -> None:
        """Offer to remove a cleared namespace's keys of generations before ``generation`` from the shared tier."""
        self.offer(_Sweep(tag, generation))

    def forget_queued(self, keys: set[BlockKey] | None = None, tag: bytes | None = None) -> None:
        """Drop queued copies of ``keys``, or of every block of the namespace ``tag`` (a delete or clear)."""
        def wanted(key: BlockKey) -> bool:
            return not (key in keys if keys is not None else key.startswith(tag))  # type: ignore[arg-type]

        for job in self._queue:
            if isinstance(job, _Sweep):
                continue
            kept = [i for i, key in enumerate(job.keys) if wanted(key)]
            if len(kept) < len(job.keys):
                job.keys = [job.keys[i] for i in kept]
                job.values = [job.values[i] for i in kept]
                if isinstance(job, _WriteThrough):
                    job.metas = [job.metas[i] for i in kept]

    async def _drain_queue(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            try:
                if isinstance(job, _Promotion):
                    await self._promote(job)
                elif isinstance(job, _WriteThrough):
                    await self._write_through(job)
                else:
                    await self._sweep(job)
            except asyncio.CancelledError:
                raise
            except UnavailableError as exc:  # a tier down or closed: expected, and counted by the tier
                logger.warning("background copy stopped: %s", exc)
            except Exception:
                logger.exception("background copy failed")
            finally:
                self._queued_bytes -= job.nbytes
                if isinstance(job, _Promotion):
                    self._promotion_ended(job)

    async def _promote(self, job: _Promotion) -> None:
        index = self._index
        if not self._tiers or not job.keys:
            return
        source = job.source
        tag = job.keys[0][:NAMESPACE_TAG_BYTES]
        if source is None and index.cleared_since(tag, job.generation):
            return  # cleared since the read: the values are of the old generation
        wanted = [i for i, key in enumerate(job.keys)
                  if index.placing(key) is None and index.level_of(key) == source
                  and (source is None or not index.leaving(source, key))]
        if not wanted:
            return
        top = self._tiers[0]
        wanted = [i for i in wanted if top.footprint(len(job.values[i])) <= (top.capacity_bytes or 0)]
        if not wanted:
            return
        keys = [job.keys[i] for i in wanted]
        values = [job.values[i] for i in wanted]
        now = self._clock()
        if source is None:
            metas: list[tuple[int, float, float, float]] = [(self._default_priority, 0.0, 0.0, 0.0)] * len(keys)
            held: list[Entry] = []
        else:
            policy = index.policies[source]
            metas = [self.meta_of(policy, k) for k in keys]
            held = [index.hold(source, key) for key in keys]
        placing = [index.place(key, *meta) for key, meta in zip(keys, metas)]
        block_metas = [block_meta(meta, now - i * CHAIN_STEP_S) for i, meta in enumerate(metas)]
        try:
            published = await self.place(0, placing, values, block_metas, held if source is not None else None)
        except (ResourceExhaustedError, UnavailableError) as exc:  # the top tier is in use: a promotion is an offer
            logger.debug("promotion into %s stopped: %s", top.name, exc)
            published = []
        finally:
            self.release(held)
        # a promoted block the top tier evicted again while the rest were written went back down: not moved
        moved = [key for key in published if key in index.policies[0]]
        self._counts[len(self._tiers) if source is None else source].promotions += len(moved)

    async def _write_through(self, job: _WriteThrough) -> None:
        if self._shared is None or not job.keys:
            return
        tag = job.keys[0][:NAMESPACE_TAG_BYTES]
        if self._index.cleared_since(tag, job.generation):
            return  # cleared here since the put: the clear wins (and one elsewhere: the old generation is written)
        await self.write_shared(job.keys, job.values, job.metas, {tag: job.shared_generation})

    async def _sweep(self, job: _Sweep) -> None:
        if self._shared is not None:
            await self._shared.sweep_namespace(job.tag, job.generation)
