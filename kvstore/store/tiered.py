"""The tiered store: the API over the index (``kvstore.store.index``) and the parts that move bytes (``kvstore.store.mover``).

Tiers are ordered fastest first. Each bounded local tier (memory, disk) has an
eviction policy in the index, and a block lives in exactly one local tier (tiers
are exclusive, so capacity is not spent twice). An optional shared tier (Redis)
sits below them: it is not indexed, because other nodes write to it too, so
lookups and gets ask it for what the local tiers miss.

Every operation is prepare -> I/O -> complete, and the index owns the two
synchronous steps (``Index.prepare_put`` / ``complete_put``, ``prepare_read`` /
``complete_read``):

* **prepare** (synchronous) validates, reserves room and claims victims, makes
  placing entries and takes references on the blocks it reads;
* **I/O** (awaited) moves bytes, and never touches the index; once prepared, it
  runs to its end even if its caller is cancelled, so a batch is never half-indexed;
* **complete** (synchronous) publishes what is still current (a delete or clear
  retires entries at once, so a copy still in flight loses here, ``Index.is_current``)
  and gives back the references.

Five words, one meaning each. A **reference** (``Index.hold`` / ``Index.release``,
``Entry.readers``) keeps an indexed block out of its tier's eviction order while
an operation reads or moves it. A **loan** (``LendingTier.lend``,
``TierLoan.release``) is a tier's loan of its own memory, valid until given
back, even after the block left the index. A **lease** (``BlockLease``, what
``read`` returns; on a node, ``kvstore.shm.node.sessions.Lease``) is a reader's
time-bounded right to blocks read in place: it takes loans and gives up its
references at once (``ReadPath.unhold``). A **pin** (``Index.pin``,
``kvstore.store.pins``) is a cache-control TTL: a pinned block is evicted only after
every unpinned one. A put **protects** the cached prefix it continues
(``kvstore.store.continuations``) by holding references on it while it makes room.

This module is the facade; each job is a module of its own: puts in
``kvstore.store.placement`` (admission, the steps, and each block into the first tier
it fits), reads in ``kvstore.store.reads``, deletes and clears in ``kvstore.store.removal``,
start and close in ``kvstore.store.lifecycle``, the copies that make room in
``kvstore.store.mover``, the background copies in ``kvstore.store.copies``, the tasks in
flight in ``kvstore.store.tasks``, record deletes in ``kvstore.store.records``, counts in
``kvstore.store.counts``. All of it runs on one asyncio loop, which owns the index,
so nothing needs a lock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence, cast

from kvstore.api import LookupResult, StoreStats
from kvstore.config import StoreConfig
from kvstore.store.copies import CopyQueue
from kvstore.store.counts import TenantLookups, TierCounts, agentic_stats, count_lookup, store_stats
from kvstore.errors import UnavailableError
from kvstore.store.explain import BlockExplanation, MissLedger
from kvstore.store.index import Index
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockHash, BlockKey, Namespace, block_keys
from kvstore.store.lifecycle import drain, restore, shut_down
from kvstore.store.mover import Mover, PutValue
from kvstore.store.pins import PinLimits
from kvstore.store.placement import Placement
from kvstore.policy import make_policy, resolve_policy_name
from kvstore.policy.sessions import SessionTracker
from kvstore.store.reads import BlockRead, ReadPath
from kvstore.store.records import Records
from kvstore.store.removal import Removal
from kvstore.store.tasks import Tasks
from kvstore.tiers.base import LendingTier, SharedTier, Tier
from kvstore.validation import check_session_id, check_ttl_s, fits_namespace

if TYPE_CHECKING:
    from kvstore.events.log import StoreObserver


class TieredStore:
    """KV blocks under chained prefix hashes, across ordered tiers. Use from one asyncio loop.

    Args:
        tiers: bounded local tiers, fastest first (e.g. memory, then disk).
        config: store settings (promotion, demotion floor, size limit, default priority).
        shared: an optional shared tier below the local ones (Redis), with
            ``config.redis.mode`` deciding write-back or write-through.
        clock: wall clock in seconds, for retention; ``time.time`` by default.
        events: told of every block that enters or leaves a local tier (``kvstore.events.EventLog``); none by default.

    Raises:
        ValueError: if no tier is given or a local tier is unbounded.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        *,
        shared: SharedTier | None = None,
        clock: Callable[[], float] = time.time,
        events: StoreObserver | None = None,
    ) -> None:
        if not tiers and shared is None:
            raise ValueError("a store needs at least one tier")
        for tier in tiers:
            if tier.capacity_bytes is None:
                raise ValueError(f"local tier {tier.name!r} must be bounded; pass it as shared=")
        self.config = config or StoreConfig()
        self._tiers = list(tiers)
        self._shared = shared
        lenders = [tier if isinstance(tier, LendingTier) else None for tier in self._tiers]
        self._tier_names = tuple(t.name for t in self._tiers) + ((shared.name,) if shared is not None else ())
        policies = [make_policy(self.config.policy, default_priority=self.config.default_priority,
                                capacity_bytes=tier.capacity_bytes or 0, demotes=level + 1 < len(self._tiers),
                                clock=clock, pin_group=_tag_of)
                    for level, tier in enumerate(self._tiers)]
        pins = self.config.pins
        self.index = Index(policies, [tier.capacity_bytes or 0 for tier in self._tiers], clock,
                           [_held_bytes(lender) if lender is not None else None for lender in lenders],
                           charge=self.charge_of,
                           pin_limits=PinLimits(pins.max_tier_fraction, pins.max_bytes, pins.max_tenant_bytes),
                           history_blocks=self.config.miss_history_blocks)
        if events is not None:
            events.bind(tuple(t.name for t in self._tiers))
            self.index.observer = events
        self._counts = [TierCounts() for _ in self._tier_names]
        write_back = shared is not None and self.config.redis.mode != "write_through"
        self._tasks = Tasks()
        records = Records(self._tiers, self._tasks)
        self._mover = Mover(self.index, self._tiers, shared, self._counts, records,
                            demote_min_priority=self.config.demote_min_priority, write_back=write_back, clock=clock)
        self._copies = CopyQueue(self.index, self._tiers, shared, self._mover, records, self._counts,
                                 default_priority=self.config.default_priority, clock=clock)
        self._placement = Placement(self.index, self._tiers, shared, self._mover, self._copies, self._tasks, records,
                                    self.config, clock)
        self._reads = ReadPath(self.index, self._tiers, shared, self._tasks, records, self._copies, self._counts,
                               self.config, fits_namespace, self._check_open, lambda: self._closed)
        self._removal = Removal(self.index, self._tiers, shared, self._mover, self._copies, self._tasks)
        self._lookup_hit_blocks = 0
        self._lookup_miss_blocks = 0
        self._tenant_lookups = TenantLookups()
        self._closed = False
        self._lookups = 0  # the sessions' clock (``kvstore.policy.sessions``)
        self.sessions: SessionTracker[BlockKey] | None = None
        """The sessions of the ``session`` policy (``None`` with any other policy)."""
        if resolve_policy_name(self.config.policy) == "session":
            self.sessions = SessionTracker(sum(self.index.capacities), self.index.cool)
            self._placement.sessions = self.sessions
        self.misses = MissLedger(self.index.history, self._tier_names, resolve_policy_name(self.config.policy))
        """Blocks missed by cause, the namespaces seen, and :meth:`explain` (``kvstore.store.explain``)."""
        self._placement.misses = self.misses
        self._reads.misses = self.misses
        self.ttl_clamped = 0
        """TTLs over ``store.pins.max_ttl_s`` taken at that maximum."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Rebuild the index from what persistent tiers hold (e.g. LMDB after a restart), and start the background
        copies (``kvstore.store.copies``).

        Entries are inserted oldest access first, so the eviction order survives
        the restart. A block held by two tiers (a crash mid-move) stays in the upper one.
        """
        await restore(self.index, self._tiers, self._shared)
        self._copies.start()

    async def close(self) -> None:
        """Stop taking calls, finish the work in flight, demote volatile tiers, and close every tier.

        Blocks in a volatile tier (memory) above a persistent one (LMDB) are
        copied on close straight into the persistent tier, so a restart on the
        same disk path serves them, those still being read included (a Get
        stream that outlived the server's grace period may still hold its
        prefix). Blocks below ``demote_min_priority`` go only into the room left
        free there, so they push nothing out.
        """
        if self._closed:
            return
        self._closed = True
        await shut_down(self._tasks, self._copies, self._mover, self._tiers, self._shared, self.index)

    async def __aenter__(self) -> TieredStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until the operations in flight and the mover's background copies have finished (tests, shutdown)."""
        await drain(self._tasks, self._copies)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Names of the tiers, fastest first, the shared tier last."""
        return self._tier_names

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The local tiers, fastest first, then the shared tier if there is one."""
        return (*self._tiers, *((self._shared,) if self._shared is not None else ()))

    # ------------------------------------------------------------------ lookup

    async def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                     ttl_s: float | None = None, request_id: str | None = None) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks.

        Lookup does not change recency; a following :meth:`get` does. Each block
        past the prefix is counted as missed, with its cause (:attr:`misses`).

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            session_id: the agentic session the request belongs to (``docs/agentic.md``); the ``session``
                policy learns from it.
            ttl_s: a cache-control TTL, seconds: the cached prefix is pinned with it until the get that follows
                (which pins it again), so an eviction in between cannot take it. Clamped to ``store.pins.max_ttl_s``.
            request_id: names the request, so that :meth:`explain_request` can explain it later (the last
                lookups are kept, ``kvstore.store.explain.MAX_RECENT_REQUESTS``).

        Raises:
            InvalidArgumentError: on a hash of the wrong length, a bad session id or TTL.
            UnavailableError: if the store is closed.
        """
        located = await self.locate(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s, request_id=request_id)
        return LookupResult.from_block_tiers(located, self._tier_names)

    async def locate(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                     ttl_s: float | None = None, request_id: str | None = None) -> bytes:
        """:meth:`lookup` in its compact form: the tier of each block of the longest cached prefix, as a byte.

        Returns:
            One byte per block of the prefix (``len`` is the prefix length, blocks):
            the index of its tier in :attr:`tier_names`. The service sends it as
            is (``LookupResponse.block_tiers``).

        Raises:
            InvalidArgumentError: on a hash of the wrong length, a bad session id or TTL.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        session = check_session_id(session_id) if session_id else ""
        ttl = self.clamp_ttl(ttl_s) if ttl_s else 0.0
        located = self.index.locate(keys)
        num_local = len(located)
        shared_down = False
        if self._shared is not None and len(located) < len(keys):
            rest = keys[len(located):]  # past the local prefix a block may be in Redis and the next one local again
            shared, tail = len(self._tiers), bytearray()
            for level, in_shared in zip(self.index.levels_of(rest), await self._shared.contains(rest)):
                if level is None and not in_shared:
                    break
                tail.append(shared if level is None else level)  # a local copy is the faster one
            located += bytes(tail)
            shared_down = getattr(self._shared, "state", "") == "down"
        return self._located(namespace, block_hashes, keys, located, session=session, ttl=ttl, num_local=num_local,
                             shared_down=shared_down, request_id=request_id)

    def locate_now(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> bytes | None:
        """:meth:`locate` with no await, for a store without a shared tier (the index alone answers); ``None``,
        with nothing done, for a store with one (await :meth:`locate`). The embedded store's lookup: one plain
        callback on the loop instead of a coroutine. No session, TTL or request id (those take :meth:`locate`).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        if self._shared is not None:
            return None
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        located = self.index.locate(keys)
        return self._located(namespace, block_hashes, keys, located, num_local=len(located))

    def _located(self, namespace: Namespace, block_hashes: Sequence[BlockHash], keys: list[BlockKey], located: bytes,
                 *, session: str = "", ttl: float = 0.0, num_local: int = 0, shared_down: bool = False,
                 request_id: str | None = None) -> bytes:
        """Count a lookup's hits and misses (by cause), record the prefix a put of the rest continues, note its
        session, pin its local prefix for ``ttl`` and remember ``request_id``; returns ``located``."""
        self._lookup_hit_blocks += len(located)
        self._lookup_miss_blocks += len(keys) - len(located)
        count_lookup(self._counts, len(keys) - len(located))
        self._tenant_lookups.count(namespace.cache_salt, len(located), len(keys) - len(located))
        if 0 < len(located) < len(keys):  # the put of the rest protects this prefix (``put``)
            self._placement.continuations.record(keys, len(located))
        if located:
            self.misses.promise(keys[len(located) - 1])
        self._lookups += 1
        if session and self.sessions is not None:
            self.sessions.request(session, keys, self._lookups)
        if ttl and num_local:
            self.index.pin(keys[:num_local], ttl)
        if len(located) < len(keys):
            missed = keys[len(located):]
            self.misses.lookup_missed(namespace, missed, self.index.resident_many, self.index.namespace_bytes,
                                      shared_down)
        if request_id:
            self.misses.remember(check_session_id(request_id), namespace, block_hashes)
        return located

    # ------------------------------------------------------------------ get

    async def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                  ttl_s: float | None = None) -> list[bytes]:
        """Encoded blocks of the longest cached prefix, in order, stopping at the first miss; copies the caller owns.

        A block its tier turns out not to have (deleted behind the store's back,
        corrupt, unreadable) ends the prefix there and is forgotten. Lower-tier
        hits are promoted to the top tier in the background when ``promote_on_hit`` is set.
        Blocks asked for and not returned count as missed (``lease_lost``: a get follows a lookup).

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            session_id: the request's session (accepted for symmetry; the lookup is where it counts).
            ttl_s: a cache-control TTL, seconds: the blocks returned are pinned with it, from now (a hit renews
                a TTL in any case: the block's own).

        Raises:
            InvalidArgumentError: on a hash of the wrong length, a bad session id or TTL.
            UnavailableError: if the store is closed.
        """
        async with self.read(namespace, block_hashes, lend=False, session_id=session_id, ttl_s=ttl_s) as blocks:
            return cast("list[bytes]", blocks)  # without lending, every block is bytes

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, lend: bool = True,
             session_id: str | None = None, ttl_s: float | None = None) -> BlockRead:
        """The blocks of the longest cached prefix, held for the body of ``async with store.read(...) as blocks``.

        While the body runs, the prefix holds references, so eviction cannot
        take it, and blocks of a tier that lends (:class:`~kvstore.tiers.base.LendingTier`)
        are read-only views of its memory, not copies: they are valid only
        inside the body. Leaving the body, also by an error or a cancelled call,
        gives everything back. Otherwise as :meth:`get` (recency, promotion, counters).

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            lend: ``False`` to copy every block (what :meth:`get` returns).
            session_id: as :meth:`get`.
            ttl_s: as :meth:`get`.

        Returns:
            A :class:`BlockRead`, whose ``async with`` yields the blocks, ``bytes``
            or ``memoryview``, in order up to the first miss.

        Raises:
            InvalidArgumentError: on a bad session id or TTL; (on entering) on a hash of the wrong length.
            UnavailableError: (on entering) if the store is closed.
        """
        if session_id:
            check_session_id(session_id)
        read = BlockRead(self._reads, namespace, block_hashes, lend)
        if ttl_s:
            read.ttl_s = self.clamp_ttl(ttl_s)
        return read

    # ------------------------------------------------------------------ put

    async def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[PutValue],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> int:
        """Store encoded blocks in the top tier they fit; returns how many were newly stored.

        A block already resident, or being written by a concurrent put, is not
        written twice (a resident one counts as accessed): the concurrent caller
        waits for the first write and both succeed. Every block is validated
        first, so a bad batch stores nothing; once validated, the batch is
        written to its end even if the caller is cancelled.

        A put that continues the cached prefix a :meth:`lookup` found (its first
        new block is the one after that prefix) protects the prefix while it
        makes room and touches it again after (``kvstore.store.placement``); if a Get
        is still promoting that prefix, the put first waits for the promotion
        (the simulator runs this store itself, ``kvstore.tools.sim.node``, ``docs/simulate.md``).

        Args:
            namespace: namespace of the blocks.
            block_hashes: one chained hash per block.
            blocks: encoded blocks (``kvstore.blocks.tensors``), matching the namespace's
                dtype, layout and block size; or tensors not yet encoded
                (:class:`~kvstore.blocks.copying.TensorBlock`, what the embedded store puts).
            priority: retention priority in ``[0, 100]``; the configured default when ``None``.
            retention_s: seconds the priority holds before it reverts to the default.
            session_id: the agentic session the blocks belong to; under the ``session`` policy a put of a
                session stores only as many new blocks as the tiers' turnover lets survive until the session
                comes back (``kvstore.policy.sessions``), the head first.
            ttl_s: a cache-control TTL, seconds: the blocks are pinned, evicted only after every block without
                one, until it runs out, counted from their last hit or put (``docs/agentic.md``). Clamped to
                ``store.pins.max_ttl_s`` (and counted); over the bounds on pinned bytes a block is stored unpinned.

        Raises:
            InvalidArgumentError: on a malformed hash, a block that fails to decode
                (a ``CodecError`` naming the cause), a block that does not match
                the namespace, or a bad priority, retention, session id or TTL.
            ResourceExhaustedError: on a block over ``max_block_bytes`` or larger than
                every tier, or when nothing can be evicted to make room.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        session = check_session_id(session_id) if session_id else ""
        ttl = self.clamp_ttl(ttl_s) if ttl_s else 0.0
        meta = self._placement.admit(namespace, keys, blocks, priority, retention_s, ttl)
        return await self._placement.put(keys, blocks, meta, self._check_open, session, self._lookups)

    # ------------------------------------------------------------------ delete and clear

    async def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier; returns how many local blocks were found.

        The local tiers forget them at once, so a put or copy of them still in
        flight publishes nothing. The shared tier's copies are unlinked as well,
        best effort: a copy into it already on the wire may land after the
        unlink (keys are content hashes, so it holds the same bytes).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        return await self._removal.delete(block_keys(namespace, block_hashes))

    async def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace`` from every tier; returns how many local blocks went.

        Locally the blocks go at once, and every copy of them in flight loses. In
        the shared tier the namespace moves to a new generation, part of every
        key, so no node serves its old blocks from there; the old keys are
        removed in the background (``docs/redis.md``).

        Raises:
            UnavailableError: if the store is closed, or the shared tier cannot be reached (the local blocks
                are gone; those in the shared tier stay until a later clear reaches it, or they expire).
        """
        self._check_open()
        return await self._removal.clear(namespace.tag)

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        """Blocks, bytes, capacity and event counts of every tier, fastest first; blocks hit and missed by lookups,
        and the missed blocks by cause."""
        stats = store_stats(self.index, self.tiers, self._counts, self._lookup_hit_blocks, self._lookup_miss_blocks,
                            self._tenant_lookups)
        return agentic_stats(stats, self.index, self.misses, self.sessions, self.ttl_clamped)

    async def explain(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[BlockExplanation]:
        """Each block of a request, head first: a hit (and its tier), or the cause of its miss with what the node
        knows of it (``kvstore explain``). Changes nothing: no recency, no count.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        levels: list[int | None] = list(self.index.levels_of(keys))
        shared_down = False
        if self._shared is not None:
            missing = [i for i, level in enumerate(levels) if level is None]
            if missing:
                found = await self._shared.contains([keys[i] for i in missing])
                for i, in_shared in zip(missing, found):
                    if in_shared:
                        levels[i] = len(self._tiers)
            shared_down = getattr(self._shared, "state", "") == "down"
        hit = levels.index(None) if None in levels else len(levels)
        return self.misses.explain(namespace, block_hashes, keys, levels, hit, self.index.namespace_bytes(namespace.tag),
                                   shared_down)

    def recent_request(self, request_id: str) -> tuple[Namespace, list[bytes]] | None:
        """The namespace and block hashes of the last lookup named ``request_id``, while it is remembered."""
        return self.misses.recent(request_id)

    def clamp_ttl(self, ttl_s: float | None) -> float:
        """A request's TTL checked and clamped to ``store.pins.max_ttl_s`` (a clamp is counted, not refused).

        Raises:
            InvalidArgumentError: on a TTL that is not a finite number of seconds >= 0.
        """
        ttl = check_ttl_s(ttl_s)
        if ttl > self.config.pins.max_ttl_s:
            self.ttl_clamped += 1
            return self.config.pins.max_ttl_s
        return ttl

    def namespace_bytes(self, tag: bytes) -> int:
        """Charged bytes of the blocks of one namespace (by its :attr:`Namespace.tag`) in local tiers: each block
        counts :meth:`charge_of` its length, whichever tier holds it, before and after a restart (tenant quotas)."""
        return self.index.namespace_bytes(tag)

    def charge_of(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` (as put) counts for in :meth:`namespace_bytes`: the most capacity it takes in
        any local tier (``Tier.footprint``), so it never counts less than it may take (``kvstore.store.charges``)."""
        return max((tier.footprint(nbytes) for tier in self._tiers), default=nbytes)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the store is closed")


def _held_bytes(lender: LendingTier) -> Callable[[], int]:
    """What the index asks for a lending tier's ``held_bytes`` (read each time: it changes as loans end)."""
    return lambda: lender.held_bytes


def _tag_of(key: BlockKey) -> bytes:
    """A tier key's namespace tag: what pinned bytes are counted by (tenant bounds)."""
    return key[:NAMESPACE_TAG_BYTES]
