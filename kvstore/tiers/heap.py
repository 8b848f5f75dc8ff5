"""The heap tier: host memory where each block is one immutable ``bytes`` object, stored in the server's framing.

The page pool (``kvstore.tiers.memory``) suits a process that moves blocks to
and from a GPU: its pages are preallocated, can be pinned, and never fragment.
A ``kvstore serve`` node does something else with its blocks: it hands them to
grpcio, which takes a ``bytes`` object per message and copies it once into its
own buffers. Lent from the pool, each block is first copied into such an object,
which costs as much as a tenth of a 2 MiB Get (``benchmarks/bench_service.py``).
This tier stores each block already as that object, in a **framing** the server
chooses and passes in (:data:`~kvstore.tiers.base.Framing`): ``kvstore serve``
frames a block as the ``BlockChunk`` reply that carries it, a few bytes of head
written once at put time (``kvstore.wire.reply_head``), the way a network stack
keeps headroom in front of a packet's payload. A Get then sends the stored
object as is, and the copy the node pays for is the one grpcio makes, as for any
``bytes`` reply. The tier itself knows nothing of gRPC.

Blocks the framing leaves bare (over the node's chunk size), and every block of
a tier built without a framing, are stored bare: a put of a ``bytes`` object
then keeps that object itself, with no copy. Memory comes from the
process's allocator; the tier counts each block's length plus
:data:`BLOCK_OVERHEAD_BYTES` against its capacity.

Loans. A ``bytes`` object cannot change, and lives as long as a reference to
it does, so a loan here is just that reference: the tier lends by reference
(:attr:`HeapTier.lends_references`), the store does not pin what it reads from
it, and nothing is given back at the release. Eviction may thus take a block a
Get is still sending; its memory is then freed when that Get ends, and until
then it is not counted in :attr:`HeapTier.used_bytes`. That excess is the
blocks of the Gets in flight, which ``limits.max_inflight_per_connection``
bounds per connection and ``limits.max_stream_s`` in time.

Read-only. What the tier hands out (by :meth:`HeapTier.get` and in a loan)
is the stored ``bytes`` or a read-only view of it, never memory a caller can
write; ``kvstore.blocks.tensors.decode_block`` copies such memory into a tensor of its
own, so no tensor a caller writes reaches a stored block (``torch.frombuffer``
alone would give a writable tensor over the ``bytes``).

Every method is called from the store's one asyncio loop and none suspends, so
a put is published whole or not at all. Joining a block behind its head holds
the GIL (a ``bytes`` join does not release it), so unlike the page pool this
tier has no worker threads: a 4 MiB put costs the loop about a millisecond.
Checksums are not verified on reads (blocks were verified on the way in), so
``corrupt_records`` stays 0.
"""

from __future__ import annotations

import logging
from typing import Awaitable, NamedTuple, Sequence

from kvstore.config import MemoryTierConfig
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, Buffer, Framing, ResidentEntry, TierFullError, TierLoan, done, put_order

logger = logging.getLogger(__name__)

BLOCK_OVERHEAD_BYTES = 64
"""Capacity a block takes beyond its own length, bytes: the ``bytes`` object's header (33 in CPython) and a framing
head (at most 24 for ``kvstore serve``'s), rounded up."""


class _Record(NamedTuple):
    """One stored block: ``message[start:]`` is the block, ``message`` the whole framed value when ``start`` > 0."""

    message: bytes
    start: int
    meta: BlockMeta


class HeapTier:
    """Encoded blocks in host memory, one ``bytes`` object each, in the server's framing.

    Implements :class:`kvstore.tiers.base.LendingTier`, lending by reference. It never evicts: a put
    that does not fit raises :class:`TierFullError` and stores nothing of its
    batch. A put of a key already held replaces its value and meta (last
    writer wins); within one batch the last occurrence of a key wins.

    Args:
        capacity_bytes: bytes the tier may hold, each block counted as :meth:`footprint`.
        framing: the head to store in front of a block of ``n`` bytes (``None``
            for a block to store bare), e.g. ``functools.partial(kvstore.wire.reply_head,
            chunk_bytes=...)``; ``None`` stores every block bare.
        name: tier name in stats and metrics.

    Raises:
        InvalidArgumentError: on a negative capacity.
    """

    persistent = False
    lends_references = True

    def __init__(self, capacity_bytes: int, *, framing: Framing | None = None, name: str = "memory") -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes: int = capacity_bytes
        self._framing = framing
        self._index: dict[BlockKey, _Record] = {}
        self._stored_bytes = 0  # footprints of the blocks in the index
        self._closed = False
        logger.info("heap tier %s: %s bytes, framing %s", name, capacity_bytes,
                    "on" if framing is not None else "off")

    @classmethod
    def from_config(cls, cfg: MemoryTierConfig, *, framing: Framing | None = None,
                    name: str = "memory") -> HeapTier:
        """Build the tier from its config section (``store.memory``, ``storage: heap``)."""
        return cls(cfg.capacity_bytes, framing=framing, name=name)

    # -- accounting ---------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` takes: ``nbytes + BLOCK_OVERHEAD_BYTES``."""
        return nbytes + BLOCK_OVERHEAD_BYTES

    @property
    def used_bytes(self) -> int:
        """Capacity bytes in use: the footprints of the blocks held (not those of blocks gone that a Get still sends)."""
        return self._stored_bytes

    @property
    def held_bytes(self) -> int:
        """Always 0: a block deleted while a Get still sends it is not counted (see the module docstring)."""
        return 0

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self._index)

    def counters(self) -> dict[str, int]:
        """Event counts since start: ``corrupt_records`` (always 0: memory reads are not re-verified)."""
        return {"corrupt_records": 0}

    # -- the Tier protocol --------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored."""
        self._check_open()
        index = self._index
        return [key in index for key in keys]

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Each key's value, or ``None`` for a miss; a bare block is returned as the stored object, with no copy.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        index = self._index
        return [None if r is None else r.message[r.start:] if r.start else r.message
                for r in (index.get(key) for key in keys)]

    def lend(self, keys: Sequence[BlockKey]) -> TierLoan:
        """Each key's value by reference (the stored ``bytes``, or a read-only view into its framed value), and that.

        ``framed[i]`` is the stored framed value of key ``i`` (its head, then the
        block), or ``None`` for a miss or a block stored bare. The values stay
        valid however long they are held; ``release`` does nothing.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        values: list[Buffer | None] = []
        framed: list[bytes | None] = []
        index = self._index
        for key in keys:
            record = index.get(key)
            if record is None:
                values.append(None)
                framed.append(None)
            elif record.start:
                values.append(memoryview(record.message)[record.start:])
                framed.append(record.message)
            else:
                values.append(record.message)
                framed.append(None)
        return TierLoan(values, _keep, framed)

    async def put(self, keys: Sequence[BlockKey], values: Sequence[Buffer], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value with its meta, behind its framing head, replacing any value held under the same key.

        Args:
            keys: block keys.
            values: encoded blocks (any C-contiguous bytes-like object), one per key.
            metas: priority and recency, one per key.

        Returns:
            ``True`` for every key.

        Raises:
            InvalidArgumentError: if the three sequences differ in length or a
                priority is outside ``[0, 100]``.
            TierFullError: if the batch does not fit (counting the room of the
                values it replaces); nothing of the batch is stored.
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        order = put_order(keys, values, metas)
        blocks = [_as_block(values[i]) for i in order]
        need = sum(self.footprint(len(b)) for b in blocks)
        freed = sum(self.footprint(len(r.message) - r.start) for r in (self._index.get(keys[i]) for i in order)
                    if r is not None)
        free = self.capacity_bytes - self._stored_bytes
        if need > free + freed:
            raise TierFullError(f"heap tier {self.name}: batch needs {need} bytes, {free} free")
        records = [self._record(block, metas[i]) for i, block in zip(order, blocks)]  # every copy, then publish
        for i, record in zip(order, records):
            self._publish(keys[i], record)
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key; missing keys are ignored. A block a Get still sends stays in memory until it ends.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        for key in keys:
            record = self._index.pop(key, None)
            if record is not None:
                self._stored_bytes -= self.footprint(len(record.message) - record.start)
        return done()

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta (this tier is empty after a restart)."""
        self._check_open()
        return [ResidentEntry(key, len(r.message) - r.start, r.meta) for key, r in self._index.items()]

    async def close(self) -> None:
        """Drop every block; idempotent. Lent values stay valid for as long as their holders keep them."""
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        self._stored_bytes = 0
        logger.info("heap tier %s closed", self.name)

    # -- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"heap tier {self.name} is closed")

    def _record(self, block: bytes | memoryview, meta: BlockMeta) -> _Record:
        """The stored form of one block: behind its framing head (one copy), or bare (no copy of a ``bytes``)."""
        head = self._framing(len(block)) if self._framing is not None else None
        if head:
            whole = _framed_whole(block, head)
            if whole is not None:  # already stored behind its head by the one who copied it (a same-host Put)
                return _Record(whole, len(head), meta)
            return _Record(b"".join((head, block)), len(head), meta)
        return _Record(block if type(block) is bytes else block.tobytes(), 0, meta)

    def _publish(self, key: BlockKey, record: _Record) -> None:
        old = self._index.get(key)
        self._index[key] = record
        self._stored_bytes += self.footprint(len(record.message) - record.start)
        if old is not None:
            self._stored_bytes -= self.footprint(len(old.message) - old.start)


def _framed_whole(block: bytes | memoryview, head: bytes) -> bytes | None:
    """The ``bytes`` that ``block`` is the tail of, when it is exactly ``head || block``; else ``None``.

    A same-host Put copies each block out of the client's segment once,
    straight behind its head (``kvstore.shm.node.SharedMemoryNode.copy_in``),
    and passes the view of its block part; storing that ``bytes`` is storing
    ``b"".join((head, block))`` with no second copy. Checked by address, so a
    view of any other memory is copied as before.
    """
    if type(block) is bytes:
        return None
    whole = block.obj
    if type(whole) is not bytes or len(whole) != len(head) + block.nbytes or not block.c_contiguous:
        return None
    if not whole.startswith(head) or _address(block) != _address(memoryview(whole)) + len(head):
        return None
    return whole


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (numpy reads it without a copy)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _as_block(value: Buffer) -> bytes | memoryview:
    """``value`` as ``bytes``, or as a C-contiguous byte view of it (a copy only if it is not contiguous).

    Raises:
        InvalidArgumentError: if ``value`` is not bytes-like.
    """
    if type(value) is bytes:
        return value
    try:
        view = memoryview(value)
    except TypeError:
        raise InvalidArgumentError(f"a value must be bytes-like, got {type(value).__name__}") from None
    return view.cast("B") if view.c_contiguous else view.tobytes()


def _keep() -> None:
    """The release of a heap loan: nothing to give back (see the module docstring)."""
