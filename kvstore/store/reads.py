"""The read path: a read's prepare (references and loans), its I/O and its complete step, and ``BlockRead``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence, cast

from kvstore.api import Buffer
from kvstore.config import StoreConfig
from kvstore.store.copies import CopyQueue
from kvstore.store.counts import TierCounts, count_get
from kvstore.store.explain import MissLedger
from kvstore.store.index import Entry, Index, ReadStep
from kvstore.keys import BlockHash, BlockKey, Namespace, block_key, block_keys
from kvstore.store.records import Records
from kvstore.store.tasks import Tasks
from kvstore.tiers.base import LendingTier, SharedTier, Tier

logger = logging.getLogger(__name__)


class ReadPath:
    """Every read of one store: what the store's ``get`` and ``read`` run, over its index and tiers.

    Args:
        index: the store's index.
        tiers: its local tiers, fastest first.
        shared: its shared tier, or ``None``.
        tasks: its tasks in flight (a read whose caller went away finishes in one).
        records: deletes the records a read found lost, and those its references kept.
        copies: its background copies (promotions).
        counts: its tier counts (the shared tier's last).
        config: its config (``promote_on_hit``).
        fits: whether a block read from a persistent tier fits its namespace (``validation.fits_namespace``).
        check_open: raises ``UnavailableError`` once the store is closed.
        is_closed: whether the store is closed (a read closed after it offers no promotions).
    """

    def __init__(self, index: Index, tiers: Sequence[Tier], shared: SharedTier | None, tasks: Tasks,
                 records: Records, copies: CopyQueue, counts: Sequence[TierCounts], config: StoreConfig,
                 fits: Callable[[Namespace, BlockKey, Buffer, str], bool], check_open: Callable[[], None],
                 is_closed: Callable[[], bool]) -> None:
        self._index = index
        self._tiers = list(tiers)
        self._shared = shared
        self._lenders = [tier if isinstance(tier, LendingTier) else None for tier in self._tiers]
        self._tasks = tasks
        self._records = records
        self._copies = copies
        self._counts = counts
        self._promote_on_hit = config.promote_on_hit
        self._fits = fits
        self._check_open = check_open
        self._is_closed = is_closed
        self.misses: MissLedger | None = None  # counts the blocks a get did not return (``TieredStore``)

    def open_now(self, read: BlockRead) -> list[Buffer] | None:
        """A read's prepare, I/O and complete with no await: the top tier lends the whole cached prefix.

        ``None`` (nothing taken) when that is not the case. The recency comes
        first, so a block being read is no early victim, held or not; the hit
        counts wait for :meth:`BlockRead.close`, which the service's Get runs
        once its reply is on the way (``benchmarks/bench_service.py``).
        """
        self._check_open()
        lender = self._lenders[0] if self._lenders else None
        if not read.lend or lender is None:
            return None
        keys = block_keys(read.namespace, read.block_hashes)
        top = self._index.policies[0]
        if False in top.contains_many(keys):  # lent only if the rest is in no tier at all
            levels = self._index.locate(keys)
            if (self._shared is not None and len(levels) < len(keys)) or levels.strip(b"\0"):
                return None
            keys = keys[:len(levels)]
            read.top_misses = True
        else:
            read.top_misses = False
        loan = lender.lend(keys)
        if loan is None or None in loan.values:
            if loan is not None:
                loan.release()
            read.top_misses = None
            return None
        if not lender.lends_references:  # views of pages the tier reuses: hold them
            read.held = [self._index.hold(0, key) for key in keys]
            read.releases = [loan.release]
        for key in reversed(keys):  # tail first: the head ends most recent
            top.touch(key)
        if read.ttl_s:
            self._index.pin(keys, read.ttl_s)
        read.num_lent = len(keys)
        read.framed = loan.framed
        read.places = loan.places
        read.pool, read.offsets = loan.pool, loan.offsets
        return cast("list[Buffer]", loan.values)  # no None: checked above

    async def open(self, read: BlockRead) -> list[Buffer]:
        """A read's prepare; its I/O and complete step run in a task of their own (:meth:`_read_prefix`)."""
        values = self.open_now(read)
        if values is not None:
            return values
        keys = block_keys(read.namespace, read.block_hashes)
        step = self._index.prepare_read(keys, self._shared is not None)
        read.held = step.held
        task = asyncio.ensure_future(self._read_prefix(read, keys, step))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the I/O goes on, so that its complete step runs; then the read closes
            self._tasks.adopt(task)
            read.abandon(task)
            raise

    async def _read_prefix(self, read: BlockRead, keys: list[BlockKey], step: ReadStep) -> list[Buffer]:
        """A read's I/O (the shared tier first, then each local tier's part in one batch) and complete step."""
        sources, local = step.levels, step.local
        found: list[Buffer | None] = [None] * len(sources)
        if step.wanted:  # the shared tier first: local blocks past its first miss would be read for nothing
            shared = self._shared
            assert shared is not None  # blocks are wanted of it only where there is one
            wanted = step.wanted
            for i, shared_value in zip(wanted, await shared.get([keys[i] for i in wanted])):
                if shared_value is None or not self._fits(read.namespace, keys[i], shared_value, shared.name):
                    local = [j for j in local if j < i]
                    break
                found[i] = shared_value
        by_level: dict[int, list[int]] = {}
        for i, entry in zip(local, step.held):  # held: one per local position, in order
            by_level.setdefault(entry.level, []).append(i)
        batches = [self._read_tier(level, [keys[i] for i in positions], read) for level, positions in by_level.items()]
        results = [await batches[0]] if len(batches) == 1 else await asyncio.gather(*batches)
        places: list[Any] | None = None
        for positions, (tier_values, lent_places) in zip(by_level.values(), results):
            for i, value in zip(positions, tier_values):
                found[i] = value
            if lent_places is not None:
                places = places if places is not None else [None] * len(sources)
                for i, place in zip(positions, lent_places):
                    places[i] = place
        # complete: a located block its tier could not serve (gone, unreadable), or a block of a persistent tier
        # that does not fit the namespace, is a miss, forgotten at once and its record deleted
        index = self._index
        entries = {entry.key: entry for entry in step.held}
        lost: list[Entry] = []
        for i in local:
            entry = entries[keys[i]]
            if not index.is_current(entry):
                continue  # deleted or moved out meanwhile: what the read got (or not) is not the index's business
            value = found[i]
            if value is None:
                self._counts[entry.level].lost_records += 1
                logger.warning("tier %s: block %s is indexed but could not be read; forgotten",
                               self._tiers[entry.level].name, keys[i].hex())
            elif self._tiers[entry.level].persistent and not self._fits(read.namespace, keys[i], value,
                                                                        self._tiers[entry.level].name):
                found[i] = None
                self._counts[entry.level].mismatched += 1
            else:
                continue
            lost.append(entry)
        hit = found.index(None) if None in found else len(found)
        values = cast("list[Buffer]", found[:hit])  # no None before the first miss
        if places is not None:
            read.places = places[:hit]
        count_get(self._counts, [len(self._tiers) if s is None else s for s in sources[:hit]], len(keys))
        read.num_returned = hit
        self._records.discard_all(index.complete_read(step, keys, hit, lost, read.ttl_s))
        if self._promote_on_hit and self._tiers:
            read.promotions = self._promotions(keys, sources[:hit], values, step.generation)
        return values

    async def _read_tier(self, level: int, keys: list[BlockKey], read: BlockRead
                         ) -> tuple[Sequence[Buffer | None], list[Any] | None]:
        """One tier's values of ``keys``: lent views where ``read`` may take them and the tier lends, else copies;
        and where the tier lent them, their places in memory other processes map (:attr:`TierLoan.places`)."""
        lender = self._lenders[level]
        if read.lend and lender is not None:
            loan = lender.lend(keys)
            if loan is not None:
                read.releases.append(loan.release)
                return loan.values, loan.places
        return await self._tiers[level].get(keys), None

    def _promotions(self, keys: list[BlockKey], sources: Sequence[int | None], values: list[Buffer],
                    generation: int) -> list[tuple[int | None, list[BlockKey], list[bytes], int]]:
        """The lower-tier hits to offer for promotion, by source tier (``None``: shared), views copied to bytes."""
        moves: dict[int | None, list[int]] = {}
        for position, level in enumerate(sources[:len(values)]):
            if level != 0:
                moves.setdefault(level, []).append(position)
        return [(level, [keys[p] for p in positions],
                 [v if type(v) is bytes else bytes(v) for v in (values[p] for p in positions)], generation)
                for level, positions in moves.items()]

    def settle(self, read: BlockRead) -> None:
        """Count a lent read now (the counts :meth:`close` would make), keeping what it holds."""
        if read.top_misses is not None:
            self._counts[0].hits += read.num_lent
            if read.top_misses:  # the first miss was looked for in every tier
                for counts in self._counts:
                    counts.misses += 1
            read.top_misses = None
            read.num_returned = read.num_lent
        if read.num_returned >= 0 and self.misses is not None and read.num_returned < len(read.block_hashes):
            self.misses.get_missed(block_key(read.namespace, read.block_hashes[-1]),
                                   len(read.block_hashes) - read.num_returned)
        read.num_returned = -1  # counted: a later settle or close counts nothing again

    def unhold(self, read: BlockRead) -> None:
        """Give back a read's references on its index entries (once), keeping its tiers' loans."""
        held, read.held = read.held, []
        self._release(held)

    def close(self, read: BlockRead) -> None:
        """A read's last step: count a lent read, give back its loans and references, offer its promotions."""
        self.settle(read)
        for release in read.releases:
            release()
        self._release(read.held)
        self.promote(read)

    def promote(self, read: BlockRead) -> None:
        """Offer a read's lower-tier hits for promotion (once: they are forgotten here)."""
        promotions, read.promotions = read.promotions, []
        if not self._is_closed():  # once released, so that the promotion's room is made by evicting others
            for source, keys, values, generation in promotions:
                self._copies.promote(source, keys, values, generation)

    def _release(self, held: Sequence[Entry]) -> None:
        """Give back a read's references on index entries; the records whose last reference this was go (soon)."""
        self._records.discard_all(self._index.release_all(held))


class BlockRead:
    """One read of :meth:`kvstore.store.tiered.TieredStore.read`: ``async with store.read(namespace, hashes) as blocks``.

    Entering holds the longest cached prefix and returns its blocks; leaving,
    also by an error or a cancelled call, gives everything back. A plain class
    rather than ``contextlib.asynccontextmanager``: it runs on every Get, and a
    generator-based manager costs several microseconds more.

    Attributes:
        namespace: namespace of the blocks.
        block_hashes: the hashes asked for, in prefix order.
        lend: whether a tier that lends may return views (``False``: copies).
        held: once entered, the index entries it holds references on (``Index.hold``).
        releases: once entered, the release of each tier loan it took (:meth:`TierLoan.release`).
        promotions: lower-tier hits to offer the mover on leaving.
        framed: once entered, per block, its stored framed value (the server's
            value encoding, e.g. a ready Get reply) where the top tier holds one
            (:attr:`~kvstore.tiers.base.TierLoan.framed`), valid as long as the
            blocks are; ``None`` when none was lent.
        places: once entered, per block, where it lies in memory other processes may map (the shared
            pool's :class:`~kvstore.shm.node.pool.Place`, :attr:`~kvstore.tiers.base.TierLoan.places`), or
            ``None`` for a block elsewhere; ``None`` when no block was lent from such memory.
        pool: once entered, where the top tier lent the whole prefix as views of one buffer, a 1-D ``uint8``
            tensor over it (:attr:`~kvstore.tiers.base.TierLoan.pool`; only read from it), else ``None``.
        offsets: with :attr:`pool`, each block's offset in it, bytes.
        num_lent: the blocks of a read the top tier lent whole.
        top_misses: for such a read, until it is closed, whether it asked for
            more blocks than were cached (its counts are made then); else ``None``.
        ttl_s: a TTL to pin the blocks read with (0.0: none; ``TieredStore.read``).
        num_returned: blocks it returned, once known (-1 before): the rest count as missed when it closes.
    """

    __slots__ = ("_reads", "namespace", "block_hashes", "lend", "held", "releases", "promotions", "framed",
                 "places", "pool", "offsets", "num_lent", "top_misses", "ttl_s", "num_returned", "_closed")

    def __init__(self, reads: ReadPath, namespace: Namespace, block_hashes: Sequence[BlockHash], lend: bool) -> None:
        self._reads = reads
        self.namespace = namespace
        self.block_hashes = block_hashes
        self.lend = lend
        self.held: list[Entry] = []
        self.releases: list[Callable[[], None]] = []
        self.promotions: list[tuple[int | None, list[BlockKey], list[bytes], int]] = []
        self.framed: list[bytes | None] | None = None
        self.places: list[Any] | None = None
        self.pool: object | None = None
        self.offsets: list[int] | None = None
        self.num_lent = 0
        self.top_misses: bool | None = None
        self.ttl_s = 0.0
        self.num_returned = -1
        self._closed = False

    async def open(self) -> list[Buffer]:
        """Hold and lease the prefix and return its blocks (``async with`` calls it); pair it with :meth:`close`.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        try:
            return await self._reads.open(self)
        except asyncio.CancelledError:
            raise  # the read's I/O goes on, and closes the read when it ends (abandon)
        except BaseException:
            self.close()
            raise

    def open_now(self) -> list[Buffer] | None:
        """:meth:`open` without waiting, in the common case: the top tier lends the whole cached prefix.

        ``None`` when that is not the case; then call :meth:`open`. The
        service's Get takes this path first: a coroutine less on every call.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        return self._reads.open_now(self)

    def abandon(self, task: asyncio.Future[list[Buffer]]) -> None:
        """The caller was cancelled while the read's I/O ran: close the read once that I/O has ended."""
        if task.done():
            self.close()
        else:
            task.add_done_callback(lambda _: self.close())

    def settle(self) -> None:
        """Count the read, let go of its blocks in the index, and offer its promotions now, keeping the tiers'
        leases of its values: for a reader that holds them long after (a same-host lease, until the client
        releases it, on a stream of its own). Its blocks may then be evicted, demoted or deleted as though the
        read had ended (as ``kvstore.tools.sim.node`` replays it, and before the client's next request); the values
        it was lent stay valid until :meth:`close` gives the leases back (a pool keeps a leased range of a
        block gone until then, ``kvstore.shm.node.pool``)."""
        if not self._closed:
            self._reads.settle(self)
            self._reads.unhold(self)
            self._reads.promote(self)

    def close(self) -> None:
        """Give back what :meth:`open` took, count the read, and offer its promotions; a second call does nothing.

        A plain call, so that a caller may run it a moment later (the service's
        Get, with ``loop.call_soon``, once its reply is on the way).
        """
        if not self._closed:
            self._closed = True
            self._reads.close(self)

    async def __aenter__(self) -> list[Buffer]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()
