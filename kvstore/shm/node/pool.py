"""The shared pool: a node's memory tier in shared memory, which clients on its host read in place.

``kvstore serve`` with the same-host data plane on keeps its memory tier here
instead of on its heap (``kvstore.tiers.heap``). Blocks live in **slabs**:
sealed ``memfd`` segments of the node (:mod:`kvstore.shm.segment`), each of
which holds blocks of **one namespace only** (its 8-byte tag). A same-host
Get then hands the client the slab and the offset of each block of the
prefix (the slab's descriptor comes with the reply the first time), the
client maps the slab read-only and copies each block straight into its
tensors: one copy per hit, and the node copies nothing (Mooncake Store's
shared-memory mode and LMCache's multiprocess mode work the same way).

Tenants stay apart because a namespace is a tenant's: the node checks a
call's namespace against the caller's token before it names a slab, so a
client is only ever handed slabs of namespaces it may read.

Nothing but the node can write a stored block. Each slab is mapped writable
by the node before it is sealed with ``F_SEAL_FUTURE_WRITE`` (no new writable
mapping and no ``write(2)``, by anyone, root included) and made mode ``0400``;
clients receive a descriptor reopened ``O_RDONLY``. A Put is copied into a
slab by the node (:meth:`SharedPool.stage`: the client stages its blocks in
its own put segment, the node copies each one into a staged range and checks
its copy there, and the store then places that copy without copying it
again). Writing into fresh ``memfd`` pages and sealing them after the client
wrote them was measured as the alternative and costs 7-12x a copy in page
faults on this kind of machine (``benchmarks/results/bench_shm.md``).

Ranges are never reused under a reader: a loan (:meth:`SharedPool.lend`)
pins the ranges it lends; a block deleted, replaced or evicted while pinned
keeps its range until the last pin goes (:attr:`SharedPool.held_bytes`).

Memory. Each block takes its length rounded up to :data:`ALIGNMENT` bytes
(:meth:`SharedPool.footprint`). Slabs are made as a namespace needs room; they
are sparse (pages are allocated as they are written) and ranges are handed out
first fit from a slab's start, so what a slab takes is its **touched** bytes,
its highest range ever used rounded up to a page. A sealed slab cannot give
pages back, so the touched bytes of every slab together are held under the
capacity plus room for the puts being staged (:attr:`SharedPool.touched_limit_bytes`).
An empty slab is kept for its namespace, and **retired** when another
namespace needs the room; a slab whose blocks take under half of what it
touched is **compacted** then (its blocks copied into a new slab of their
namespace, and it retired). A retired slab's id is never used again, and the
node tells each client that mapped it to unmap it (``GetSharedResponse.retired_slabs``).

Every method runs on the store's event loop, which owns the records and the
ranges (no locks); the copies of a put run where the caller runs them.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Awaitable, NamedTuple, Sequence

import numpy as np

from kvstore.api import Buffer
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.shm.allocator import RangeAllocator
from kvstore.shm.segment import Segment
from kvstore.tiers.base import BlockMeta, ResidentEntry, TierFullError, TierLoan, done, put_order

logger = logging.getLogger(__name__)

ALIGNMENT = 64
"""Alignment of each block in a slab, bytes: a cache line, and every dtype's item size."""

MAX_SLAB_BYTES = 64 << 20
"""The largest size of a slab, bytes; a pool of under 32 times this has slabs of a 32nd of its capacity (at least
:data:`MIN_SLAB_BYTES`), and a block larger than a slab gets a slab of its own size."""
MIN_SLAB_BYTES = 1 << 20
"""The smallest size of a slab, bytes."""
PAGE_BYTES = 4096
"""What a slab's touched bytes are rounded up to, bytes (a page)."""


def footprint(nbytes: int) -> int:
    """Bytes of the pool's capacity a block of ``nbytes`` takes: ``nbytes`` rounded up to :data:`ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def slab_bytes_for(capacity_bytes: int) -> int:
    """The size of a pool's slabs for its capacity (:data:`MAX_SLAB_BYTES`), bytes."""
    size = min(MAX_SLAB_BYTES, max(MIN_SLAB_BYTES, capacity_bytes // 32))
    return -(-size // PAGE_BYTES) * PAGE_BYTES


class Place(NamedTuple):
    """Where a block lies in the pool: its slab's id and its offset in the slab, bytes."""

    slab_id: int
    offset: int


class _Record(NamedTuple):
    slab_id: int
    offset: int
    nbytes: int
    meta: BlockMeta


class Slab:
    """One sealed ``memfd`` segment of the pool, holding blocks of one namespace.

    Attributes:
        slab_id: its number, never reused on this node.
        tag: the namespace tag of every block it holds.
        segment: the segment (the node's writable mapping; ``F_SEAL_FUTURE_WRITE`` where ``seal`` was asked).
        ranges: its byte ranges in use (blocks stored, staged, or held by a pin) and free.
        view: a read-only ``memoryview`` of the whole slab (what leases slice).
        array: a writable ``uint8`` array over the node's mapping (what the node copies into).
        touched: the end of its highest range ever used, rounded up to a page: the bytes it takes, bytes.
        keys: the keys of the blocks stored in it.
        live_bytes: the bytes of those blocks.
    """

    __slots__ = ("slab_id", "tag", "segment", "ranges", "view", "array", "touched", "keys", "live_bytes")

    def __init__(self, slab_id: int, tag: bytes, nbytes: int, *, seal: bool) -> None:
        self.slab_id = slab_id
        self.tag = tag
        self.touched = 0
        self.keys: set[BlockKey] = set()
        self.live_bytes = 0
        self.segment = Segment.create(f"kvstore-pool-{slab_id:x}", nbytes, writable=True,
                                      read_only_to_others=True, seal_writes=seal)
        self.ranges = RangeAllocator(nbytes, ALIGNMENT)
        self.view = self.segment.view.toreadonly()
        self.array = np.frombuffer(self.segment.view, dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        """The slab's size, bytes."""
        return self.segment.nbytes

    @property
    def empty(self) -> bool:
        """Whether no range of it is in use."""
        return self.ranges.num_ranges == 0

    def read_only_fd(self) -> int:
        """A new descriptor of the slab, open read-only, to hand to a client (the caller closes it once sent)."""
        return self.segment.read_only_fd()

    def close(self) -> None:
        """Close the node's descriptor; the mapping goes with the last view of it."""
        self.segment.close()


@dataclass(slots=True)
class PoolCounts:
    """What the pool counts since start (``kvstore stats`` shows them with the tier)."""

    slabs_made: int = 0
    slabs_retired: int = 0
    slabs_compacted: int = 0
    touched_over_limit: int = 0
    staged_blocks: int = 0
    staged_adopted: int = 0
    staging_no_room: int = 0


class Staging:
    """Ranges of the pool reserved for one put's blocks (:meth:`SharedPool.stage`).

    The node copies each block into :attr:`targets` and checks its copy there;
    the store is then given :attr:`blocks` (read-only views of the same
    ranges), which the pool stores without copying (:meth:`SharedPool.put`).
    :meth:`close`, once the store's put has ended, frees every range the pool
    did not take (a block already stored, or placed in a lower tier).

    Attributes:
        blocks: per block, a read-only view of its range.
        targets: per block, a writable ``uint8`` array over its range (the node's mapping).
        places: per block, its slab and offset.
    """

    __slots__ = ("_pool", "blocks", "targets", "places", "_closed")

    def __init__(self, pool: SharedPool, blocks: list[memoryview], targets: list[np.ndarray],
                 places: list[Place]) -> None:
        self._pool = pool
        self.blocks = blocks
        self.targets = targets
        self.places = places
        self._closed = False

    def close(self) -> None:
        """Free the ranges the pool did not take; idempotent. Call it only once nothing reads the blocks."""
        if not self._closed:
            self._closed = True
            self._pool.unstage(self)


class SharedPool:
    """Encoded blocks in sealed shared-memory slabs, one namespace per slab (see the module docstring).

    Implements :class:`kvstore.tiers.base.LendingTier`, lending views it pins.
    It never evicts: a put that does not fit raises :class:`TierFullError` and
    stores nothing of its batch. The last writer of a key wins.

    Args:
        capacity_bytes: bytes the tier may hold, each block counted as :meth:`footprint`.
        slab_bytes: the size of a slab, bytes; ``None``: :func:`slab_bytes_for` the capacity.
        seal: seal slabs with ``F_SEAL_FUTURE_WRITE`` (``False`` only for a platform without it).
        name: tier name in stats and metrics.

    Raises:
        InvalidArgumentError: on a negative capacity or a slab size that is not a positive multiple of
            :data:`ALIGNMENT`.
    """

    persistent = False
    lends_references = False  # views of ranges the pool reuses: the store holds what it reads

    def __init__(self, capacity_bytes: int, *, slab_bytes: int | None = None, seal: bool = True,
                 name: str = "memory") -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        slab_bytes = slab_bytes_for(capacity_bytes) if slab_bytes is None else slab_bytes
        if slab_bytes <= 0 or slab_bytes % PAGE_BYTES:
            raise InvalidArgumentError(f"slab_bytes must be a positive multiple of {PAGE_BYTES}, got {slab_bytes}")
        self.name = name
        self.capacity_bytes: int | None = capacity_bytes
        self.slab_bytes = slab_bytes
        self.touched_limit_bytes = capacity_bytes + max(2 * slab_bytes, capacity_bytes // 8)
        """The most bytes every slab together may have touched: the capacity, and room to stage puts beyond it."""
        self._seal = seal
        self._records: dict[BlockKey, _Record] = {}
        self._slabs: dict[int, Slab] = {}
        self._groups: dict[bytes, list[Slab]] = {}  # namespace tag -> its slabs
        self._pins: dict[tuple[int, int], int] = {}  # (slab, offset) -> readers holding it
        self._zombies: dict[tuple[int, int], int] = {}  # pinned ranges of blocks gone -> their sizes
        self._staged: dict[int, tuple[memoryview, Place, int]] = {}  # id(view) -> (view, place, nbytes)
        self._stored_bytes = 0
        self._slab_total = 0  # sizes of the slabs
        self._touched = 0  # touched bytes of the slabs
        self._next_slab = 1
        self._closed = False
        self.counts = PoolCounts()
        logger.info("shared pool %s: %s bytes in slabs of %s", name, capacity_bytes, slab_bytes)

    # -- accounting ---------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` takes: ``nbytes`` rounded up to :data:`ALIGNMENT` (:func:`footprint`)."""
        return footprint(nbytes)

    @property
    def used_bytes(self) -> int:
        """Capacity bytes the stored blocks take."""
        return self._stored_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks deleted or replaced that a pin still holds (freed at its release)."""
        return sum(self._zombies.values())

    @property
    def num_blocks(self) -> int:
        """Blocks stored."""
        return len(self._records)

    @property
    def touched_bytes(self) -> int:
        """Bytes the slabs take: the touched bytes of every slab not retired (their pages are resident)."""
        return self._touched

    def counters(self) -> dict[str, int]:
        """Event counts since start, and the slabs now (``corrupt_records`` stays 0: memory is trusted)."""
        return {"corrupt_records": 0, "slabs": len(self._slabs), "slab_bytes": self._slab_total,
                "slab_touched_bytes": self._touched, "slabs_made": self.counts.slabs_made,
                "slabs_retired": self.counts.slabs_retired, "slabs_compacted": self.counts.slabs_compacted,
                "touched_over_limit": self.counts.touched_over_limit,
                "staged_blocks": self.counts.staged_blocks, "staged_adopted": self.counts.staged_adopted,
                "staging_no_room": self.counts.staging_no_room}

    # -- slabs --------------------------------------------------------------------

    def slab(self, slab_id: int) -> Slab | None:
        """The slab ``slab_id`` while it lives; ``None`` once retired (or never made)."""
        return self._slabs.get(slab_id)

    def _allocate(self, tag: bytes, nbytes: int, *, strict: bool = True) -> tuple[Slab, int] | None:
        """A range of ``nbytes`` in a slab of namespace ``tag``, under the touched limit: in one of its slabs, else
        in a new one; empty slabs of other namespaces are retired, and sparse ones compacted, to make room.

        Args:
            strict: ``False`` for a block the store has made room for (a put within the capacity): if the limit
                still leaves no room (ranges pinned by leases, fragments), the slabs touch more than it
                (``touched_over_limit`` counts these), rather than refusing a block the tier has room for.
        """
        found = self._take(tag, nbytes)
        if found is None and self._retire_empty():
            found = self._take(tag, nbytes)
        if found is None and self._compact():
            found = self._take(tag, nbytes)
        if found is None and not strict:
            found = self._take(tag, nbytes, limit=sys.maxsize)
            self.counts.touched_over_limit += 1
        return found

    def _take(self, tag: bytes, nbytes: int, *, limit: int | None = None) -> tuple[Slab, int] | None:
        limit = self.touched_limit_bytes if limit is None else limit
        for slab in self._groups.get(tag, ()):
            offset = slab.ranges.allocate(nbytes)
            if offset is None:
                continue
            grown = max(0, _pages(offset + nbytes) - slab.touched)
            if self._touched + grown > limit:
                slab.ranges.free(offset)
                continue
            slab.touched += grown
            self._touched += grown
            return slab, offset
        if self._touched + _pages(nbytes) > limit:
            return None
        size = self.slab_bytes if nbytes <= self.slab_bytes else _pages(nbytes)
        slab = Slab(self._next_slab, tag, size, seal=self._seal)
        self._next_slab += 1
        self._slabs[slab.slab_id] = slab
        self._groups.setdefault(tag, []).append(slab)
        self._slab_total += size
        self.counts.slabs_made += 1
        offset = slab.ranges.allocate(nbytes)
        assert offset == 0
        slab.touched = _pages(nbytes)
        self._touched += slab.touched
        return slab, offset

    def _retire_empty(self) -> bool:
        """Retire every empty slab; whether there was one."""
        empty = [slab for slab in self._slabs.values() if slab.empty]
        for slab in empty:
            self._retire(slab)
        return bool(empty)

    def _compact(self) -> bool:
        """Copy the blocks of the slab that wastes the most into a new slab of their namespace, and retire it.

        Only a slab whose blocks take under half of its touched bytes, and each
        of whose ranges in use is a stored block (none pinned, staged, or
        taken by a put under way), is compacted. Whether one was.
        """
        pinned = {where[0] for where in self._pins}
        candidates = [slab for slab in self._slabs.values()
                      if slab.live_bytes * 2 < slab.touched and slab.ranges.num_ranges == len(slab.keys)
                      and slab.slab_id not in pinned]
        if not candidates:
            return False
        source = max(candidates, key=lambda slab: slab.touched - slab.live_bytes)
        group = self._groups[source.tag]
        group.remove(source)  # its blocks go to other slabs of the namespace, or a new one
        try:
            for key in sorted(source.keys, key=lambda k: self._records[k].offset):
                record = self._records[key]
                found = self._take(source.tag, record.nbytes, limit=self._touched + _pages(record.nbytes))
                assert found is not None  # the limit given is met by a new slab at worst
                slab, offset = found
                slab.array[offset:offset + record.nbytes] = source.array[record.offset:record.offset + record.nbytes]
                self._records[key] = record._replace(slab_id=slab.slab_id, offset=offset)
                slab.keys.add(key)
                slab.live_bytes += record.nbytes
                source.ranges.free(record.offset)
        finally:
            group.append(source)
        source.keys.clear()
        source.live_bytes = 0
        self._retire(source)
        self.counts.slabs_compacted += 1
        return True

    def _retire(self, slab: Slab) -> None:
        del self._slabs[slab.slab_id]
        group = self._groups[slab.tag]
        group.remove(slab)
        if not group:
            del self._groups[slab.tag]
        self._slab_total -= slab.nbytes
        self._touched -= slab.touched
        self.counts.slabs_retired += 1
        slab.close()
        logger.debug("shared pool %s: slab %d retired", self.name, slab.slab_id)

    def _free(self, slab_id: int, offset: int) -> None:
        """Give a range back now, or when its last pin goes; an empty slab stays for its namespace."""
        where = (slab_id, offset)
        if where in self._pins:
            slab = self._slabs[slab_id]
            self._zombies[where] = slab.ranges.size_of(offset) or 0
            return
        self._slabs[slab_id].ranges.free(offset)

    # -- staging a put ------------------------------------------------------------------

    def stage(self, tag: bytes, sizes: Sequence[int]) -> Staging | None:
        """Reserve a range for each block of a put of namespace ``tag``, for the node to copy them into.

        Args:
            tag: the put's namespace tag (``Namespace.tag``).
            sizes: each block's encoded length, bytes (> 0).

        Returns:
            The staged ranges, or ``None`` (nothing reserved) when the pool has no room for them now, or the put
            is over half the capacity (more than the tier would keep of it): the put's blocks are then copied as
            any other put's.

        Raises:
            UnavailableError: if the pool is closed.
        """
        self._check_open()
        if sum(self.footprint(n) for n in sizes) * 2 > (self.capacity_bytes or 0):
            self.counts.staging_no_room += 1
            return None
        taken: list[tuple[Slab, int]] = []
        for nbytes in sizes:
            found = self._allocate(tag, nbytes) if nbytes > 0 else None
            if found is None:
                for slab, offset in taken:
                    slab.ranges.free(offset)
                self.counts.staging_no_room += 1
                return None
            taken.append(found)
        blocks, targets, places = [], [], []
        for (slab, offset), nbytes in zip(taken, sizes):
            view = slab.view[offset:offset + nbytes]
            place = Place(slab.slab_id, offset)
            blocks.append(view)
            targets.append(slab.array[offset:offset + nbytes])
            places.append(place)
            self._staged[id(view)] = (view, place, nbytes)
        self.counts.staged_blocks += len(sizes)
        return Staging(self, blocks, targets, places)

    def unstage(self, staging: Staging) -> None:
        """Free the ranges of ``staging`` the pool did not take (:meth:`Staging.close` calls it)."""
        for view, place in zip(staging.blocks, staging.places):
            entry = self._staged.pop(id(view), None)
            if entry is not None and entry[0] is view and place.slab_id in self._slabs:
                self._free(*place)

    def _adopt(self, value: object) -> tuple[Place, int] | None:
        """The place and length of ``value`` when it is one of this pool's staged views (taken now), else ``None``."""
        entry = self._staged.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        del self._staged[id(value)]
        return entry[1], entry[2]

    # -- the Tier protocol --------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored."""
        self._check_open()
        records = self._records
        return [key in records for key in keys]

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Each key's value as ``bytes`` of its own (a copy), or ``None`` for a miss.

        Raises:
            UnavailableError: if the pool is closed.
        """
        self._check_open()
        out: list[bytes | None] = []
        for key in keys:
            record = self._records.get(key)
            out.append(None if record is None
                       else bytes(self._slabs[record.slab_id].view[record.offset:record.offset + record.nbytes]))
        return out

    def lend(self, keys: Sequence[BlockKey]) -> TierLoan:
        """Read-only views of each key's value, pinned until ``release``, with each block's :class:`Place`.

        ``places[i]`` is ``None`` for a miss. The views stay valid (their ranges
        are not reused) until ``release`` is called, whatever happens to the
        blocks meanwhile.

        Raises:
            UnavailableError: if the pool is closed.
        """
        self._check_open()
        values: list[Buffer | None] = []
        places: list[Place | None] = []
        pinned: list[tuple[int, int]] = []
        pins, slabs = self._pins, self._slabs
        for key in keys:
            record = self._records.get(key)
            if record is None:
                values.append(None)
                places.append(None)
                continue
            where = (record.slab_id, record.offset)
            pins[where] = pins.get(where, 0) + 1
            pinned.append(where)
            values.append(slabs[record.slab_id].view[record.offset:record.offset + record.nbytes])
            places.append(Place(*where))
        return TierLoan(values, lambda: self._unpin(pinned), places=places)

    def _unpin(self, pinned: list[tuple[int, int]]) -> None:
        pins = self._pins
        for where in pinned:
            left = pins[where] - 1
            if left:
                pins[where] = left
                continue
            del pins[where]
            if where in self._zombies:
                del self._zombies[where]
                slab = self._slabs.get(where[0])
                if slab is not None:
                    slab.ranges.free(where[1])

    async def put(self, keys: Sequence[BlockKey], values: Sequence[Buffer], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value with its meta, replacing any value held under the same key.

        A value that is one of this pool's staged views (:meth:`stage`) is
        stored where it lies, with no copy; any other value is copied into a
        range of a slab of its key's namespace.

        Returns:
            ``True`` for every key.

        Raises:
            InvalidArgumentError: if the three sequences differ in length, a priority is outside ``[0, 100]``,
                or a value is not bytes-like.
            TierFullError: if a value finds no room; nothing of the batch is stored.
            UnavailableError: if the pool is closed.
        """
        self._check_open()
        order = put_order(keys, values, metas)
        need = sum(self.footprint(_nbytes(values[i])) for i in order)
        freed = sum(self.footprint(r.nbytes) for r in (self._records.get(keys[i]) for i in order) if r is not None)
        free = (self.capacity_bytes or 0) - self._stored_bytes  # never None here: set at init
        if need > free + freed:
            raise TierFullError(f"shared pool {self.name}: batch needs {need} bytes, {free} free")
        placed: list[tuple[int, Place, int, bool]] = []  # (position, place, nbytes, staged)
        try:
            for i in order:
                adopted = self._adopt(values[i])
                if adopted is not None:
                    placed.append((i, adopted[0], adopted[1], True))
                    self.counts.staged_adopted += 1
                    continue
                nbytes = _nbytes(values[i])
                found = self._allocate(keys[i][:NAMESPACE_TAG_BYTES], nbytes, strict=False)
                if found is None:
                    raise TierFullError(f"shared pool {self.name}: no room for a block of {nbytes} bytes "
                                        f"({self._touched} bytes of slabs touched, limit {self.touched_limit_bytes})")
                placed.append((i, Place(found[0].slab_id, found[1]), nbytes, False))
        except BaseException:
            for _, place, _, staged in placed:
                if not staged:
                    self._slabs[place.slab_id].ranges.free(place.offset)
            raise
        for i, place, nbytes, staged in placed:  # every range is taken: copy, then publish
            if not staged:
                target = self._slabs[place.slab_id].array[place.offset:place.offset + nbytes]
                np.copyto(target, np.frombuffer(values[i], dtype=np.uint8))
        for i, place, nbytes, _ in placed:
            key = keys[i]
            old = self._records.get(key)
            if old is not None:
                self._unrecord(key, old)
            self._records[key] = _Record(place.slab_id, place.offset, nbytes, metas[i])
            slab = self._slabs[place.slab_id]
            slab.keys.add(key)
            slab.live_bytes += nbytes
            self._stored_bytes += self.footprint(nbytes)
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key; missing keys are ignored. A pinned block's range is freed at its last release.

        Raises:
            UnavailableError: if the pool is closed.
        """
        self._check_open()
        for key in keys:
            record = self._records.pop(key, None)
            if record is not None:
                self._unrecord(key, record)
        return done()

    def _unrecord(self, key: BlockKey, record: _Record) -> None:
        """Forget a stored block's place: its bytes uncounted, its range freed (at its last pin, if pinned)."""
        slab = self._slabs[record.slab_id]
        slab.keys.discard(key)
        slab.live_bytes -= record.nbytes
        self._stored_bytes -= self.footprint(record.nbytes)
        self._free(record.slab_id, record.offset)

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta (the pool is empty after a restart)."""
        self._check_open()
        return [ResidentEntry(key, r.nbytes, r.meta) for key, r in self._records.items()]

    async def close(self) -> None:
        """Drop every block and close every slab; idempotent. Clients' mappings stay valid until they unmap."""
        if self._closed:
            return
        self._closed = True
        self._records.clear()
        self._staged.clear()
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()
        self._groups.clear()
        self._stored_bytes = self._slab_total = self._touched = 0
        logger.info("shared pool %s closed", self.name)

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"shared pool {self.name} is closed")


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`PAGE_BYTES`."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def _nbytes(value: Buffer) -> int:
    try:
        return memoryview(value).nbytes
    except TypeError:
        raise InvalidArgumentError(f"a value must be bytes-like, got {type(value).__name__}") from None
