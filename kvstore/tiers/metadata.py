"""Tiers that keep only metadata: which keys they hold, and no bytes; the simulator's tiers (``kvstore.sim.node``).

A :class:`MetadataTier` is a bounded local tier whose every block takes one unit of capacity, whatever its length,
so a capacity is a number of blocks. It stores no value: a get returns one shared placeholder (the value the first
put of the key gave, not copied) for each key it holds. Every method is a coroutine that never waits, so the store
over it never leaves the event loop for I/O. :class:`LendingMetadataTier` also lends its blocks, as the node's
memory tier does (``kvstore.tiers.base.LeasingTier``), so that a read takes the path it takes on a node.
"""

from __future__ import annotations

from typing import Awaitable, Sequence

from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, Buffer, ResidentEntry, TierLease


async def _nothing() -> None:
    return None


def _no_release() -> None:
    return None


class MetadataTier:
    """A local tier that keeps the keys it holds and no bytes; each block is one unit of its capacity.

    Args:
        capacity_blocks: blocks the tier holds (its ``capacity_bytes``, in units of one block).
        name: the tier's name in stats (``memory``, ``disk``).

    Raises:
        InvalidArgumentError: on a negative capacity.
    """

    persistent = False  # nothing to restore: the simulator never restarts a store

    def __init__(self, capacity_blocks: int, *, name: str) -> None:
        if capacity_blocks < 0:
            raise InvalidArgumentError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_bytes: int | None = capacity_blocks
        self._values: dict[BlockKey, Buffer] = {}

    def footprint(self, nbytes: int) -> int:
        """One unit of capacity, whatever ``nbytes``."""
        return 1

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held."""
        values = self._values
        return [key in values for key in keys]

    async def get(self, keys: Sequence[BlockKey]) -> list[Buffer | None]:
        """The placeholder of each key held, ``None`` for the others."""
        get = self._values.get
        return [get(key) for key in keys]

    async def put(self, keys: Sequence[BlockKey], values: Sequence[Buffer], metas: Sequence[BlockMeta]) -> list[bool]:
        """Hold each key (its value kept as the placeholder, not copied); always stored."""
        self._values.update(zip(keys, values))
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Forget each key (missing ones are ignored), at the call."""
        pop = self._values.pop
        for key in keys:
            pop(key, None)
        return _nothing()

    async def resident(self) -> list[ResidentEntry]:
        """Nothing: a metadata tier keeps no record across a restart."""
        return []

    def counters(self) -> dict[str, int]:
        """No events of its own."""
        return {}

    async def close(self) -> None:
        """Forget everything."""
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class LendingMetadataTier(MetadataTier):
    """A :class:`MetadataTier` that lends its blocks (a :class:`~kvstore.tiers.base.LeasingTier`) as the node's
    memory tier does: views of memory it reuses (``lends_references`` ``False``), so the store holds what it reads
    from it until the read ends."""

    lends_references = False

    @property
    def held_bytes(self) -> int:
        """Always 0: no block outlives its deletion here."""
        return 0

    def lease(self, keys: Sequence[BlockKey]) -> TierLease | None:
        """The placeholder of each key (``None`` for one not held), with a release that does nothing."""
        get = self._values.get
        return TierLease([get(key) for key in keys], _no_release)
