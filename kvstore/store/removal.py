"""Deletes and clears: the index forgets the blocks in one step, then their records go from every tier.

The ordering is the point. The index forgets the blocks and the local tiers'
deletes are called in the same synchronous step, so a put made after the call
is not deleted, and a copy still in flight loses at its complete step. Queued
copies of the blocks are dropped; copies into the shared tier already on the
wire are waited for, so the shared tier's unlink lands after them.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Sequence

from kvstore.store.copies import CopyQueue
from kvstore.store.index import Index
from kvstore.keys import BlockKey
from kvstore.store.mover import Mover
from kvstore.store.tasks import Tasks
from kvstore.tiers.base import SharedTier, Tier


class Removal:
    """The deletes and clears of one store (``TieredStore.delete`` and ``clear``).

    Args:
        index: the store's index.
        tiers: its local tiers, fastest first.
        shared: its shared tier, or ``None``.
        mover: its mover (the copies into the shared tier on their way).
        copies: its background copies (queued copies, and the shared tier's sweep).
        tasks: its tasks in flight (a delete or clear runs to its end in one).
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, mover: Mover,
                 copies: CopyQueue, tasks: Tasks) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._mover = mover
        self._copies = copies
        self._tasks = tasks

    async def delete(self, keys: list[BlockKey]) -> int:
        """Delete ``keys`` from every tier (the shared tier's copies best effort); returns how many were local.

        Once called, it runs to its end even if its caller is cancelled.
        """
        records, found = self._index.delete(keys)
        deleting = self._delete_records(records)  # in the same step: a put made after this call is not deleted
        self._copies.forget_queued(keys=set(keys))
        copies = self._mover.shared_writes_of(keys)  # copies of them into the shared tier on their way now
        await asyncio.shield(self._tasks.run(self._delete_everywhere(deleting, keys if self._shared else None,
                                                                     copies)))
        return found

    async def clear(self, tag: bytes) -> int:
        """Delete every block of the namespace ``tag``; returns how many local blocks went.

        The shared tier moves the namespace to a new generation, and its old keys are swept in the background.

        Raises:
            UnavailableError: if the shared tier cannot be reached (the local blocks are gone).
        """
        records, found = self._index.clear(tag)
        deleting = self._delete_records(records)
        self._copies.forget_queued(tag=tag)
        await asyncio.shield(self._tasks.run(self._clear(deleting, tag)))
        return found

    async def _clear(self, deleting: list[Awaitable[None]], tag: bytes) -> None:
        await self._delete_everywhere(deleting, None)
        if self._shared is not None:
            generation = await self._shared.clear_namespace(tag)
            self._copies.sweep(tag, generation)

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
        shared = self._shared
        assert shared is not None  # only called with keys for it
        if copies:
            await asyncio.gather(*copies)
        await shared.delete(keys)
