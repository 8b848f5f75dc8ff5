"""Placement: a put's admission, its steps (``Index.prepare_put``, the I/O, ``Index.complete_put``), and its blocks
into the first local tier each fits, in batches, and on down the tiers (or into the shared tier in ``write_back``
mode) where a tier cannot take them."""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence, cast

from kvstore.api import Buffer
from kvstore.blocks.copying import TensorBlock, encoded_values
from kvstore.blocks.tensors import check_one_shape
from kvstore.config import StoreConfig
from kvstore.store.continuations import Continuations
from kvstore.store.copies import CopyQueue
from kvstore.errors import ResourceExhaustedError
from kvstore.store.explain import MissLedger
from kvstore.store.index import Entry, Index, PutStep
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey, Namespace
from kvstore.store.mover import Mover, PutValue
from kvstore.store.records import Records
from kvstore.store.tasks import Tasks
from kvstore.policy.sessions import SessionTracker
from kvstore.tiers.base import CHAIN_STEP_S, BlockMeta, SharedTier, Tier
from kvstore.validation import CheckedBlocks, check_blocks, check_counts, check_priority, check_retention_s


class Placement:
    """Every put of one store: what the store's ``put`` runs, over its index, tiers and mover.

    Args:
        index: the store's index.
        tiers: its local tiers, fastest first.
        shared: its shared tier, or ``None``.
        mover: its mover, which writes each batch and moves its victims out.
        copies: its background copies (write-through, and the promotions a put waits for).
        tasks: its tasks in flight (a prepared put runs to its end in one).
        records: deletes the records the references of a protected prefix kept.
        config: the store's config (``max_block_bytes``, ``default_priority``, ``redis.mode``).
        clock: the store's clock, seconds.

    Attributes:
        continuations: the cached prefixes lookups found, by the block a put of the rest starts at.
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, mover: Mover,
                 copies: CopyQueue, tasks: Tasks, records: Records, config: StoreConfig,
                 clock: Callable[[], float]) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._mover = mover
        self._copies = copies
        self._tasks = tasks
        self._records = records
        self._write_through = shared is not None and config.redis.mode == "write_through"
        self._max_block_bytes = config.max_block_bytes
        self._default_priority = config.default_priority
        self._clock = clock
        self.continuations: Continuations[BlockKey] = Continuations()
        self.sessions: SessionTracker[BlockKey] | None = None  # the ``session`` policy's (``TieredStore``)
        self.misses: MissLedger | None = None  # learns each namespace put under (``TieredStore``)

    def admit(self, namespace: Namespace, keys: Sequence[BlockKey], blocks: Sequence[PutValue], priority: int | None,
              retention_s: float | None, ttl_s: float = 0.0) -> BlockMeta:
        """Validate a put (``kvstore.validation``) before anything is stored; returns the blocks' metadata.

        ``ttl_s``: the put's TTL, checked and clamped by the store (``TieredStore.clamp_ttl``).

        Raises:
            InvalidArgumentError: on a block that does not decode or fit the namespace, or a bad priority or retention.
            ResourceExhaustedError: on a block over ``max_block_bytes`` or larger than every tier (counted).
        """
        check_counts(len(keys), len(blocks))
        checked = check_priority(priority)
        priority = self._default_priority if checked is None else checked
        retention_s = check_retention_s(retention_s)
        now = self._clock()
        meta = BlockMeta(priority, now + retention_s if retention_s else 0.0, now, ttl_s, now + ttl_s if ttl_s else 0.0)
        check_blocks(namespace, blocks, self._max_block_bytes)
        fits: set[int] = set()
        for position, block in enumerate(blocks):
            if len(block) in fits:
                continue
            if self._fits_somewhere(len(block)):
                fits.add(len(block))
            else:
                exc = ResourceExhaustedError(f"block {position}: {len(block)} bytes is larger than every tier")
                if self._tiers:
                    self._mover.refused(0, "too_large", len(blocks), exc)
                raise exc
        if not _one_kind(blocks):
            check_one_shape(cast("Sequence[Buffer]", blocks))  # a TensorBlock too: it has the ``shape`` compared
        if self.misses is not None:
            self.misses.namespaces.learn(namespace)
        self._index.pins.tenants.setdefault(namespace.tag, namespace.cache_salt)
        return meta

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[PutValue], meta: BlockMeta,
                  check_open: Callable[[], None], session: str = "", lookups: int = 0) -> int:
        """An admitted put's steps: prepare (``Index.prepare_put``), the I/O and complete (:meth:`place`), for
        every block in no tier; a block another put is placing is waited for, and one whose placement a delete
        retired is placed again once that placement has ended. Returns how many blocks this put stored.

        A put that continues a prefix a Get is still promoting first waits for the promotion, and then
        ``check_open``. Once prepared, each placement runs to its end even if the caller is cancelled.
        Under the ``session`` policy a put of a ``session`` keeps only the head of its new blocks that
        :meth:`SessionTracker.admissible` allows at lookup number ``lookups``.
        """
        index = self._index
        first_new = next((key for key in keys if index.level_of(key) is None), None)
        protect = self.continuations.pop(first_new) if first_new is not None else ()
        promoting = self._copies.promotions_of(protect)
        if promoting:  # the Get before this put is still promoting its prefix: this put continues that prefix
            await asyncio.wait(promoting)
            check_open()
        num_new = 0
        owned = type(blocks) is CheckedBlocks  # the node's own copies, which nothing but the node can change
        pending = dict(zip(keys, blocks))
        first = True
        while pending:
            order = list(pending)
            step = index.prepare_put(order, meta.priority, meta.expires_at, touch=first, ttl_s=meta.ttl_s)
            if first and step.entries and self.sessions is not None:
                self._admit_session(step, [pending[order[i]] for i in step.positions], session, lookups)
            first = False
            if step.entries:
                values = [pending[order[i]] if owned else _owned(pending[order[i]]) for i in step.positions]
                generations = (step.generation,
                               self._mover.shared_generations(keys[:1]).get(keys[0][:NAMESPACE_TAG_BYTES], 0))
                await asyncio.shield(self._tasks.run(self.place(step.entries, values, meta, generations, protect)))
                num_new += len(step.entries)
            again = {order[i] for i in step.again}
            for entry in step.waits:
                error = await asyncio.shield(entry.wait())
                if error is not None and entry.key not in again:
                    raise error
            pending = {key: pending[key] for key in again}
        return num_new

    def _admit_session(self, step: PutStep, values: Sequence[PutValue], session: str, lookups: int) -> None:
        """Under the ``session`` policy: keep the head of a session's new blocks that fits what the turnover admits,
        abandon the rest (not stored), and count what is placed (``kvstore.policy.sessions``)."""
        sessions = self.sessions
        assert sessions is not None
        top = self._tiers[0] if self._tiers else None
        sizes = [top.footprint(len(value)) if top is not None else len(value) for value in values]
        allowed = sessions.admissible(lookups) if session else None
        keep = len(sizes)
        if allowed is not None and sum(sizes) > allowed:
            total, keep = 0, 0
            while keep < len(sizes) and total + sizes[keep] <= allowed:
                total += sizes[keep]
                keep += 1
            for entry in step.entries[keep:]:
                self._index.abandon(entry)
            del step.entries[keep:], step.positions[keep:]
            sessions.bounded_puts += 1
        sessions.placed(lookups, sum(sizes[:keep]))

    def _fits_somewhere(self, nbytes: int) -> bool:
        if self._shared is not None and not self._write_through:
            return True
        return self.first_fit(nbytes) is not None

    async def place(self, entries: list[Entry], values: list[PutValue], meta: BlockMeta,
                     generations: tuple[int, int], protect: Sequence[BlockKey] = ()) -> None:
        """A put's I/O and complete step: each block into the first local tier it fits, in batches that fit the
        tier at once, tail first, so a head written last evicts the tail; blocks that fit no local tier go to the
        shared tier in ``write_back`` mode. In ``write_through`` mode every block is then offered to the shared tier.

        ``protect``: the cached prefix this put continues (``kvstore.store.continuations``, recorded by the lookup). It
        is held while room is made, so the new blocks cannot push out their own head, and touched again, tail
        first, once they are in, so the whole chain ends ordered tail (least recent) to head, as a request's
        blocks are freed tail first in vLLM. The simulator runs this code itself (``kvstore.tools.sim.node``).

        The write-through belongs to the placement, not to the caller: a put failed part-way has still published
        blocks, and the last local tier drops its victims, counting on the shared tier's copy. It is offered
        first, before any I/O, for the blocks no delete has retired yet: a delete from then on drops the queued
        copy or waits for the one on the wire before it unlinks (:meth:`delete`), so no copy lands after it.
        """
        metas = _chain_metas(meta, len(entries))
        if self._write_through:
            live = [i for i, entry in enumerate(entries) if self._index.is_current(entry)]  # not deleted meanwhile
            if live:
                self._copies.write_through([entries[i].key for i in live], encoded_values([values[i] for i in live]),
                                          [meta] * len(live), *generations)  # queued: outlives the put
        try:
            by_level: dict[int | None, list[int]] = {}
            fits: dict[int, int | None] = {}  # length -> its first tier (a put's blocks have one or two lengths)
            for i, value in enumerate(values):
                nbytes = len(value)
                level = fits[nbytes] if nbytes in fits else fits.setdefault(nbytes, self.first_fit(nbytes))
                by_level.setdefault(level, []).append(i)
            for level, positions in by_level.items():
                await self._place_down(level, [entries[i] for i in positions], [values[i] for i in positions],
                                       [metas[i] for i in positions], protect, generations[1])
            self._index.touch(protect)  # tail first: the chain's head ends the most recent
        except BaseException as exc:
            for entry in entries:
                if not entry.ended:
                    self._index.abandon(entry, exc if isinstance(exc, Exception) else None)
            raise

    async def _place_down(self, level: int | None, entries: list[Entry], values: list[PutValue],
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

    async def _place_in(self, level: int, entries: list[Entry], values: list[PutValue], metas: list[BlockMeta],
                        protect: Sequence[BlockKey] = ()) -> list[int]:
        """Write blocks into tier ``level`` with the protected blocks resident there held, so no victim; the room
        is the tier's capacity less theirs. Returns the positions of the blocks that room cannot take, for the
        next tier: all of them (one of them is larger than the room), those not yet written when the tier could
        not make room (the rest held by reads; only where a tier is below), or none.

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
            self._records.discard_all(index.release_all(held))

    async def _spill(self, entries: list[Entry], values: list[PutValue], metas: list[BlockMeta],
                     generation: int) -> None:
        """Blocks that fit no local tier, in ``write_back`` mode: straight into the shared tier."""
        live = [i for i, entry in enumerate(entries) if self._index.is_current(entry)]  # not deleted meanwhile
        if live:
            tag = entries[0].key[:NAMESPACE_TAG_BYTES]
            await self._mover.write_shared([entries[i].key for i in live], encoded_values([values[i] for i in live]),
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
    (``kvstore.store.lifecycle.restore``); a step of :data:`~kvstore.tiers.base.CHAIN_STEP_S`
    per block keeps the rule that a chain's tail goes before its head.
    """
    priority, expires_at, last_access = meta.priority, meta.expires_at, meta.last_access
    return [BlockMeta(priority, expires_at, last_access - i * CHAIN_STEP_S) for i in range(num_blocks)]


def _owned(block: Buffer | TensorBlock) -> bytes | memoryview | TensorBlock:
    """``block`` as memory no caller can change: ``bytes`` as it is, a read-only view of ``bytes`` as it is, a
    :class:`~kvstore.blocks.copying.TensorBlock` as it is (the embedded store's caller waits for the put, and what
    outlives it is encoded first), else a copy. (A same-host Put's blocks are the node's own copies,
    ``kvstore.validation.CheckedBlocks``: taken as they are.)"""
    if type(block) is bytes or isinstance(block, TensorBlock):
        return block
    if isinstance(block, memoryview) and block.readonly and type(block.obj) is bytes and block.c_contiguous:
        return block
    return bytes(block)


def _one_kind(blocks: Sequence[object]) -> bool:
    """Whether ``blocks`` are tensor blocks of one header (one dtype and shape: ``kvstore.blocks.copying.tensor_blocks``
    made them so), whose shapes need no comparing."""
    first = blocks[0] if blocks else None
    if type(first) is not TensorBlock:
        return False
    header = first.header
    return all(type(block) is TensorBlock and block.header is header for block in blocks)
