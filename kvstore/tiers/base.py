"""The one small interface every tier implements: async, batch-first, no eviction of its own."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

from kvstore.api import Buffer
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.keys import BlockKey
from kvstore.policy import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier keeps beside a block's bytes so that a restart restores its eviction order.

    Attributes:
        priority: retention priority in ``[0, 100]`` (TensorRT-LLM convention, default 35).
        expires_at: wall-clock time (``time.time()``, seconds) when the priority
            reverts to the default; 0.0 for none.
        last_access: wall-clock time of the last put or get, seconds.
        ttl_s: the block's TTL (a pin, ``docs/agentic.md``), seconds; 0.0 for none.
        pinned_until: wall-clock time when that TTL runs out unless a hit renews it, seconds; 0.0 for none.
    """

    priority: int = DEFAULT_PRIORITY
    expires_at: float = 0.0
    last_access: float = 0.0
    ttl_s: float = 0.0
    pinned_until: float = 0.0


def touch_meta(meta: BlockMeta, when: float) -> BlockMeta:
    """``meta`` of a block read at ``when``: its last access then, and its TTL (if any) renewed from then."""
    return BlockMeta(meta.priority, meta.expires_at, when, meta.ttl_s,
                     max(meta.pinned_until, when + meta.ttl_s) if meta.ttl_s > 0 else 0.0)


CHAIN_STEP_S = 1e-6
"""How much older the recorded last access of each block of one put or read is than the block before it, seconds.

A restart rebuilds eviction order by sorting on ``last_access``; this step
keeps a chain's head more recent than its tail, so the tail still goes first.
"""


@dataclass(frozen=True, slots=True)
class ResidentEntry:
    """One block a tier holds, as listed by :meth:`Tier.resident` after a restart.

    Attributes:
        key: the block key.
        nbytes: length of the stored value, bytes.
        meta: its priority, retention and recency.
        block_nbytes: length of the block as put, where the stored value is not the block itself (a
            compressed frame: the frame's header holds it); 0: ``nbytes``.
    """

    key: BlockKey
    nbytes: int
    meta: BlockMeta
    block_nbytes: int = 0


class TierFullError(KVStoreError):
    """A tier could not store a batch for lack of space (e.g. an LMDB map that is full).

    The store reacts by evicting more and retrying; it never reaches a client.
    """


@runtime_checkable
class Tier(Protocol):
    """A place that holds encoded blocks by key.

    Every method takes a batch and returns per-key results in the same order.
    Tiers never evict on their own (Redis under its own ``maxmemory`` is the
    exception); the store decides, through its policies, what goes where.
    Blocking work (LMDB transactions, large copies, network I/O) runs off the
    event loop inside the tier.

    Attributes:
        name: short tier name used in stats and metrics, e.g. ``memory``, ``disk``.
        capacity_bytes: bytes the tier may hold, or ``None`` when the tier
            manages its own capacity (Redis).
        persistent: whether :meth:`resident` survives a restart.
    """

    name: str
    persistent: bool

    @property
    def capacity_bytes(self) -> int | None:
        """Bytes the tier may hold, or ``None`` when it manages its own capacity (Redis); an attribute will do."""
        ...

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` occupies (e.g. rounded up to pages)."""
        ...

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored."""
        ...

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The value of each key, or ``None`` for a miss.

        A value that fails its checksum is a miss, is deleted, and is counted
        in :meth:`counters` as ``corrupt_records``; it is never returned. The
        store forgets every block it indexed that a get could not return.
        """
        ...

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value; ``False`` where the tier skipped it (e.g. a remote tier that is down).

        Raises:
            TierFullError: if the tier ran out of space; nothing of the batch is stored.
        """
        ...

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key; missing keys are ignored.

        The removal takes effect when the method is called, for every later
        call of the tier; the awaitable it returns completes when the removal
        is done. A tier that finishes it in a worker thread runs later writes
        after it (LMDB's one writer thread does). The store forgets a block
        and calls this in one step, so a put of the same key made afterwards
        is never deleted by it.
        """
        ...

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta; used to rebuild the index after a restart."""
        ...

    def counters(self) -> dict[str, int]:
        """Tier-specific event counts since start, e.g. ``{"corrupt_records": 0}``; pulled by the server."""
        ...

    async def close(self) -> None:
        """Flush and release everything; the tier is unusable afterwards."""
        ...


def done() -> asyncio.Future[None]:
    """An awaitable that has completed: what :meth:`Tier.delete` returns when it had nothing to wait for."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def put_order(keys: Sequence[BlockKey], values: Sequence[object], metas: Sequence[BlockMeta]) -> list[int]:
    """Check a batch for :meth:`Tier.put` and return the position of each key's last occurrence, in order.

    The last occurrence of a key wins, as every tier's ``put`` promises.

    Raises:
        InvalidArgumentError: if the three sequences differ in length or a priority is outside ``[0, 100]``.
    """
    if not len(keys) == len(values) == len(metas):
        raise InvalidArgumentError(
            f"put needs one value and meta per key: {len(keys)} keys, {len(values)} values, {len(metas)} metas"
        )
    for meta in metas:
        if not MIN_PRIORITY <= meta.priority <= MAX_PRIORITY:
            raise InvalidArgumentError(f"priority must be in [0, 100], got {meta.priority}")
    return list({key: i for i, key in enumerate(keys)}.values())


Framing = Callable[[int], "bytes | None"]
"""A value encoding a tier may store blocks in: ``framing(nbytes)`` is the head to store in front of a block of
``nbytes``, or ``None`` to store it bare.

It is the server's choice, passed in (``kvstore serve`` frames each block as its
Get reply, ``kvstore.wire.reply_head``), so that a tier that lends by reference
can hand the server a ready message with no copy; no tier knows the wire.
"""


@runtime_checkable
class ReachableTier(Tier, Protocol):
    """A tier that can be unreachable (the shared Redis tier): it tells its state and last error.

    Attributes:
        state: ``up`` or ``down`` (``down`` from a failed round trip until one succeeds).
        last_error: the last failure and when it happened (UTC); ``""`` if none.
    """

    state: str
    last_error: str

    async def check_at_start(self) -> bool:
        """Make one round trip as the store opens, logging a WARNING that names the tier's URL and the error
        when it fails; whether it succeeded. Never raises for the tier's failure."""
        ...


def tier_status(tier: Tier) -> dict[str, str]:
    """``state`` and ``last_error`` for :class:`kvstore.api.TierStats`: a :class:`ReachableTier`'s, else empty."""
    if isinstance(tier, ReachableTier):
        return {"state": tier.state, "last_error": tier.last_error}
    return {}


async def check_at_start(tier: Tier | None) -> None:
    """At the store's start, let a :class:`ReachableTier` check that it is reachable (and warn if not)."""
    if isinstance(tier, ReachableTier):
        await tier.check_at_start()


class TierLoan(NamedTuple):
    """Blocks read in place: views of a tier's own memory, valid until :attr:`release` is called.

    A named tuple rather than a dataclass: one is made on every Get.

    Attributes:
        values: per key, the block (a read-only ``memoryview`` into the tier, or
            ``bytes`` where the tier had to copy), or ``None`` for a miss.
        release: gives the memory back; call exactly once, after the last use
            of any view (the tier may reuse the pages afterwards).
        framed: per key, the stored framed value (the :data:`Framing` head, then
            the block), where the tier holds one (the heap tier, built with a
            framing), else ``None``; ``None`` for a tier that frames nothing.
        places: per key, where the block lies in memory other processes may map (the shared pool's
            ``(slab_id, offset)``, ``kvstore.shm.node.pool.Place``), else ``None``; ``None`` for a tier whose
            memory no other process maps.
        pool: a 1-D ``uint8`` tensor over the memory every value views (the
            page pool), where that is so, else ``None``: with :attr:`offsets`, a
            reader copies the blocks out with tensor views of it and no per-block
            buffer wrapping (``kvstore.blocks.copying.copy_lent_into``).
        offsets: with :attr:`pool`, each value's offset in it, bytes.
    """

    values: list[Buffer | None]
    release: Callable[[], None]
    framed: list[bytes | None] | None = None
    pool: object | None = None
    offsets: list[int] | None = None
    places: list[Any] | None = None


@runtime_checkable
class LendingTier(Tier, Protocol):
    """A tier that can also lend its blocks without a copy (the host memory tier).

    The store uses it for the service's Get, which copies each block once, from
    the tier straight into the gRPC message, instead of twice; a later
    same-host data plane can hand the same views to another process.

    Attributes:
        held_bytes: capacity bytes that blocks already deleted or replaced still
            take because a loan (or a copy in flight) holds them; freed at its
            release. The store counts them as used, so room for a put comes from
            evicting other blocks.
        lends_references: ``True`` when a loan is a reference to immutable
            values (the heap tier's ``bytes``), which stay valid however long they
            are held: the store then holds nothing it reads whole from this tier,
            so eviction may take a block still being read, whose memory is freed
            when the read ends; ``False`` when the values are views of memory the
            tier reuses (the page pool), which the store holds until the release.
    """

    lends_references: bool

    @property
    def held_bytes(self) -> int: ...

    def lend(self, keys: Sequence[BlockKey]) -> TierLoan | None:
        """Views of each key's value, pinned until ``release``; ``None`` when this tier cannot lend now.

        Raises:
            UnavailableError: if the tier is closed.
        """
        ...


@runtime_checkable
class CompressingTier(Tier, Protocol):
    """A tier that stores blocks compressed (``kvstore.tiers.compression``): the LMDB tier with compression on.

    The mover packs a batch with :meth:`pack_values` before it reserves room, so the store counts the
    stored (compressed) lengths against the tier's capacity and the tier holds as many more blocks as they
    are smaller; :meth:`put` stores packed frames as they are.
    """

    async def pack_values(self, values: Sequence[bytes]) -> Sequence[bytes]:
        """``values`` as :meth:`put` stores them (compressed frames where that saves bytes), in order."""
        ...


@runtime_checkable
class TensorWritingTier(Tier, Protocol):
    """A tier whose put also takes a put's tensors not yet encoded (:class:`kvstore.blocks.copying.TensorBlock`) and
    encodes each straight into its own memory: one copy of the payload and its checksum, where another tier
    needs the block encoded into ``bytes`` first and then copies it again (the host memory tier).

    The mover hands any other tier :func:`kvstore.blocks.copying.encoded_values`.

    Attributes:
        writes_tensors: ``True``.
    """

    writes_tensors: bool


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier that several nodes share (Redis): not indexed by any store, and cleared by namespace generations.

    Each namespace has a generation, kept in the tier itself and part of every
    key it writes; a clear moves the namespace to the next one, for every node
    at once (``kvstore.tiers.redis``).
    """

    def generation(self, tag: bytes) -> int:
        """The newest generation of the namespace ``tag`` this node has seen; copies prepared now are written under it."""
        ...

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta], *,
                  generations: Mapping[bytes, int] | None = None) -> list[bool]:
        """:meth:`Tier.put`, each key under the generation ``generations`` names for its namespace (default: now)."""
        ...

    async def clear_namespace(self, tag: bytes) -> int:
        """Move the namespace to its next generation, for every node; returns it.

        Raises:
            UnavailableError: if the tier cannot be reached.
        """
        ...

    async def sweep_namespace(self, tag: bytes, generation: int) -> int:
        """Remove the namespace's keys of generations before ``generation`` (best effort); returns how many went."""
        ...
