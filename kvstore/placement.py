"""Placement: a put's blocks into the first local tier each fits, in batches, and on down the tiers (or into the
shared tier in ``write_back`` mode) where a tier cannot take them."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from kvstore.errors import ResourceExhaustedError
from kvstore.index import Entry, Index, State
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.mover import Mover
from kvstore.tiers.base import CHAIN_STEP_S, BlockMeta, SharedTier, Tier


class Placement:
    """A put's I/O and complete step for one store (the prepare, its placing entries, is the store's ``put``).

    Args:
        index: the store's index.
        tiers: its local tiers, fastest first.
        shared: its shared tier, or ``None``.
        mover: its mover, which writes each batch and moves its victims out.
        write_through: whether every put is also offered to the shared tier (else a shared tier is written back).
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, mover: Mover,
                 write_through: bool) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._mover = mover
        self._write_through = write_through

    async def place(self, entries: list[Entry], values: list[bytes], meta: BlockMeta,
                     generations: tuple[int, int], protect: Sequence[BlockKey] = ()) -> None:
        """A put's I/O and complete step: each block into the first local tier it fits, in batches that fit the
        tier at once, tail first, so a head written last evicts the tail; blocks that fit no local tier go to the
        shared tier in ``write_back`` mode. In ``write_through`` mode every block is then offered to the shared tier.

        ``protect``: the cached prefix this put continues (``kvstore.continuations``, recorded by the lookup). It
        is held while room is made, so the new blocks cannot push out their own head, and touched again, tail
        first, once they are in, so the whole chain ends ordered tail (least recent) to head, as a request's
        blocks are freed tail first in vLLM. ``kvstore.sim.model`` replays exactly this order.

        The write-through belongs to the placement, not to the caller: a put failed part-way has still published
        blocks, and the last local tier drops its victims, counting on the shared tier's copy. It is offered
        first, before any I/O, for the blocks no delete has retired yet: a delete from then on drops the queued
        copy or waits for the one on the wire before it unlinks (:meth:`delete`), so no copy lands after it.
        """
        metas = _chain_metas(meta, len(entries))
        if self._write_through:
            live = [i for i, entry in enumerate(entries) if entry.state is State.PLACING]  # not deleted meanwhile
            if live:
                self._mover.write_through([entries[i].key for i in live], [values[i] for i in live],
                                          [meta] * len(live), *generations)
        try:
            by_level: dict[int | None, list[int]] = {}
            for i, value in enumerate(values):
                by_level.setdefault(self.first_fit(len(value)), []).append(i)
            for level, positions in by_level.items():
                await self._place_down(level, [entries[i] for i in positions], [values[i] for i in positions],
                                       [metas[i] for i in positions], protect, generations[1])
            index = self._index
            for key in reversed(protect):  # tail first: the chain's head ends the most recent
                level = index.level_of(key)
                if level is not None:
                    index.policies[level].touch(key)
        except BaseException as exc:
            for entry in entries:
                if not entry.ended:
                    self._index.abandon(entry, exc if isinstance(exc, Exception) else None)
            raise

    async def _place_down(self, level: int | None, entries: list[Entry], values: list[bytes],
                          metas: list[BlockMeta], protect: Sequence[BlockKey], shared_generation: int) -> None:
        """Blocks into local tier ``level``; those the protected prefix leaves no room for there go on to the next
        tier they fit, and past the last one to the shared tier in ``write_back`` mode, or nowhere (not stored;
        no error). ``level`` ``None``: no local tier is left for them."""
        if level is None:
            if self._shared is not None and not self._write_through:
                await self._spill(entries, values, metas, shared_generation)
            else:
                for entry in entries:
                    self._index.abandon(entry)
            return
        declined = await self._place_in(level, entries, values, metas, protect)
        if not declined:
            return
        below: dict[int | None, list[int]] = {}
        for i in declined:
            below.setdefault(self.first_fit(len(values[i]), level + 1), []).append(i)
        for target, positions in below.items():
            await self._place_down(target, [entries[i] for i in positions], [values[i] for i in positions],
                                   [metas[i] for i in positions], protect, shared_generation)

    async def _place_in(self, level: int, entries: list[Entry], values: list[bytes], metas: list[BlockMeta],
                        protect: Sequence[BlockKey] = ()) -> list[int]:
        """Write blocks into tier ``level`` with the protected blocks resident there held, so no victim; the room
        is the tier's capacity less theirs. Returns the positions of the blocks that room cannot take, for the
        next tier: all of them (one of them is larger than the room), those not yet written when the tier could
        not make room (the rest leased; only where a tier is below), or none.

        Raises:
            ResourceExhaustedError: if the last local tier cannot make room (counted and logged).
        """
        index = self._index
        held = [index.hold(level, key) for key in dict.fromkeys(protect) if index.level_of(key) == level]
        try:
            room = None
            if held:
                tier = self._tiers[level]
                room = (tier.capacity_bytes or 0) - sum(entry.nbytes for entry in held
                                                        if not index.leaving(level, entry.key))
                if max(tier.footprint(len(v)) for v in values) > room:
                    return list(range(len(entries)))
            declined: list[int] | None = [] if level + 1 < len(self._tiers) else None  # the next tier may take them
            await self._mover.place(level, entries, values, metas, room=room, declined=declined)
            return declined or []
        except ResourceExhaustedError as exc:
            self._mover.refused(level, "no_room", len(entries), exc)
            raise
        finally:
            self._mover.release(held)

    async def _spill(self, entries: list[Entry], values: list[bytes], metas: list[BlockMeta],
                     generation: int) -> None:
        """Blocks that fit no local tier, in ``write_back`` mode: straight into the shared tier."""
        live = [i for i, entry in enumerate(entries) if entry.state is State.PLACING]  # not deleted meanwhile
        if live:
            tag = entries[0].key[:NAMESPACE_TAG_BYTES]
            await self._mover.write_shared([entries[i].key for i in live], [values[i] for i in live],
                                           [metas[i] for i in live], {tag: generation})
        for entry in entries:
            self._index.abandon(entry)

    def first_fit(self, nbytes: int, start: int = 0) -> int | None:
        """The first local tier from ``start`` a block of ``nbytes`` fits, ``None`` for none (it goes to the shared
        tier)."""
        for level in range(start, len(self._tiers)):
            tier = self._tiers[level]
            if tier.footprint(nbytes) <= (tier.capacity_bytes or 0):
                return level
        return None


def _chain_metas(meta: BlockMeta, num_blocks: int) -> list[BlockMeta]:
    """``meta`` for each of ``num_blocks`` blocks in prefix order, the head most recent.

    A restart rebuilds the eviction order by sorting on ``last_access``
    (``TieredStore.start``); a step of :data:`~kvstore.tiers.base.CHAIN_STEP_S`
    per block keeps the rule that a chain's tail goes before its head.
    """
    return [dataclasses.replace(meta, last_access=meta.last_access - i * CHAIN_STEP_S) for i in range(num_blocks)]
