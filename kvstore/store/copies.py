"""The store's background copies: one queue, drained in order by one task.

Three kinds of copy are offered to it: promotions of lower-tier hits into the
top tier, write-through copies of new blocks into the shared tier, and the
removal of a cleared namespace's old generation from the shared tier. The queue
is bounded in bytes (:data:`MAX_QUEUED_BYTES`); an offer beyond it is dropped
and counted (``copies_dropped``), as a cache may. Each copy writes through the
mover (``kvstore.store.mover``), prepare -> I/O -> complete like every other.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore.api import Buffer
from kvstore.store.counts import TierCounts
from kvstore.errors import ResourceExhaustedError, UnavailableError
from kvstore.store.index import Entry, Index
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.store.mover import BlockMove, Mover, block_meta
from kvstore.store.records import Records
from kvstore.tiers.base import CHAIN_STEP_S, BlockMeta, SharedTier, Tier

logger = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20
"""Bytes of block values the background queue may hold; offers beyond it are dropped (and counted)."""


@dataclass(slots=True)
class _Promotion:
    source: int | None  # a local tier, or None for the shared tier
    keys: list[BlockKey]
    values: list[bytes]
    generation: int  # the namespace generation the values were read under (shared source)
    nbytes: int = field(default=0)
    done: asyncio.Future[None] | None = None  # set once the promotion ended (``Mover.promotions_of``)
    all_keys: list[BlockKey] = field(default_factory=list)  # the keys offered (a delete may drop some from keys)

    def __post_init__(self) -> None:
        self.all_keys = list(self.keys)


@dataclass(slots=True)
class _WriteThrough:
    keys: list[BlockKey]
    values: list[bytes]
    metas: list[BlockMeta]
    generation: int  # the namespace's local generation (clears on this store) when the put was prepared
    shared_generation: int  # and the shared tier's
    nbytes: int = field(default=0)


@dataclass(slots=True)
class _Sweep:
    tag: bytes
    generation: int
    nbytes: int = field(default=0)
    keys: tuple[BlockKey, ...] = ()  # a sweep carries no blocks (every job has keys and values)
    values: tuple[bytes, ...] = ()


_Job = _Promotion | _WriteThrough | _Sweep


class CopyQueue:
    """The background copies of one store (see the module docstring); one per store, on its event loop.

    Args:
        index: the store's index.
        tiers: the local tiers, fastest first.
        shared: the shared tier (Redis), or ``None``.
        mover: the store's mover, which writes each copy.
        records: deletes the records of blocks a promotion moved out of their tier.
        counts: one :class:`TierCounts` per tier, the shared one last; the queue counts into them.
        default_priority: priority of blocks promoted out of the shared tier (it keeps none).
        clock: the store's clock, seconds.
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, mover: Mover,
                 records: Records, counts: Sequence[TierCounts], *, default_priority: int,
                 clock: Callable[[], float]) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._mover = mover
        self._records = records
        self._counts = list(counts)
        self._default_priority = default_priority
        self._clock = clock
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self._promoting: dict[BlockKey, asyncio.Future[None]] = {}  # keys of queued or running promotions
        self._closed = False

    def start(self) -> None:
        """Start the background task (on the running loop)."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain_queue(), name="kvstore-mover")

    @property
    def busy(self) -> bool:
        """Whether a copy is queued or running."""
        return bool(self._queue) or not self._idle.is_set()

    async def wait_idle(self) -> None:
        """Wait until the queue is empty and no copy runs (at once if that is so now)."""
        if self.busy:
            await self._idle.wait()

    async def close(self) -> None:
        """Take no more copies, stop the background task, and end the promotions it never ran.

        The caller first waits for the queued work (``kvstore.store.lifecycle.drain``).
        """
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for done in self._promoting.values():  # never run: nothing waits on them any more
            if not done.done():
                done.set_result(None)
        self._promoting.clear()

    def _offer(self, job: _Job) -> bool:
        """Queue a background copy; ``False`` (and counted) if the queue is full or closed."""
        job.nbytes = sum(map(len, job.values))
        if self._closed or (job.nbytes and self._queued_bytes + job.nbytes > MAX_QUEUED_BYTES):
            target = 0 if isinstance(job, _Promotion) else -1
            self._counts[target].copies_dropped += len(job.keys)
            return False
        self._queue.append(job)
        self._queued_bytes += job.nbytes
        self._idle.clear()
        self._wakeup.set()
        return True

    def promote(self, source: int | None, keys: list[BlockKey], values: list[bytes], generation: int = 0) -> None:
        """Offer to copy hits from tier ``source`` (``None``: the shared tier, read under namespace ``generation``)
        into the top tier; the source keeps no copy, except the shared tier."""
        job = _Promotion(source, keys, values, generation)
        if self._offer(job):
            job.done = asyncio.get_running_loop().create_future()
            for key in keys:
                self._promoting[key] = job.done

    def promotions_of(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """The promotions queued or running now that carry any of ``keys``; each is done once its copy ended.

        A put that continues a prefix a Get is still promoting waits for them, so that it makes its room after
        the promotion made its own (``TieredStore.put``; the simulator runs the same, ``kvstore.tools.sim.node``).
        """
        promoting = self._promoting
        if not promoting:
            return []
        return list({id(promoting[k]): promoting[k] for k in keys if k in promoting}.values())

    def _promotion_ended(self, job: _Promotion) -> None:
        if job.done is None:
            return
        for key in job.all_keys:
            if self._promoting.get(key) is job.done:
                del self._promoting[key]
        job.done.set_result(None)

    def write_through(self, keys: list[BlockKey], values: Sequence[Buffer], metas: list[BlockMeta], generation: int,
                      shared_generation: int) -> None:
        """Offer to copy new blocks into the shared tier under ``shared_generation``, unless this store clears their
        namespace first (its local ``generation`` changes). A value that is a view (of memory the put lends only
        until it ends, e.g. a range of the shared pool) is copied here, since the job outlives the put."""
        owned = [v if type(v) is bytes else bytes(v) for v in values]
        self._offer(_WriteThrough(keys, owned, metas, generation, shared_generation))

    def sweep(self, tag: bytes, generation: int) -> None:
        """Offer to remove a cleared namespace's keys of generations before ``generation`` from the shared tier."""
        self._offer(_Sweep(tag, generation))

    def forget_queued(self, keys: set[BlockKey] | None = None, tag: bytes = b"") -> None:
        """Drop queued copies of ``keys``, or (``keys`` ``None``) of every block of the namespace ``tag`` (a delete
        or clear)."""
        def wanted(key: BlockKey) -> bool:
            return not (key in keys if keys is not None else key.startswith(tag))

        for job in self._queue:
            if isinstance(job, _Sweep):
                continue
            kept = [i for i, key in enumerate(job.keys) if wanted(key)]
            if len(kept) < len(job.keys):
                job.keys = [job.keys[i] for i in kept]
                job.values = [job.values[i] for i in kept]
                if isinstance(job, _WriteThrough):
                    job.metas = [job.metas[i] for i in kept]

    async def _drain_queue(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            try:
                if isinstance(job, _Promotion):
                    await self._promote(job)
                elif isinstance(job, _WriteThrough):
                    await self._write_through(job)
                else:
                    await self._sweep(job)
            except asyncio.CancelledError:
                raise
            except UnavailableError as exc:  # a tier down or closed: expected, and counted by the tier
                logger.warning("background copy stopped: %s", exc)
            except Exception:
                logger.exception("background copy failed")
            finally:
                self._queued_bytes -= job.nbytes
                if isinstance(job, _Promotion):
                    self._promotion_ended(job)

    async def _promote(self, job: _Promotion) -> None:
        index = self._index
        if not self._tiers or not job.keys:
            return
        source = job.source
        tag = job.keys[0][:NAMESPACE_TAG_BYTES]
        if source is None and index.cleared_since(tag, job.generation):
            return  # cleared since the read: the values are of the old generation
        wanted = [i for i, key in enumerate(job.keys)
                  if index.placing(key) is None and index.level_of(key) == source
                  and (source is None or not index.leaving(source, key))]
        if not wanted:
            return
        top = self._tiers[0]
        wanted = [i for i in wanted if top.footprint(len(job.values[i])) <= (top.capacity_bytes or 0)]
        if not wanted:
            return
        keys = [job.keys[i] for i in wanted]
        values = [job.values[i] for i in wanted]
        now = self._clock()
        if source is None:
            metas: list[BlockMove] = [(self._default_priority, 0.0, 0.0, 0.0)] * len(keys)
            held: list[Entry] = []
        else:
            policy = index.policies[source]
            metas = [self._mover.meta_of(policy, k) for k in keys]
            held = [index.hold(source, key) for key in keys]
        placing = [index.place(key, *meta) for key, meta in zip(keys, metas)]
        block_metas = [block_meta(meta, now - i * CHAIN_STEP_S) for i, meta in enumerate(metas)]
        try:
            published = await self._mover.place(0, placing, values, block_metas, held if source is not None else None)
        except (ResourceExhaustedError, UnavailableError) as exc:  # the top tier is in use: a promotion is an offer
            logger.debug("promotion into %s stopped: %s", top.name, exc)
            published = []
        finally:
            self._records.discard_all(index.release_all(held))
        # a promoted block the top tier evicted again while the rest were written went back down: not moved
        moved = [key for key in published if key in index.policies[0]]
        self._counts[len(self._tiers) if source is None else source].promotions += len(moved)

    async def _write_through(self, job: _WriteThrough) -> None:
        if self._shared is None or not job.keys:
            return
        tag = job.keys[0][:NAMESPACE_TAG_BYTES]
        if self._index.cleared_since(tag, job.generation):
            return  # cleared here since the put: the clear wins (and one elsewhere: the old generation is written)
        await self._mover.write_shared(job.keys, job.values, job.metas, {tag: job.shared_generation})

    async def _sweep(self, job: _Sweep) -> None:
        if self._shared is not None:
            await self._shared.sweep_namespace(job.tag, job.generation)
