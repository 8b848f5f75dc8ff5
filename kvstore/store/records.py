"""Deleting tier records the index no longer accounts for: now, with failures logged, never raised."""

from __future__ import annotations

import logging
from typing import Awaitable, Mapping, Sequence

from kvstore.errors import UnavailableError
from kvstore.keys import BlockKey
from kvstore.store.tasks import Tasks
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


async def _nothing() -> None:
    return None


async def _quietly(pending: Awaitable[None], tier: Tier, num_keys: int) -> None:
    try:
        await pending
    except UnavailableError as exc:  # failing: the record is left, as after a crash
        logger.warning("deleting %d records from tier %s failed: %s", num_keys, tier.name, exc)


class Records:
    """The record deletes of one store's local tiers: stale writes, retired blocks, blocks a read found lost.

    A record whose delete fails is left, as after a crash (a restart finds it again, ``kvstore.store.lifecycle``).

    Args:
        tiers: the local tiers, fastest first.
        tasks: the store's tasks in flight (:meth:`discard` finishes in one).
    """

    def __init__(self, tiers: Sequence[Tier], tasks: Tasks) -> None:
        self._tiers = list(tiers)
        self._tasks = tasks

    def delete(self, level: int, keys: list[BlockKey]) -> Awaitable[None]:
        """Call tier ``level``'s ``delete(keys)`` now (it takes effect at the call); the awaitable raises no tier
        failure (it is logged)."""
        tier = self._tiers[level]
        try:
            pending = tier.delete(keys)
        except UnavailableError as exc:  # closed: the record is left, as after a crash
            logger.warning("deleting %d records from tier %s failed: %s", len(keys), tier.name, exc)
            return _nothing()
        return _quietly(pending, tier, len(keys))

    def discard(self, level: int, keys: list[BlockKey]) -> None:
        """:meth:`delete` now, finished in the background (the store's drain waits for it)."""
        if keys:
            self._tasks.run(self.delete(level, keys))

    def discard_all(self, records: Mapping[int, list[BlockKey]]) -> None:
        """:meth:`discard` of records by tier (``Index.release_all``, ``Index.complete_read``)."""
        for level, keys in records.items():
            self.discard(level, keys)
