"""The one small interface every tier implements: async, batch-first, no eviction of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence, runtime_checkable

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
    """

    priority: int = DEFAULT_PRIORITY
    expires_at: float = 0.0
    last_access: float = 0.0


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
    """

    key: BlockKey
    nbytes: int
    meta: BlockMeta


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
    capacity_bytes: int | None
    persistent: bool

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` occupies (e.g. rounded up to pages)."""
        ...

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored."""
        ...

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The value of each key, or ``None`` for a miss.

        A value that fails its checksum is a miss, is deleted, and is counted
        in :meth:`counters` as ``corrupt_records``; it is never returned.
        """
        ...

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value; ``False`` where the tier skipped it (e.g. a remote tier that is down).

        Raises:
            TierFullError: if the tier ran out of space; nothing of the batch is stored.
        """
        ...

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove each key; missing keys are ignored.

        The removal takes effect for the tier's later calls as soon as the
        coroutine starts, before it first suspends: a tier that finishes it in
        a worker thread must run later writes after it (LMDB's one writer
        thread does), and must finish it even if the caller is cancelled. The
        store forgets a block before it deletes it, and relies on both: a put
        of the same key that starts meanwhile is not deleted with it, and no
        record is left that no index entry accounts for.
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


DropListener = Callable[[list[BlockKey]], None]
"""Told the keys of records a tier deleted on its own (see :class:`DroppingTier`)."""


@runtime_checkable
class DroppingTier(Tier, Protocol):
    """A tier that deletes records on its own: the disk tier drops the corrupt records its gets find.

    Attributes:
        on_drop: set by the store; the tier calls it on the event loop with
            the keys of each such delete once it has taken effect, also when
            the call that found them was cancelled, so that the store forgets them.
    """

    on_drop: DropListener | None


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


class TierLease(NamedTuple):
    """Blocks read in place: views of a tier's own memory, valid until :attr:`release` is called.

    A named tuple rather than a dataclass: one is made on every Get.

    Attributes:
        values: per key, the block (a read-only ``memoryview`` into the tier, or
            ``bytes`` where the tier had to copy), or ``None`` for a miss.
        release: gives the memory back; call exactly once, after the last use
            of any view (the tier may reuse the pages afterwards).
        replies: per key, the whole Get reply message that carries the block,
            where the tier holds one ready (the heap tier, built with
            ``kvstore.server.wire.reply_head``), else ``None``; ``None`` for a
            tier that holds none.
    """

    values: list[Buffer | None]
    release: Callable[[], None]
    replies: list[bytes | None] | None = None


@runtime_checkable
class LeasingTier(Tier, Protocol):
    """A tier that can also lend its blocks without a copy (the host memory tier).

    The store uses it for the service's Get, which copies each block once, from
    the tier straight into the gRPC message, instead of twice; a later
    same-host data plane can hand the same views to another process.

    Attributes:
        used_bytes: capacity bytes in use, those of blocks deleted or replaced
            while a lease still holds them included (freed at its release), unless
            the tier lends by reference.
        lends_references: ``True`` when a lease is a reference to immutable
            values (the heap tier's ``bytes``), which stay valid however long they
            are held: the store then pins nothing it reads from this tier, so
            eviction may take a block still being read, whose memory is freed when
            the read ends; ``False`` when the values are views of memory the tier
            reuses (the page pool), which the store pins until the release.
    """

    lends_references: bool

    @property
    def used_bytes(self) -> int: ...

    def lease(self, keys: Sequence[BlockKey]) -> TierLease | None:
        """Views of each key's value, pinned until ``release``; ``None`` when this tier cannot lend now.

        Raises:
            UnavailableError: if the tier is closed.
        """
        ...
