"""The index: every fact about the blocks the local tiers hold, changed only synchronously on the event loop.

What it knows, per local tier (``level`` 0 is the fastest):

* the **resident** blocks, in that tier's eviction policy (``kvstore.policy``):
  their keys, bytes, priority and retention, in eviction order;
* the **entries** of blocks that an operation is using right now (see :class:`Entry`):
  a block being written (``PLACING``), one being read or moved (a resident
  block with references), and one removed while references remained (``RETIRED``);
* its **room**: the bytes resident (less those of victims on their way out),
  being written, and still held for readers, which :meth:`Index.reserve` keeps
  within the tier's capacity.

And per namespace: what its resident blocks are charged (tenant quotas: the same
in every tier, ``kvstore.store.charges``) and a **generation** that every clear of the
namespace bumps.

Every operation of the store is prepare -> I/O -> complete, and the index owns
the two synchronous steps: :meth:`Index.prepare_put` / :meth:`Index.complete_put`
and :meth:`Index.prepare_read` / :meth:`Index.complete_read` (the mover's copies
use :meth:`Index.place`, :meth:`Index.hold` and :meth:`Index.complete_put` the
same way). The I/O between them, awaited, never changes the index. A delete,
clear, eviction or move retires the entries it removes at once (their
``state``): an entry is its block's generation, a newer put making a new one.
So an operation whose entry went while its I/O ran finds that out at its
complete step, by the one check :meth:`Index.is_current`, and discards its
work; a copy that holds no entry (read from the shared tier, or queued for it)
checks its namespace's generation instead (:meth:`Index.cleared_since`).

Why a resident block no operation uses has no :class:`Entry`: an object per
block costs about 100 bytes of RAM (object, slots and a dict slot), a third
more than all the rest of the index together (``benchmarks/bench_index.py``:
264 bytes per block). A resident block is its key in its tier's policy; an
entry is made when an operation first takes the block and dropped when the
last one lets go.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from operator import or_
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from kvstore.store.charges import NamespaceCharges
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.tiers.logical import LogicalBytes
from kvstore.store.misses import DELETED, EVICTED, EXPIRED, LOST, MissHistory
from kvstore.store.pins import PinLimits, Pins
from kvstore.policy import EvictionPolicy

if TYPE_CHECKING:
    from kvstore.events.log import StoreObserver


class State(enum.Enum):
    """The life of an :class:`Entry`."""

    PLACING = "placing"
    """Being written into its tier; not yet visible to lookups and reads."""
    RESIDENT = "resident"
    """In its tier and in the tier's policy; visible."""
    RETIRED = "retired"
    """Removed from the index (deleted, cleared, evicted or moved), or a placement given up on."""


class NoRoomError(Exception):
    """A tier cannot make the room asked for: what is left to evict is in use (internal)."""


class Entry:
    """A block an operation is using: the handle that operation holds between its prepare and complete steps.

    Attributes:
        key: the block key.
        level: its local tier (0 is the fastest); -1 for a placement not yet charged to one.
        nbytes: capacity bytes it takes there (the tier's ``footprint``).
        block_nbytes: the block's length as put (its tenant's charge: ``kvstore.store.charges``), set by the mover
            with the value it writes (for a placement).
        readers: references held (readers, and the mover while it copies the block).
        state: see :class:`State`.
        priority: retention priority of a ``PLACING`` entry, ``[0, 100]``.
        expires_at: when that priority reverts to the default (0.0: never), the store's clock.
        ttl_s: the TTL a ``PLACING`` entry is pinned with once published (0.0: none), seconds.
        until: when that TTL runs out, for a block moved between tiers (0.0: from its publication).
        done: a placing entry's future, made for the first concurrent put that waits for it (:meth:`wait`).
        ended: whether a placement has ended (published or discarded).
        owns_record: for a retired entry, whether its record is still in its tier, to be deleted
            with its last reference (a block moved out while readers held it); a deleted
            block's record goes at once (the tier keeps what a reader leased valid).
    """

    __slots__ = ("key", "level", "nbytes", "block_nbytes", "readers", "state", "priority", "expires_at", "ttl_s", "until",
                 "done",
                 "ended", "owns_record")

    def __init__(self, key: BlockKey, level: int, nbytes: int, state: State,
                 priority: int = 0, expires_at: float = 0.0, ttl_s: float = 0.0, until: float = 0.0) -> None:
        self.key = key
        self.level = level
        self.nbytes = nbytes
        self.block_nbytes = 0
        self.readers = 0
        self.state = state
        self.priority = priority
        self.expires_at = expires_at
        self.ttl_s = ttl_s
        self.until = until
        self.done: asyncio.Future[Exception | None] | None = None
        self.ended = False
        self.owns_record = False

    async def wait(self) -> Exception | None:
        """Wait until a placement has ended (published or discarded); returns the error that ended it, if any."""
        if self.ended:
            return None
        if self.done is None:
            self.done = asyncio.get_running_loop().create_future()
        return await self.done

    def __repr__(self) -> str:
        return f"Entry({self.key.hex()[:12]}..., level={self.level}, {self.state.value}, " \
               f"readers={self.readers})"


@dataclass(slots=True)
class PutStep:
    """What :meth:`Index.prepare_put` prepared for a put's keys.

    Attributes:
        positions: the positions (in the keys given) of the blocks to write now.
        entries: their ``PLACING`` entries, one per position.
        waits: placements of other puts in flight, to wait for before returning.
        again: positions of keys whose placement in flight a delete retired: this put is the newer, and
            places them again once that placement has ended (its stale record is discarded first).
        generation: the namespace's generation now (``Index.namespace_generation``), the first key's.
    """

    positions: list[int]
    entries: list[Entry]
    waits: list[Entry]
    again: list[int]
    generation: int


@dataclass(slots=True)
class ReadStep:
    """What :meth:`Index.prepare_read` prepared for a read: the located blocks, held.

    Attributes:
        levels: per block read, its local tier, or ``None`` for one to ask the shared tier for: the local
            prefix, then (with a shared tier) every later block.
        local: positions of the blocks held in a local tier (``held``, in the same order).
        wanted: positions of the blocks to ask the shared tier for.
        held: a reference on each local block.
        generation: the namespace's generation when the read was prepared.
    """

    levels: list[int | None]
    local: list[int]
    wanted: list[int]
    held: list[Entry]
    generation: int


class Index:
    """All block metadata of one store's local tiers; use from one event loop, and never across an ``await``.

    Args:
        policies: one eviction policy per local tier, fastest first (the index owns them from now on).
        capacities: capacity of each tier, bytes.
        clock: the store's clock, seconds (retentions end by it).
        held_bytes: per tier, a function giving the bytes the tier still holds for blocks already deleted
            (``LendingTier.held_bytes``: pages a loan still holds); they count as used.
        charge: bytes a block of a given length (as put) counts for in its namespace's
            :meth:`namespace_bytes`, whatever tier holds it (``kvstore.store.charges``); the length when ``None``.
        pin_limits: the bounds on pinned bytes.
        history_blocks: removals remembered to name misses (``kvstore.store.misses``, ``store.miss_history_blocks``).
    """

    def __init__(self, policies: Sequence[EvictionPolicy[BlockKey]], capacities: Sequence[int],
                 clock: Callable[[], float],
                 held_bytes: Sequence[Callable[[], int] | None] = (), charge: Callable[[int], int] | None = None, *,
                 pin_limits: PinLimits | None = None, history_blocks: int = 0) -> None:
        self.policies = list(policies)
        self.capacities = list(capacities)
        self._clock = clock
        self._tier_held = list(held_bytes) or [None] * len(self.policies)
        self._held: list[dict[BlockKey, Entry]] = [{} for _ in self.policies]  # resident entries with references
        self._placing: dict[BlockKey, Entry] = {}  # at most one placement of a key at a time
        self._placing_bytes = [0] * len(self.policies)
        self._leaving_bytes = [0] * len(self.policies)  # resident, claimed as victims, not yet gone
        self._leaving: list[set[BlockKey]] = [set() for _ in self.policies]
        self._retired_bytes = [0] * len(self.policies)
        self.charges = NamespaceCharges(charge)  # per namespace, its blocks' charges (tenant quotas)
        self._namespace_generations: dict[bytes, int] = {}
        self.observer: StoreObserver | None = None  # told of every change of residency (``kvstore.events``)
        self.logical = LogicalBytes(len(self.policies))  # blocks per tier and namespace, for logical bytes (stats)
        self.pins = Pins(self.policies, self.capacities, pin_limits or PinLimits())
        self.history: MissHistory[BlockKey] = MissHistory(history_blocks)
        self._unremember = self.history.forget

    # ------------------------------------------------------------------ reading

    def level_of(self, key: BlockKey) -> int | None:
        """The tier a key is resident in, ``None`` if none."""
        for level, policy in enumerate(self.policies):
            if key in policy:
                return level
        return None

    def locate(self, keys: Sequence[BlockKey]) -> bytes:
        """The tier of each block of the longest prefix of ``keys`` resident locally, one byte per block.

        Batched per tier (``contains_many``), and the common case, a prefix wholly
        in the top tier, never leaves C loops: Lookup of 1,024 hashes is a hot path.
        """
        policies = self.policies
        if not policies or not keys:
            return b""
        top = policies[0].contains_many(keys)
        if False not in top:
            return bytes(len(keys))
        start = top.index(False)
        rest = keys[start:]
        found = [top[start:], *(policy.contains_many(rest) for policy in policies[1:])]
        levels = bytearray(start)
        for hits in zip(*found):
            if True not in hits:
                break
            levels.append(hits.index(True))
        return bytes(levels)

    def resident_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether some local tier holds each key (C loops per tier: a lookup's missed blocks)."""
        policies = self.policies
        if not policies:
            return [False] * len(keys)
        found = policies[0].contains_many(keys)
        for policy in policies[1:]:
            found = list(map(or_, found, policy.contains_many(keys)))
        return found

    def levels_of(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The local tier of every key (not just a prefix), ``None`` where none holds it."""
        levels: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, policy in enumerate(self.policies):
            if not pending:
                break
            found = policy.contains_many([keys[i] for i in pending])
            for i, hit in zip(pending, found):
                if hit:
                    levels[i] = level
            pending = [i for i, hit in zip(pending, found) if not hit]
        return levels

    def placing(self, key: BlockKey) -> Entry | None:
        """The placement of ``key`` in flight, if any: ``PLACING``, or ``RETIRED`` by a delete while its write
        still runs (a newer put of the key waits for it to end, so that its stale record goes first)."""
        return self._placing.get(key)

    def held(self, level: int, key: BlockKey) -> Entry | None:
        """The entry of a resident block of tier ``level`` that has references, if any."""
        return self._held[level].get(key)

    def resident_keys(self, level: int) -> Iterator[BlockKey]:
        """Every key resident in tier ``level``, in the policy's order."""
        return iter(self.policies[level])

    def used_bytes(self, level: int) -> int:
        """Capacity bytes of tier ``level`` in use or promised: resident, being written, moved out but still read
        there, and deleted but still held by the tier for a reader (``held_bytes``)."""
        held = self._tier_held[level]
        return (self.policies[level].nbytes + self._placing_bytes[level] + self._retired_bytes[level]
                + (held() if held is not None else 0))

    def namespace_bytes(self, tag: bytes) -> int:
        """Charged bytes of the resident blocks of one namespace (by its tag) in local tiers: the same for a block
        in any tier, before and after a restart (``kvstore.store.charges``)."""
        return self.charges.namespace_bytes(tag)

    def namespace_generation(self, tag: bytes) -> int:
        """How many times this store cleared the namespace: a copy made under an older value is stale."""
        return self._namespace_generations.get(tag, 0)

    def num_entries(self) -> int:
        """Entries alive in the index: placements, and resident blocks with references (tests, drain)."""
        return len(self._placing) + sum(map(len, self._held))

    def is_current(self, entry: Entry) -> bool:
        """Whether an entry an operation prepared is still the index's: the one staleness check of every complete step.

        A delete, clear, eviction or move retires the entries it removes at
        once (``State.RETIRED``); a complete step that finds its entry retired
        discards its work (a placement its record, a read its repair of a lost record).
        """
        return entry.state is not State.RETIRED

    def cleared_since(self, tag: bytes, generation: int) -> bool:
        """Whether the namespace ``tag`` was cleared since its generation was ``generation``: the check of a copy
        that holds no entry (blocks read from the shared tier, a queued write-through)."""
        return self._namespace_generations.get(tag, 0) != generation

    def touch(self, keys: Sequence[BlockKey], levels: Sequence[int | None] | None = None) -> None:
        """Count resident ``keys`` as accessed, tail first, so that the chain's head ends the most recent.

        ``levels``: each key's tier where the caller knows it (``None`` for one in no local tier).
        """
        policies = self.policies
        if levels is None:
            for key in reversed(keys):
                level = self.level_of(key)
                if level is not None:
                    policies[level].touch(key)
            return
        for key, level in zip(reversed(keys), reversed(levels)):
            if level is not None and key in policies[level]:
                policies[level].touch(key)

    # ------------------------------------------------------------------ the steps of puts and reads

    def prepare_put(self, keys: Sequence[BlockKey], priority: int, expires_at: float, *,
                    touch: bool = True, ttl_s: float = 0.0) -> PutStep:
        """A put's prepare step: a ``PLACING`` entry for each key in no tier and no placement, nothing for the others.

        Args:
            keys: the put's keys, each once.
            priority: retention priority of the new blocks, ``[0, 100]``.
            expires_at: when it reverts to the default (0.0: never), the store's clock.
            touch: count the keys already resident as accessed (a put again is a use), tail first.
            ttl_s: the put's TTL (0.0: none): its new blocks are pinned with it once published, and with ``touch``
                the resident ones now (:meth:`pin`).

        Returns:
            A :class:`PutStep`. Its entries count against a tier's room once the
            mover charges them (:meth:`charge`); each ends with :meth:`complete_put`
            or :meth:`abandon`.
        """
        if touch:
            self.touch(keys)
            if ttl_s:
                self.pin(keys, ttl_s)
        positions: list[int] = []
        entries: list[Entry] = []
        waits: list[Entry] = []
        again: list[int] = []
        for i, key in enumerate(keys):
            if self.level_of(key) is not None:
                continue
            placing = self._placing.get(key)
            if placing is None:
                positions.append(i)
                entries.append(self.place(key, priority, expires_at, ttl_s))
                continue
            waits.append(placing)
            if not self.is_current(placing):
                again.append(i)
        generation = self.namespace_generation(keys[0][:NAMESPACE_TAG_BYTES]) if keys else 0
        return PutStep(positions, entries, waits, again, generation)

    def complete_put(self, entries: Sequence[Entry], written: Sequence[bool],
                     sources: Sequence[Entry] | None = None) -> tuple[list[BlockKey], list[BlockKey]]:
        """The complete step of a placement (a put's, or a copy's): publish each entry still current, tail first.

        Args:
            entries: placing entries, in prefix order.
            written: per entry, whether its tier stored it (a tier may refuse one, a damaged page).
            sources: for a move, the held resident entry each copy was made from: each source whose
                copy is current leaves its tier first (:meth:`retire`; tiers are exclusive). A source
                deleted meanwhile took its copy's placement with it (:meth:`delete`), and stays as it is.

        Returns:
            The keys published, in prefix order, and the keys whose records the
            caller must delete from the entries' tier: deleted or cleared while
            written, or refused by it (unless a newer entry of the key owns the record).
        """
        if sources is not None:
            for source, target, ok in zip(sources, entries, written):
                if ok and self.is_current(source) and self.is_current(target):
                    self.retire(source, reason="moved")
        published: list[BlockKey] = []
        stale: list[BlockKey] = []
        for entry, ok in zip(reversed(entries), reversed(written)):  # tail first: a chain's head ends the most recent
            if ok and self.publish(entry):
                published.append(entry.key)
            else:
                self.abandon(entry)
                if self.record_unneeded(entry):  # a record refused may be half-written: it goes too
                    stale.append(entry.key)
        published.reverse()
        return published, stale

    def prepare_read(self, keys: Sequence[BlockKey], shared: bool) -> ReadStep:
        """A read's prepare step: locate the cached prefix of ``keys`` and hold every local block of it.

        Args:
            keys: the read's keys, in prefix order.
            shared: whether a shared tier is below: then every block past the
                local prefix is located too (past a block in the shared tier the
                next may be local again), and those in no local tier are asked of it.
        """
        located = self.locate(keys)
        levels: list[int | None] = list(located)
        local = list(range(len(located)))
        held = [self.hold(level, key) for level, key in zip(located, keys)]
        wanted: list[int] = []
        if shared and len(located) < len(keys):
            for i, level in enumerate(self.levels_of(keys[len(located):]), len(located)):
                levels.append(level)
                if level is None:
                    wanted.append(i)
                else:
                    local.append(i)
                    held.append(self.hold(level, keys[i]))
        generation = self.namespace_generation(keys[0][:NAMESPACE_TAG_BYTES]) if keys else 0
        return ReadStep(levels, local, wanted, held, generation)

    def complete_read(self, step: ReadStep, keys: Sequence[BlockKey], hit: int,
                      lost: Sequence[Entry], ttl_s: float = 0.0) -> dict[int, list[BlockKey]]:
        """A read's complete step: forget the ``lost`` blocks (held ones their tier could not serve, or served unfit),
        those still current, and count the ``hit`` blocks of the prefix served as accessed, tail first (pinned
        with ``ttl_s`` when it is set: :meth:`pin`).

        Returns:
            The records of the lost blocks to delete, by tier. The references
            stay held: the read gives them back as it closes (:meth:`release`).
        """
        records: dict[int, list[BlockKey]] = {}
        for entry in lost:
            if self.is_current(entry) and self.forget(entry.level, entry.key, reason="lost"):
                records.setdefault(entry.level, []).append(entry.key)
        self.touch(keys[:hit], step.levels[:hit])
        if ttl_s:
            self.pin(keys[:hit], ttl_s)
        return records

    # ------------------------------------------------------------------ TTLs (pins) and sessions

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> None:
        """Give the resident ``keys`` (head first) a TTL of ``ttl_s`` seconds from now, tail first, each while
        :attr:`pins` allows; a key already pinned just takes the new TTL."""
        self.pins.pin(keys, ttl_s, self.level_of)

    def cool(self, chain: Sequence[BlockKey]) -> None:
        """A dead chain (head first, ``kvstore.policy.sessions``): its resident blocks go to the front of their
        tiers' eviction order, tail first, unpinned."""
        for policy in self.policies:
            policy.cool(chain)

    # ------------------------------------------------------------------ room

    def reserve(self, level: int, nbytes: int) -> list[BlockKey]:
        """Promise ``nbytes`` more in tier ``level``: returns the victims to move out first (claimed, in order).

        The victims stay resident, and readable, until the mover has moved them
        out (:meth:`retire`); each holds a reference for the mover meanwhile, so
        no other reservation claims them. The promise itself is the caller's
        placing entries (:meth:`place`), made next, with no await in between.

        Raises:
            NoRoomError: if the blocks not in use cannot make the room.
        """
        capacity = self.capacities[level]
        excess = self.used_bytes(level) - self._leaving_bytes[level] + nbytes - capacity
        if excess <= 0:
            return []
        policy = self.policies[level]
        victims = policy.victims(excess, self._clock())
        freed = sum(map(policy.size_of, victims))
        if freed < excess:
            raise NoRoomError(f"no room in tier {level}: {nbytes} bytes needed and the rest is in use")
        leaving = self._leaving[level]
        for key in victims:
            self.hold(level, key)
            leaving.add(key)
        self._leaving_bytes[level] += freed
        return victims

    def leaving(self, level: int, key: BlockKey) -> bool:
        """Whether a resident block is claimed as a victim, its eviction under way."""
        return key in self._leaving[level]

    def _unclaim(self, level: int, key: BlockKey, nbytes: int) -> None:
        leaving = self._leaving[level]
        if key in leaving:
            leaving.discard(key)
            self._leaving_bytes[level] -= nbytes

    # ------------------------------------------------------------------ placing and publishing

    def place(self, key: BlockKey, priority: int, expires_at: float, ttl_s: float = 0.0, until: float = 0.0) -> Entry:
        """Start writing ``key``: a ``PLACING`` entry, which a concurrent put of the key waits for.

        It counts against a tier's room once :meth:`charge` names the tier. With ``ttl_s`` it is pinned when
        published, until ``until`` (a moved block's own end) or for ``ttl_s`` from then.
        """
        assert key not in self._placing, key
        entry = Entry(key, -1, 0, State.PLACING, priority, expires_at, ttl_s, until)
        self._placing[key] = entry
        return entry

    def charge(self, entries: Sequence[Entry], level: int, sizes: Sequence[int]) -> None:
        """Count placing ``entries`` against the room of tier ``level``, ``sizes`` bytes each, where they are written."""
        for entry, nbytes in zip(entries, sizes):
            assert entry.level < 0 and entry.state is State.PLACING, entry
            entry.level, entry.nbytes = level, nbytes
            self._placing_bytes[level] += nbytes

    def uncharge(self, entries: Sequence[Entry]) -> None:
        """Undo :meth:`charge` of placing ``entries`` none of which was written: they may be charged to another tier."""
        for entry in entries:
            if entry.level >= 0 and self._placing.get(entry.key) is entry:
                self._placing_bytes[entry.level] -= entry.nbytes
            entry.level, entry.nbytes = -1, 0

    def publish(self, entry: Entry) -> bool:
        """Make a placement resident, if it is still the current one; whether it was (else the write is stale).

        A stale placement (removed by a delete or clear while it was written)
        needs its record discarded: :meth:`record_unneeded` says whether.
        """
        self._end_placing(entry)
        if not self.is_current(entry):
            return False
        level, key = entry.level, entry.key
        assert level >= 0 and self.level_of(key) is None, (entry, self.level_of(key))  # a move retires its source first
        ttl_s = entry.ttl_s
        if ttl_s and (entry.until and entry.until <= self._clock() or not self.pins.allow(level, key, entry.nbytes)):
            ttl_s = 0.0  # refused as a pin, not as a block
        self.policies[level].insert(key, entry.nbytes, entry.priority, entry.expires_at, ttl_s, entry.until)
        self._unremember(key)  # stored again: its removal names nothing now (``MissHistory.forget``)
        self.charges.added(key, entry.block_nbytes)
        self.logical.added(level, key)
        entry.state = State.RESIDENT
        if self.observer is not None:
            self.observer.stored(level, key)
        return True

    def abandon(self, entry: Entry, error: Exception | None = None) -> None:
        """End a placement that is not published (its write failed, was skipped or went stale).

        Args:
            entry: the placing entry.
            error: what a concurrent put waiting for it raises (``None``: nothing; it just returns).
        """
        self._end_placing(entry, error)
        entry.state = State.RETIRED

    def _end_placing(self, entry: Entry, error: Exception | None = None) -> None:
        if self._placing.get(entry.key) is entry:
            del self._placing[entry.key]
            if entry.level >= 0:
                self._placing_bytes[entry.level] -= entry.nbytes
        entry.ended = True
        if entry.done is not None and not entry.done.done():
            entry.done.set_result(error)

    # ------------------------------------------------------------------ references

    def hold(self, level: int, key: BlockKey) -> Entry:
        """Take a reference on the resident block ``key`` of tier ``level``; it is no victim until released.

        The references are counted here, and only here (``Entry.readers``): the
        first takes the block out of its policy's eviction order
        (``EvictionPolicy.hold``), and the last puts it back (:meth:`release`).
        """
        held = self._held[level]
        entry = held.get(key)
        if entry is None:
            policy = self.policies[level]
            entry = Entry(key, level, policy.size_of(key), State.RESIDENT)
            held[key] = entry
            policy.hold(key)
        entry.readers += 1
        return entry

    def release(self, entry: Entry) -> bool:
        """Give back one reference; whether the caller must now delete the block's record.

        That is so for the last reference of a block moved out while it was
        read (``owns_record``), unless a newer entry of the key owns the record
        by now (:meth:`record_unneeded`).
        """
        entry.readers -= 1
        if entry.readers:
            return False
        if entry.state is State.RESIDENT:
            if self._held[entry.level].get(entry.key) is entry:
                del self._held[entry.level][entry.key]
                self.policies[entry.level].release(entry.key)
            return False
        if not entry.owns_record:
            return False
        entry.owns_record = False
        self._retired_bytes[entry.level] -= entry.nbytes
        return self.record_unneeded(entry)

    def release_all(self, entries: Sequence[Entry]) -> dict[int, list[BlockKey]]:
        """:meth:`release` of one reference on each of ``entries``, tail first (blocks held head first return
        with the head the most recent); returns the records whose last reference this was, by tier, for the
        caller to delete (``kvstore.store.records``)."""
        records: dict[int, list[BlockKey]] = {}
        for entry in reversed(entries):
            if self.release(entry):
                records.setdefault(entry.level, []).append(entry.key)
        return records

    def record_unneeded(self, entry: Entry) -> bool:
        """Whether the record a gone entry leaves in its tier should be deleted: not if a newer entry of the key
        lives in that tier (resident or being written), whose record it is, or will be, by the tier's write order."""
        key, level = entry.key, entry.level
        if level < 0:
            return False  # never written
        if key in self.policies[level]:
            return False
        placing = self._placing.get(key)
        return placing is None or placing.level != level

    # ------------------------------------------------------------------ removing

    def forget(self, level: int, key: BlockKey, *, keep_record: bool = False, reason: str = "evicted",
               cause: str | None = None) -> bool:
        """Remove the resident block ``key`` from tier ``level``; whether the caller deletes its record now.

        A block with references is retired. With ``keep_record`` (a block moved
        out) its record stays, and its bytes count, until the last reference
        goes, for readers still reading it there (:meth:`release`); otherwise (a
        delete) the record goes now, and the tier keeps what a reader leased
        (its ``held_bytes``).

        The removal is remembered in :attr:`history` (to name a later miss), as ``cause`` when given (``dropped``,
        or ``shared`` for one that left for the shared tier), else by ``reason``: ``evicted`` (``expired`` if its
        TTL had run out), ``lost``, ``deleted`` or ``cleared``; a block ``moved`` to another tier is not.
        """
        policy = self.policies[level]
        if key not in policy:
            return False
        entry = self._held[level].pop(key, None)
        nbytes = policy.size_of(key) if entry is None else entry.nbytes
        self._unclaim(level, key, nbytes)
        if reason != "moved" and self.history.capacity:
            self._remember(level, key, policy, reason, cause)
        policy.remove(key)  # held or not: a hold ends with the block
        self.charges.removed(key)
        self.logical.removed(level, key)
        if self.observer is not None:
            self.observer.removed(level, key, reason)  # a ``kvstore.events.schema`` REMOVED_* reason
        if entry is None:
            return True
        entry.state = State.RETIRED
        entry.owns_record = keep_record
        if keep_record:
            self._retired_bytes[level] += entry.nbytes
        return not keep_record

    def _remember(self, level: int, key: BlockKey, policy: EvictionPolicy[BlockKey], reason: str,
                  cause: str | None) -> None:
        """Record a removal in :attr:`history` (see :meth:`forget`)."""
        shared = cause == "shared"
        if cause is None or shared:
            cause = {"evicted": EVICTED, "lost": LOST}.get(reason, DELETED)
            if cause == EVICTED and policy.ttl_ran_out(key):
                cause = EXPIRED
        self.history.record(key, cause, self._clock(), level, policy.priority_of(key), shared)

    def retire(self, entry: Entry, reason: str = "evicted", cause: str | None = None) -> None:
        """Remove a held resident entry that the mover has moved out (or dropped); its record goes with the last
        reference (:meth:`release`), so readers still reading it in this tier finish. ``cause``: as :meth:`forget`."""
        if entry.state is State.RESIDENT and self._held[entry.level].get(entry.key) is entry:
            self.forget(entry.level, entry.key, keep_record=True, reason=reason, cause=cause)

    def delete(self, keys: Iterable[BlockKey], reason: str = "deleted") -> tuple[dict[int, list[BlockKey]], int]:
        """Remove ``keys`` from every tier and every placement under way.

        The entries go at once, so a copy or put of them in flight loses at its
        complete step. A placement whose write is under way stays, retired,
        until that step: a newer put of the key waits for it, so that the stale
        record is discarded before the new one is written.

        Returns:
            The records to delete now, by tier, and how many keys were resident.
        """
        records: dict[int, list[BlockKey]] = {}
        found = 0
        for key in keys:
            placing = self._placing.get(key)
            if placing is not None:
                if placing.level < 0:  # nothing written yet: it just ends
                    self.abandon(placing)
                else:  # its write runs on: it stays, retired, until its owner discards what it wrote
                    placing.state = State.RETIRED
            level = self.level_of(key)
            if level is not None:
                found += 1
                if self.forget(level, key, reason=reason):
                    records.setdefault(level, []).append(key)
        return records, found

    def clear(self, tag: bytes) -> tuple[dict[int, list[BlockKey]], int]:
        """:meth:`delete` of every block of one namespace, and a new generation for it (:meth:`namespace_generation`)."""
        self._namespace_generations[tag] = self.namespace_generation(tag) + 1
        keys = [key for policy in self.policies for key in policy if key.startswith(tag)]
        keys += [key for key in self._placing if key.startswith(tag)]
        if self.observer is not None:
            self.observer.cleared(tag)
        return self.delete(keys, reason="cleared")
