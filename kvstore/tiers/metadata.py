"""Tiers that keep only metadata: which keys they hold, and no bytes; the simulator's tiers (``kvstore.tools.sim.node``).

A :class:`MetadataTier` is a bounded local tier whose every block takes one unit of capacity, whatever its length,
so a capacity is a number of blocks. It stores no value: a get returns one shared placeholder (the value the first
put of the key gave, not copied) for each key it holds. No method waits for anything; a tier built with ``yields``
lets the event loop turn once per get and put, where a tier whose I/O runs in a thread would (LMDB's).
:class:`LendingMetadataTier` also lends its blocks, as the node's memory tier does
(``kvstore.tiers.base.LendingTier``), so that a read takes the path it takes on a node, and a block a loan holds
keeps its capacity until the release.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Sequence

from kvstore.api import Buffer
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, ResidentEntry, TierFullError, TierLoan


async def _nothing() -> None:
    return None


class MetadataTier:
    """A local tier that keeps the keys it holds and no bytes; each block is one unit of its capacity.

    Args:
        capacity_blocks: blocks the tier holds (its ``capacity_bytes``, in units of one block).
        name: the tier's name in stats (``memory``, ``disk``).
        yields: whether a get or put lets the event loop turn once before it returns, as a tier whose I/O runs
            in a thread does (LMDB's): what else the loop has ready runs then.

    Raises:
        InvalidArgumentError: on a negative capacity.
    """

    persistent = False  # nothing to restore: the simulator never restarts a store

    def __init__(self, capacity_blocks: int, *, name: str, yields: bool = False) -> None:
        if capacity_blocks < 0:
            raise InvalidArgumentError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self._yields = yields
        self.name = name
        self.capacity_bytes: int | None = capacity_blocks
        self._values: dict[BlockKey, bytes] = {}

    def footprint(self, nbytes: int) -> int:
        """One unit of capacity, whatever ``nbytes``."""
        return 1

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held."""
        values = self._values
        return [key in values for key in keys]

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The placeholder of each key held, ``None`` for the others."""
        if self._yields:
            await asyncio.sleep(0)
        get = self._values.get
        return [get(key) for key in keys]

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """Hold each key (its value kept as the placeholder, not copied); always stored."""
        if self._yields:
            await asyncio.sleep(0)
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
    """A :class:`MetadataTier` that lends its blocks (a :class:`~kvstore.tiers.base.LendingTier`) as the node's
    memory tier does: views of memory it reuses (``lends_references`` ``False``), so the store holds what it reads
    from it until the read ends. As there, a block deleted while a loan holds it keeps its unit of capacity
    (:attr:`held_bytes`) until the loan is released, and a put that finds no unit free raises
    :class:`~kvstore.tiers.base.TierFullError`."""

    lends_references = False

    def __init__(self, capacity_blocks: int, *, name: str) -> None:
        super().__init__(capacity_blocks, name=name)
        self._lent: dict[BlockKey, list[int]] = {}  # per key resident and lent: [loans, retired]
        self._num_zombies = 0  # blocks deleted or replaced while lent

    @property
    def held_bytes(self) -> int:
        """Units of blocks deleted or replaced that a loan still holds (freed at its release)."""
        return self._num_zombies

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta]) -> list[bool]:
        """As :meth:`MetadataTier.put`, within the units free.

        Raises:
            TierFullError: if the units not held or lent cannot take the new keys.
        """
        held = self._values
        new = len({key for key in keys if key not in held})
        if len(held) + self._num_zombies + new > (self.capacity_bytes or 0):
            raise TierFullError(f"tier {self.name}: no unit free for {new} blocks")
        if self._lent:
            for key in keys:
                self._retire(key)
        return await super().put(keys, values, metas)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Forget each key; one a loan holds keeps its unit until the loan is released."""
        if self._lent:
            for key in keys:
                self._retire(key)
        return super().delete(keys)

    def _retire(self, key: BlockKey) -> None:
        record = self._lent.pop(key, None)
        if record is not None:
            record[1] = 1
            self._num_zombies += 1

    def lend(self, keys: Sequence[BlockKey]) -> TierLoan | None:
        """The placeholder of each key (``None`` for one not held), each held key lent until the release."""
        get = self._values.get
        values: list[Buffer | None] = [get(key) for key in keys]
        lent = self._lent
        records = []
        for key, value in zip(keys, values):
            if value is not None:
                record = lent.get(key)
                if record is None:
                    record = lent[key] = [0, 0]
                record[0] += 1
                records.append((key, record))

        def release() -> None:
            for key, record in records:
                record[0] -= 1
                if not record[0]:
                    if record[1]:
                        self._num_zombies -= 1
                    elif lent.get(key) is record:
                        del lent[key]

        return TierLoan(values, release)
