"""The tiered store: the one place that composes tiers, policies and leases.

Tiers are ordered fastest first. Every bounded local tier (memory, disk) has one
eviction policy, and the policies together are the index: a block lives in
exactly one local tier (tiers are exclusive, so capacity is not spent twice). An
optional shared tier (Redis) sits below them: it is not indexed, because other
nodes write to it too, so lookups and gets ask it for what the local tiers miss.

Data flow:

* put: validate, reserve room in the top tier (evicting victims first), write,
  then publish to the policy. A put that continues a prefix a lookup found
  cached pins that prefix while it makes room and touches it again after, so a
  chain is evicted tail first (``kvstore.continuations``; the order of every
  step is ``kvstore.sim.model``'s, which docs/simulate.md writes out). What the top tier evicts is demoted to the next
  tier if its priority is at least ``demote_min_priority``, else dropped; the
  last local tier demotes into the shared tier in ``write_back`` mode. In
  ``write_through`` mode every put also reaches the shared tier in the background.
* get: pin the prefix (a lease), read each tier's part in one batch, unpin, and
  promote lower-tier hits into the top tier in the background.

All of this runs on one asyncio loop, which owns the policies and leases, so no
locks are needed; the tiers run their blocking work in threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.codec import BlockHeader, Layout, check_one_shape, decode_header, verify_block
from kvstore.continuations import Continuations
from kvstore.config import StoreConfig
from kvstore.errors import (
    CodecError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockHash, BlockKey, Namespace, block_keys
from kvstore.policy import PriorityLRUPolicy, check_priority, make_policy
from kvstore.tiers.base import (
    CHAIN_STEP_S,
    BlockMeta,
    Buffer,
    DroppingTier,
    LeasingTier,
    Tier,
    TierFullError,
    TierLease,
    check_at_start,
    tier_status,
)
from kvstore.tombstones import Tombstones

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    lost: int = 0  # blocks the index placed in the tier that a read did not find there (then forgotten)
    mismatched: int = 0  # blocks read from a persistent tier that did not fit their namespace (then deleted)


class TieredStore:
    """KV blocks under chained prefix hashes, across ordered tiers. Use from one asyncio loop.

    Args:
        tiers: bounded local tiers, fastest first (e.g. memory, then disk).
        config: store settings (promotion, demotion floor, size limit, default priority).
        shared: an optional shared tier below the local ones (Redis), with
            ``config.redis.mode`` deciding write-back or write-through.
        clock: wall clock in seconds, for retention; ``time.time`` by default.

    Raises:
        ValueError: if no tier is given or a local tier is unbounded.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        *,
        shared: Tier | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not tiers and shared is None:
            raise ValueError("a store needs at least one tier")
        for tier in tiers:
            if tier.capacity_bytes is None:
                raise ValueError(f"local tier {tier.name!r} must be bounded; pass it as shared=")
        self.config = config or StoreConfig()
        self._tiers = list(tiers)
        self._shared = shared
        self._lenders = [tier if isinstance(tier, LeasingTier) else None for tier in self._tiers]
        for level, tier in enumerate(self._tiers):
            if isinstance(tier, DroppingTier):
                tier.on_drop = functools.partial(self._dropped, level)
        self._tier_names = tuple(t.name for t in self._tiers) + ((shared.name,) if shared is not None else ())
        self._write_through = shared is not None and self.config.redis.mode == "write_through"
        self._clock = clock
        self._policies: list[PriorityLRUPolicy] = [
            make_policy(self.config.policy, default_priority=self.config.default_priority,
                        capacity_bytes=tier.capacity_bytes or 0, demotes=level + 1 < len(self._tiers))
            for level, tier in enumerate(self._tiers)
        ]
        self._continuations: Continuations[BlockKey] = Continuations()  # lookups' prefixes, by a put's start
        self._promoting: dict[BlockKey, asyncio.Future[object]] = {}  # blocks a Get's promotion is moving up
        self._locks = [asyncio.Lock() for _ in self._tiers]
        self._tag_bytes: dict[bytes, int] = {}  # namespace tag -> local bytes, for tenant quotas
        self._forgotten_pinned: set[tuple[int, BlockKey]] = set()  # (level, key) forgotten while a read or move
        # pinned it: a read that then misses it must not take a newer entry of the key for a lost block
        self._counters = [_Counters() for _ in range(len(self._tiers) + (shared is not None))]
        self._lookup_hit_blocks = 0
        self._lookup_miss_blocks = 0
        self._pending: dict[BlockKey, asyncio.Future[BaseException | None]] = {}
        self._background: set[asyncio.Future[object]] = set()
        self._placements: set[asyncio.Future[None]] = set()  # puts' placements in flight
        self._tombstones = Tombstones()  # deletes that copies to and from the shared tier, in flight, must respect
        self._shared_copies: set[_SharedCopy] = set()  # writes into the shared tier in flight (deletes wait for them)
        self._shared_deletes: set[_SharedDelete] = set()  # deletes and clears of the shared tier in flight (newer
        # writes of their keys wait for them)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Rebuild the index from what persistent tiers hold (e.g. LMDB after a restart).

        Entries are inserted oldest access first, so the eviction order survives the restart.
        """
        for level, (tier, policy) in enumerate(zip(self._tiers, self._policies)):
            entries = await tier.resident()
            entries.sort(key=lambda e: e.meta.last_access)
            stale = []
            for entry in entries:
                if self._tier_of(entry.key) is not None:
                    stale.append(entry.key)  # a copy left by a crash mid-move; the upper tier wins
                    continue
                self._publish(level, entry.key, tier.footprint(entry.nbytes), entry.meta.priority, entry.meta.expires_at)
            if stale:
                await tier.delete(stale)
            if entries:
                logger.info("tier %s: restored %d blocks (%d bytes)", tier.name, len(policy), policy.nbytes)
        await check_at_start(self._shared)  # a shared tier that is down at start is named in a warning now

    async def close(self) -> None:
        """Stop taking calls, finish background work, demote volatile tiers, and close every tier.

        Blocks in a volatile tier (memory) above a persistent one (LMDB) are
        demoted on close, straight into the persistent tier, so a restart on
        the same disk path serves them, leased ones included: a Get stream that
        outlived the server's grace period may still hold its prefix, and a read
        lease never stops a copy. Blocks below ``demote_min_priority`` go only
        into the room left free there, so they push nothing out.
        """
        if self._closed:
            return
        self._closed = True
        await self.drain()  # puts in flight too (a cancelled put's): they publish before memory is demoted
        for level, tier in enumerate(self._tiers[:-1]):
            persistent = next((i for i in range(level + 1, len(self._tiers)) if self._tiers[i].persistent), None)
            if not tier.persistent and persistent is not None:
                policy = self._policies[level]
                try:
                    async with self._locks[level]:  # every block, in eviction order, leased or not
                        policy.expire(self._clock())  # retentions that ended count at their default priority
                        await self._evict(level, list(policy), flush_to=persistent)
                except Exception:
                    logger.exception("demoting tier %s on close failed", tier.name)
        for tier in [*self._tiers, *([self._shared] if self._shared else [])]:
            try:
                await tier.close()
            except Exception:  # close the others all the same
                logger.exception("closing tier %s failed", tier.name)

    async def __aenter__(self) -> TieredStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Names of the tiers, fastest first, the shared tier last."""
        return self._tier_names

    # ------------------------------------------------------------------ API

    async def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks.

        Lookup does not change recency; a following :meth:`get` does.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        return LookupResult.from_block_tiers(await self.locate(namespace, block_hashes), self._tier_names)

    async def locate(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> bytes:
        """:meth:`lookup` in its compact form: the tier of each block of the longest cached prefix, as a byte.

        Returns:
            One byte per block of the prefix (``len`` is the prefix length, blocks):
            the index of its tier in :attr:`tier_names`. The service sends it as
            is (``LookupResponse.block_tiers``).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        located = self._locate_prefix(keys)
        if self._shared is not None and len(located) < len(keys):
            rest = keys[len(located):]  # past the local prefix a block may be in Redis and the next one local again
            shared, tail = len(self._tiers), bytearray()
            for level, in_shared in zip(self._local_levels(rest), await self._shared.contains(rest)):
                if level is None and not in_shared:
                    break
                tail.append(shared if level is None else level)  # a local copy is the faster one
            located += bytes(tail)
        self._lookup_hit_blocks += len(located)
        self._lookup_miss_blocks += len(keys) - len(located)
        if 0 < len(located) < len(keys):  # the put of the rest protects this prefix (``put``)
            self._continuations.record(keys, len(located))
        return located

    async def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix, in order, stopping at the first miss, as ``bytes`` to keep.

        The ``bytes`` are immutable, and may be the heap tier's stored object
        itself: decode them with ``kvstore.codec.decode_block``, which copies
        read-only memory, never with a bare ``torch.frombuffer``.

        The prefix is leased while it is read, so eviction cannot take it; a
        block that turns out corrupt ends the prefix there. Lower-tier hits are
        promoted to the top tier in the background when ``promote_on_hit`` is set.
        Large memory-tier copies run in a worker thread (``offload_min_bytes``).

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        async with self.read(namespace, block_hashes, lend=False) as blocks:
            return blocks  # type: ignore[return-value]  # without lending, every block is bytes

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, lend: bool = True) -> BlockRead:
        """The blocks of the longest cached prefix, leased for the body of ``async with store.read(...) as blocks``.

        While the body runs, the prefix stays pinned, so eviction cannot take it,
        and blocks of a tier that lends (:class:`~kvstore.tiers.base.LeasingTier`,
        the host memory tier) are read-only views of its memory, not copies:
        they are valid only inside the body, and no caller may write into them
        (``kvstore.codec.decode_block`` copies read-only memory into a tensor of
        its own). The service's Get streams from
        them, copying each block once, into its gRPC messages. Leaving the body,
        also by an error or a cancelled call, releases every lease. Otherwise
        as :meth:`get` (recency, promotion, counters).

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            lend: ``False`` to copy every block (what :meth:`get` returns).

        Returns:
            A :class:`BlockRead`, whose ``async with`` yields the blocks, ``bytes``
            or ``memoryview``, in order up to the first miss.

        Raises:
            InvalidArgumentError: (on entering) on a hash of the wrong length.
            UnavailableError: (on entering) if the store is closed.
        """
        return BlockRead(self, namespace, block_hashes, lend)

    async def _open_read(self, read: BlockRead) -> list[Buffer]:
        """Pin, lease and read the prefix of ``read`` (see :meth:`read`); :meth:`_close_read` undoes it."""
        values = self._open_read_now(read)
        if values is not None:
            return values
        keys = block_keys(read.namespace, read.block_hashes)
        return await self._read_general(read, keys, self._locate_prefix(keys))

    def _open_read_now(self, read: BlockRead) -> list[Buffer] | None:
        """:meth:`_open_read` in the common case, with no await: the top tier lends the whole cached prefix.

        ``None`` (nothing pinned or leased) when that is not the case.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        lender = self._lenders[0] if self._lenders else None
        if not read.lend or lender is None:
            return None
        keys = block_keys(read.namespace, read.block_hashes)
        if False in self._policies[0].contains_many(keys):  # lent only if the rest is in no tier at all
            levels = self._locate_prefix(keys)
            if (self._shared is not None and len(levels) < len(keys)) or levels.strip(b"\0"):
                return None
            keys_lent = keys[:len(levels)]
        else:
            keys_lent = keys  # the common case: every block in the top tier
        lease = lender.lease(keys_lent)
        if lease is not None and None not in lease.values:
            return self._lent_from_top(read, keys, lease)
        if lease is not None:
            lease.release()
        return None

    def _lent_from_top(self, read: BlockRead, keys: list[BlockKey], lease: TierLease) -> list[Buffer]:
        """:meth:`_open_read` of a prefix wholly in the top tier, which lent all of it: no await, so no lock.

        The pins (where the tier lends views of memory it reuses) and the
        recency come first: a block being read is then no early victim, pinned
        or not. The hit counts wait for :meth:`_close_read`, which the service's
        Get runs once its reply is on the way (``benchmarks/bench_service.py``).
        """
        values = lease.values
        prefix = keys[:len(values)]
        policy = self._policies[0]
        if not self._lenders[0].lends_references:  # type: ignore[union-attr]  # views of pages: pin them
            for key in prefix:
                policy.pin(key)
            read.pinned = [(key, 0) for key in prefix]
            read.releases = [lease.release]
        for key in reversed(prefix):  # tail first: the head ends most recent
            policy.touch(key)
        read.num_lent = len(prefix)
        read.replies = lease.replies
        read.top_misses = len(prefix) < len(keys)
        return values  # type: ignore[return-value]  # no None: checked by the caller

    def _count_top_read(self, read: BlockRead) -> None:
        """What :meth:`_lent_from_top` left for the end of the read: its hit counts."""
        counters = self._counters
        counters[0].hits += read.num_lent
        if read.top_misses:  # the first miss was looked for in every tier
            for counts in counters:
                counts.misses += 1

    async def _read_general(self, read: BlockRead, keys: list[BlockKey], levels: bytes) -> list[Buffer]:
        """:meth:`_open_read` of any prefix: over several tiers, with the shared tier, or copied."""
        # the tier of each block that may be cached, None for the shared tier: the local prefix, then (with a
        # shared tier) every later block, since past a block in Redis the next one may be local again
        sources: list[int | None] = list(levels)
        local: Sequence[int] = range(len(sources))
        wanted: list[int] = []  # positions to ask the shared tier for
        if self._shared is not None and len(sources) < len(keys):
            sources += self._local_levels(keys[len(sources):])
            local = [i for i, level in enumerate(sources) if level is not None]
            wanted = [i for i, level in enumerate(sources) if level is None]
        pinned = read.pinned = [(keys[i], sources[i]) for i in local]
        policies = self._policies
        for key, level in pinned:
            policies[level].pin(key)  # type: ignore[index]
        releases = read.releases = []
        found: list[Buffer | None] = [None] * len(sources)
        if wanted:  # the shared tier first: local blocks past its first miss would be read for nothing
            read.shared_epoch = self._tombstones.begin()  # its hits' promotion must not undo a delete from now on
            for i, value in zip(wanted, await self._shared.get([keys[i] for i in wanted])):  # type: ignore[union-attr]
                if value is None or not self._shared_block_fits(read.namespace, keys[i], value):
                    local = [j for j in local if j < i]
                    break
                found[i] = value
        leased = [(keys[i], sources[i]) for i in local]
        for i, value in zip(local, await self._read_local(leased, releases if read.lend else None)):  # type: ignore[arg-type]
            found[i] = value
        await self._follow_moved(read, keys, sources, local, found)
        await self._check_read(read.namespace, keys, sources, local, found)
        hit = found.index(None) if None in found else len(found)
        values: list[Buffer] = found[:hit]  # type: ignore[assignment]
        hit_levels = [level for level in sources[:hit] if level is not None]
        self._count_get(hit_levels, hit, len(keys))
        for key, level in reversed(list(zip(keys[:hit], sources[:hit]))):  # tail first: the head ends most recent
            if level is not None and key in policies[level]:
                policies[level].touch(key)
        read.promotions = self._promotions(keys, sources[:hit], values)
        return values

    async def _follow_moved(self, read: BlockRead, keys: list[BlockKey], sources: list[int | None],
                            local: Sequence[int], found: list[Buffer | None]) -> None:
        """Read again, where they are now, the blocks of ``read`` that left their tier while it awaited.

        A read's pin keeps a block from being evicted, not from being promoted or demoted by another read's
        copy; such a block is pinned and read in its new tier, so the read does not come back short. At most
        once per tier, so that blocks moving for ever cannot hold the read.
        """
        for _ in range(len(self._tiers)):
            moved: list[tuple[int, int]] = []
            for i in local:
                if found[i] is None:
                    level = self._tier_of(keys[i])
                    if level is None or level == sources[i]:
                        break  # gone for good: the prefix ends here
                    moved.append((i, level))
            if not moved:
                return
            for i, level in moved:
                self._policies[level].pin(keys[i])
                read.pinned.append((keys[i], level))
                sources[i] = level
            values = await self._read_local([(keys[i], level) for i, level in moved],
                                            read.releases if read.lend else None)
            for (i, _), value in zip(moved, values):
                found[i] = value

    def _unmark_forgotten(self, released: Sequence[tuple[BlockKey, int | None]]) -> None:
        """Drop the marks of :attr:`_forgotten_pinned` whose keys no read or move pins any more."""
        for key, level in released:
            if level is not None and not self._policies[level].is_pinned(key):
                self._forgotten_pinned.discard((level, key))

    async def _check_read(self, namespace: Namespace, keys: list[BlockKey], sources: list[int | None],
                          local: Sequence[int], found: list[Buffer | None]) -> None:
        """Forget the blocks a read found missing from their tier, and refuse those of a persistent tier that do
        not fit the namespace; either is a miss (``found[i]`` becomes ``None``), so the prefix ends there.

        A block the index still places in the tier a read asked, with the same
        entry it had when the read pinned it (not forgotten meanwhile, by a
        delete or move that another put then undid), and that the tier did not
        return, is gone behind the store's back (a record deleted on
        disk, or one LMDB cannot read): it is forgotten at once, so lookups stop
        claiming it and the next put stores it again, and counted as
        ``lost_records``. A block from a persistent tier (disk) whose header's
        dtype, layout or block size contradicts the request's namespace is
        deleted and counted as corrupt, as the shared tier's are refused.
        """
        policies = self._policies
        refused: dict[int, list[BlockKey]] = {}
        for i in local:
            level = sources[i]
            value = found[i]
            if level is None:
                continue
            if value is None:
                if keys[i] in policies[level] and (level, keys[i]) not in self._forgotten_pinned:
                    logger.warning("tier %s: block %s is indexed but was not found; forgotten",
                                   self._tiers[level].name, keys[i].hex())
                    self._forget(level, keys[i])
                    self._counters[level].lost += 1
                continue
            if not self._tiers[level].persistent:
                continue  # host or device memory this process wrote, from blocks it checked at put
            try:
                mismatch = _namespace_mismatch(namespace, decode_header(value))
            except CodecError as exc:  # the tier verified it: only a tier that does not would get here
                mismatch = str(exc)
            if mismatch:
                logger.warning("tier %s: block %s does not fit its namespace (%s); deleted",
                               self._tiers[level].name, keys[i].hex(), mismatch)
                found[i] = None
                if keys[i] in policies[level]:
                    self._forget(level, keys[i])
                    refused.setdefault(level, []).append(keys[i])
                self._counters[level].mismatched += 1
        if refused:  # forgotten first, deleted before anything else runs (a put of the key made later is kept)
            await self._delete_local(refused)

    def _dropped(self, level: int, keys: list[BlockKey]) -> None:
        """Forget the blocks tier ``level`` deleted on its own (corrupt records; :class:`DroppingTier`).

        Called once the delete has taken effect. An entry tracked now is the one whose record went: a put
        skips a block that is tracked, and a write that replaces one is published only after it lands,
        which is after this delete, since the tier runs its writes in order.
        """
        policy = self._policies[level]
        for key in keys:
            if key in policy:
                self._forget(level, key)

    def _close_read(self, read: BlockRead) -> None:
        """Release the leases and pins of ``read``, then promote its lower-tier hits in the background."""
        if read.top_misses is not None:
            self._count_top_read(read)
            read.top_misses = None
        for release in read.releases:
            release()
        policies = self._policies
        for key, level in read.pinned:
            policies[level].unpin(key)  # type: ignore[index]
        if self._forgotten_pinned:
            self._unmark_forgotten(read.pinned)
        epoch, read.shared_epoch = read.shared_epoch, None
        if not self._closed:  # once unpinned, so that room is made by evicting others
            for source, moved_keys, blocks in read.promotions:
                if source is None and epoch is not None:  # the shared tier's hits: the copy window goes with them
                    task = self._spawn(self._promote_from(None, moved_keys, blocks, epoch),
                                       functools.partial(self._end_copy, epoch))
                    epoch = None
                else:
                    task = self._spawn(self._promote_from(source, moved_keys, blocks))
                self._track_promotion(moved_keys, task)
        if epoch is not None:
            self._tombstones.end(epoch)

    def _track_promotion(self, keys: list[BlockKey], task: asyncio.Future[object]) -> None:
        """Remember ``task`` as the promotion of ``keys`` until it ends (a put continuing them waits for it)."""
        promoting = self._promoting
        for key in keys:
            promoting[key] = task

        def done(_task: object) -> None:
            for key in keys:
                if promoting.get(key) is task:
                    del promoting[key]

        task.add_done_callback(done)

    async def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[bytes],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store encoded blocks in the top tier; returns how many were newly stored.

        A block already resident, or being written by a concurrent put, is not
        written twice (a resident one counts as accessed): the concurrent caller
        waits for the first write and both succeed. Every block is validated first, so a bad batch stores nothing.

        Args:
            namespace: namespace of the blocks.
            block_hashes: one chained hash per block.
            blocks: encoded blocks (``kvstore.codec``), matching the namespace's
                dtype, layout and block size.
            priority: retention priority in ``[0, 100]``; the configured default when ``None``.
            retention_s: seconds the priority holds before it reverts to the default.

        Raises:
            InvalidArgumentError: on a malformed hash, a block that fails to decode
                (a ``CodecError`` naming the cause), a block that does not match
                the namespace, or a bad priority or retention.
            ResourceExhaustedError: on a block over ``max_block_bytes`` or larger than
                every tier, or when nothing can be evicted to make room.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        keys = block_keys(namespace, block_hashes)
        if len(blocks) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} hashes but {len(blocks)} blocks")
        meta = self._meta(priority, retention_s)
        for index, block in enumerate(blocks):
            self._validate_block(namespace, index, block)
            if not self._fits_somewhere(len(block)):
                raise ResourceExhaustedError(f"block {index}: {len(block)} bytes is larger than every tier")
        check_one_shape(blocks)
        first_new = next((key for key in keys if self._tier_of(key) is None), None)
        protect = self._continuations.pop(first_new) if first_new is not None else ()
        moving = {self._promoting[key] for key in protect if key in self._promoting}
        if moving:  # the Get before this put is still promoting its prefix: this put continues that prefix
            await asyncio.wait(moving)
        fresh: dict[BlockKey, bytes] = {}
        waits: list[asyncio.Future[BaseException | None]] = []
        for key in reversed(keys):  # a block put again is in use: it counts as accessed, tail first
            level = self._tier_of(key)
            if level is not None:
                self._policies[level].touch(key)
        for key, block in zip(keys, blocks):
            if key in fresh or self._tier_of(key) is not None:
                continue
            if key in self._pending:
                waits.append(self._pending[key])
                continue
            fresh[key] = bytes(block)
        if fresh:
            done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
            for key in fresh:
                self._pending[key] = done
            placement = asyncio.ensure_future(self._place_fresh(list(fresh), list(fresh.values()), meta, protect))
            self._placements.add(placement)
            placement.add_done_callback(functools.partial(self._placement_done, list(fresh), done))
            # shielded: a cancelled caller leaves the batch to finish whole, never half-indexed, and its blocks
            # pending until then, so that a retry waits for them instead of placing them a second time
            await asyncio.shield(placement)
        for waited in waits:
            error = await asyncio.shield(waited)
            if error is not None and not isinstance(error, asyncio.CancelledError):
                raise error
        return len(fresh)

    def _placement_done(self, keys: list[BlockKey], done: asyncio.Future[BaseException | None],
                        placement: asyncio.Future[None]) -> None:
        """A put's placement ended: its blocks are no longer pending, and the puts waiting on them get its error."""
        self._placements.discard(placement)
        for key in keys:
            if self._pending.get(key) is done:
                del self._pending[key]
        done.set_result(asyncio.CancelledError() if placement.cancelled() else placement.exception())

    async def _place_fresh(self, keys: list[BlockKey], values: list[bytes], meta: BlockMeta,
                           protect: Sequence[BlockKey] = ()) -> None:
        """A put's placement of new blocks; in ``write_through`` mode they all go to the shared tier as well.

        ``protect``: the cached prefix this put continues (``kvstore.continuations``). It is pinned while
        room is made, so the new blocks cannot push out their own head, and touched again, tail first, once
        they are in, so the whole chain ends ordered tail (least recent) to head, as a request's blocks are
        freed tail first in vLLM. ``kvstore.sim.model`` replays exactly this order.

        The write-through belongs to the placement, not to the caller: a put cancelled or failed part-way has
        still published blocks, and the last local tier drops its victims, counting on the shared tier's copy.
        """
        epoch = self._tombstones.begin()

        def overtaken(key: BlockKey) -> bool:  # by a delete or clear that began after the put: it wins
            return self._tombstones.delete_began_since(key, epoch)

        try:
            await self._place(keys, values, chain_metas(meta, len(keys)), deleted=overtaken, protect=protect)
            for key in reversed(protect):
                level = self._tier_of(key)
                if level is not None:
                    self._policies[level].touch(key)
        finally:
            if self._write_through:  # the window goes with the copy, so that the shared tier agrees
                self._spawn(self._copy_to_shared(keys, values, [meta] * len(keys), overtaken),
                            functools.partial(self._end_copy, epoch))
            else:
                self._tombstones.end(epoch)

    async def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier; returns how many local blocks were found.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        self._check_open()
        return await self._delete_keys(block_keys(namespace, block_hashes))

    async def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace`` from every tier; returns how many local blocks went.

        Raises:
            UnavailableError: if the store is closed, or the shared tier cannot be reached (the local blocks
                are gone; those in the shared tier stay until they expire or a later clear reaches them).
        """
        self._check_open()
        tag = namespace.tag
        keys = [key for policy in self._policies for key in policy if key.startswith(tag)]
        keys += [key for key in self._pending if key.startswith(tag)]  # puts still placing them lose, too
        self._tombstones.record_clear(tag)  # it ends when the shared tier is clear too (``kvstore.tombstones``)
        end = functools.partial(self._tombstones.record_clear, tag, ended=True)
        # started first, and shielded: a clear cancelled part-way still clears the shared tier
        shared = self._delete_from_shared(self._clear_shared(tag), _SharedDelete(frozenset(), tag), end) \
            if getattr(self._shared, "clear_namespace", None) else None
        try:
            removed = await self._delete_keys(keys)
        finally:
            if shared is None:
                end()
        if shared is not None:
            await asyncio.shield(shared)
        return removed

    async def _clear_shared(self, tag: bytes) -> None:
        """Clear a namespace (by its tag) from the shared tier once the writes into it under way have ended."""
        await self._await_shared_copies(lambda copying: any(key.startswith(tag) for key in copying))
        await self._shared.clear_namespace(tag)  # type: ignore[union-attr]

    def stats(self) -> StoreStats:
        """Blocks, bytes, capacity and event counts of every tier, fastest first; blocks hit and missed by lookups."""
        tiers = [*self._tiers, *([self._shared] if self._shared else [])]
        result = []
        for level, (tier, counts) in enumerate(zip(tiers, self._counters)):
            extra = dict(tier.counters())
            local = level < len(self._policies)
            result.append(
                TierStats(
                    name=tier.name,
                    blocks=len(self._policies[level]) if local else -1,
                    bytes=self._policies[level].nbytes if local else 0,
                    capacity_bytes=tier.capacity_bytes or 0,
                    hits=counts.hits,
                    misses=counts.misses,
                    evictions=counts.evictions,
                    demotions=counts.demotions,
                    promotions=counts.promotions,
                    corrupt_records=extra.pop("corrupt_records", 0) + counts.mismatched,
                    counters={**extra, "lost_records": counts.lost} if local else extra,
                    **tier_status(tier),
                )
            )
        return StoreStats(tuple(result), self._lookup_hit_blocks, self._lookup_miss_blocks)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the store is closed")

    def namespace_bytes(self, tag: bytes) -> int:
        """Capacity bytes the blocks of one namespace (by its :attr:`Namespace.tag`) hold in local tiers."""
        return self._tag_bytes.get(tag, 0)

    def _publish(self, level: int, key: BlockKey, nbytes: int, priority: int, expires_at: float) -> None:
        self._policies[level].insert(key, nbytes, priority, expires_at)
        tag = key[:NAMESPACE_TAG_BYTES]
        self._tag_bytes[tag] = self._tag_bytes.get(tag, 0) + nbytes

    def _forget(self, level: int, key: BlockKey) -> None:
        policy = self._policies[level]
        if policy.is_pinned(key):
            self._forgotten_pinned.add((level, key))
        nbytes = policy.remove(key)
        if nbytes:
            tag = key[:NAMESPACE_TAG_BYTES]
            left = self._tag_bytes[tag] - nbytes
            if left:
                self._tag_bytes[tag] = left
            else:
                del self._tag_bytes[tag]

    def _local_levels(self, keys: list[BlockKey]) -> list[int | None]:
        """The local tier holding each of ``keys``, ``None`` where none does (every key, not just a prefix)."""
        levels: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, policy in enumerate(self._policies):
            if not pending:
                break
            found = policy.contains_many([keys[i] for i in pending])
            for i, hit in zip(pending, found):
                if hit:
                    levels[i] = level
            pending = [i for i, hit in zip(pending, found) if not hit]
        return levels

    def _locate_prefix(self, keys: list[BlockKey]) -> bytes:
        """The local tier of each block of the longest locally cached prefix of ``keys``, one byte per block.

        Batched per tier (``contains_many``), and the common case, a prefix
        wholly in the top tier, never leaves C loops: lookup of 1,024 hashes is
        a hot path (``benchmarks/bench_service.py``).
        """
        policies = self._policies
        if not policies or not keys:
            return b""
        top = policies[0].contains_many(keys)
        if False not in top:
            return bytes(len(keys))  # every block in tier 0
        start = top.index(False)
        rest = keys[start:]
        found = [top[start:], *(policy.contains_many(rest) for policy in policies[1:])]
        levels = bytearray(start)
        for hits in zip(*found):
            if True not in hits:
                break
            levels.append(hits.index(True))
        return bytes(levels)

    def _tier_of(self, key: BlockKey) -> int | None:
        for level, policy in enumerate(self._policies):
            if key in policy:
                return level
        return None

    def _meta(self, priority: int | None, retention_s: float | None) -> BlockMeta:
        priority = self.config.default_priority if priority is None else priority
        try:
            check_priority(priority)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if retention_s is not None and not retention_s >= 0:
            raise InvalidArgumentError(f"retention_s must be >= 0, got {retention_s}")
        now = self._clock()
        return BlockMeta(priority, now + retention_s if retention_s else 0.0, now)

    def _validate_block(self, namespace: Namespace, index: int, block: bytes) -> None:
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"block {index}: expected encoded bytes, got {type(block).__name__}")
        if len(block) > self.config.max_block_bytes:
            raise ResourceExhaustedError(
                f"block {index}: {len(block)} bytes is over max_block_bytes={self.config.max_block_bytes}"
            )
        try:
            header = verify_block(block)
        except CodecError as exc:
            raise type(exc)(f"block {index}: {exc}") from None
        mismatch = _namespace_mismatch(namespace, header)
        if mismatch:
            raise InvalidArgumentError(f"block {index}: {mismatch}")

    def _shared_block_fits(self, namespace: Namespace, key: BlockKey, block: Buffer) -> bool:
        """Whether a block read from the shared tier has the namespace's dtype, layout and block size.

        Redis is shared with other nodes (maybe of another version) and anything
        that can reach it, and its tier verifies only the checksum: a block put
        by a node would have been refused here, so it is a miss (logged), never served.
        """
        try:
            mismatch = _namespace_mismatch(namespace, decode_header(block))
        except CodecError as exc:
            mismatch = str(exc)
        if mismatch:
            logger.warning("shared tier %s: block %s does not fit its namespace (%s); a miss",
                           self._shared.name, key.hex(), mismatch)  # type: ignore[union-attr]
        return not mismatch

    async def _read_local(
        self, leased: list[tuple[BlockKey, int]], releases: list[Callable[[], None]] | None
    ) -> list[Buffer | None]:
        """Read leased blocks, one batch per tier; returns each one's value, ``None`` where its tier had none.

        With ``releases``, tiers that lend return views and append their lease's
        release to it; without, every value is a copy.
        """
        if not leased:
            return []
        by_level: dict[int, list[int]] = {}
        for position, (_, level) in enumerate(leased):
            by_level.setdefault(level, []).append(position)
        if len(by_level) == 1:  # the common case: the whole prefix in one tier, read without a task per tier
            (level,) = by_level
            return await self._read_tier(level, [key for key, _ in leased], releases)
        batches = await asyncio.gather(*(
            self._read_tier(level, [leased[p][0] for p in positions], releases)
            for level, positions in by_level.items()
        ))
        values: list[Buffer | None] = [None] * len(leased)
        for positions, batch in zip(by_level.values(), batches):
            for position, value in zip(positions, batch):
                values[position] = value
        return values

    async def _read_tier(
        self, level: int, keys: list[BlockKey], releases: list[Callable[[], None]] | None
    ) -> list[Buffer | None]:
        """One tier's values of ``keys``: leased views when ``releases`` is given and the tier lends, else copies."""
        lender = self._lenders[level]
        if releases is not None and lender is not None:
            lease = lender.lease(keys)
            if lease is not None:
                releases.append(lease.release)
                return lease.values
        return await self._tiers[level].get(keys)

    def _count_get(self, levels: list[int], num_hit: int, num_asked: int) -> None:
        for level in levels:
            self._counters[level].hits += 1
            for above in range(level):
                self._counters[above].misses += 1
        shared_hits = num_hit - len(levels)
        if self._shared is not None:
            self._counters[-1].hits += shared_hits
        if num_hit < num_asked:  # the first miss was looked for in every tier
            for counts in self._counters:
                counts.misses += 1

    def _promotions(
        self, keys: list[BlockKey], sources: Sequence[int | None], values: list[Buffer]
    ) -> list[tuple[int | None, list[BlockKey], list[bytes]]]:
        """The lower-tier hits to copy into the top tier, by source tier (``None``: shared), views copied to bytes.

        ``sources[i]`` is the tier ``values[i]`` came from. The caller spawns
        :meth:`_promote_from` for each once the read's leases are released.
        """
        if not self.config.promote_on_hit or not self._tiers:
            return []
        moves: dict[int | None, list[int]] = {}
        for position, level in enumerate(sources[: len(values)]):
            if level != 0:
                moves.setdefault(level, []).append(position)
        return [
            (level, [keys[p] for p in positions],
             [bytes(values[p]) if isinstance(values[p], memoryview) else values[p] for p in positions])  # type: ignore[misc]
            for level, positions in moves.items()
        ]

    async def _promote_from(self, source: int | None, keys: list[BlockKey], values: list[bytes],
                            since: int | None = None) -> None:
        """Move hits from ``source`` (``None``: the shared tier, which keeps its copy) into the top tier.

        ``since``: the copy window (``kvstore.tombstones``) the shared tier was read in; a block deleted since
        is not promoted, nor published if the delete lands while it is being written.
        """
        def deleted(key: BlockKey) -> bool:
            return since is not None and self._tombstones.deleted_since(key, since)

        wanted = [
            i for i, key in enumerate(keys)
            if key not in self._pending and (self._tier_of(key) == source if source is not None else self._tier_of(key) is None)
            and not deleted(key)
        ]
        if not wanted:
            return
        keys = [keys[i] for i in wanted]
        now = self._clock()
        if source is None:  # the shared tier keeps no priority: the configured default, as for a put without one
            metas = chain_metas(BlockMeta(self.config.default_priority, 0.0, now), len(keys))
        else:
            policy = self._policies[source]
            metas = [BlockMeta(policy.priority_of(k), policy.expiry_of(k), now - i * CHAIN_STEP_S)
                     for i, k in enumerate(keys)]
        try:
            await self._place(keys, [values[i] for i in wanted], metas, source=source, target=0, last=0,
                              deleted=deleted, spill=False)
        except ResourceExhaustedError as exc:  # the top tier is leased full: promotion is only ever an offer
            logger.debug("promotion into %s stopped: %s", self._tiers[0].name, exc)
        # what is in the top tier now moved; a block the top tier evicted again while the rest were written (a
        # promotion larger than the tier) went back down, or was dropped, and the source's copy is the one left
        top = self._policies[0]
        moved = [key for key in keys if key in top]
        if source is not None:
            moved = [key for key in moved if key in self._policies[source]]  # tiers are exclusive (and a concurrent
            for key in moved:                                                # promotion may have moved it already)
                self._forget(source, key)
            if moved:
                await self._tiers[source].delete(moved)
        self._counters[len(self._tiers) if source is None else source].promotions += len(moved)

    async def _place(
        self,
        keys: list[BlockKey],
        values: list[bytes],
        metas: list[BlockMeta],
        *,
        source: int | None = None,
        target: int = 0,
        last: int | None = None,
        deleted: Callable[[BlockKey], bool] | None = None,
        spill: bool = True,
        protect: Sequence[BlockKey] = (),
    ) -> list[BlockKey]:
        """Write blocks into local tier ``target`` (down to ``last``), evicting to make room, and publish them.

        ``protect``: blocks pinned in each tier while room is made there (a put's cached prefix); blocks for
        which they leave no room go to the next tier down, and from the last one to the shared tier in
        ``write_back`` mode, or nowhere (they are not stored; no error).

        A block larger than a tier goes to the next one down. With ``source``
        set (a move between tiers) a block that left the source while it was
        being written is not published and is removed again, and blocks that
        fit no tier are left where they are. A block for which ``deleted`` (a
        question to ``kvstore.tombstones``) says it was deleted during the copy
        is not published either. New blocks that fit no local tier go to the
        shared tier in ``write_back`` mode, those ``deleted`` spares (a write
        the deletes of their keys wait for), unless ``spill`` is off (a
        promotion out of the shared tier: they are there already).

        Returns:
            The keys published.

        Raises:
            ResourceExhaustedError: if a new block (``source is None``) fits no tier, or
                room cannot be made because the rest is pinned.
        """
        published: list[BlockKey] = []
        last = len(self._tiers) - 1 if last is None else last
        crowded = 0  # of the keys left, how many (the first ones) were turned away by protected blocks only
        for level in range(target, last + 1):
            tier = self._tiers[level]
            capacity = tier.capacity_bytes or 0
            fits = {i for i, v in enumerate(values) if tier.footprint(len(v)) <= capacity}
            declined: list[int] = []
            if fits:
                chosen = sorted(fits)
                written, no_room = await self._write_tier(
                    level, [keys[i] for i in chosen], [values[i] for i in chosen], [metas[i] for i in chosen], source,
                    deleted, protect,
                )
                published += written
                declined = [chosen[j] for j in no_room]
            rest = declined + [i for i in range(len(keys)) if i not in fits]
            crowded = len(declined)
            keys, values, metas = [keys[i] for i in rest], [values[i] for i in rest], [metas[i] for i in rest]
            if not keys:
                return published
        if source is None and spill:
            if self._shared is not None and not self._write_through:
                await self._copy_to_shared(keys, values, metas, deleted)
            elif len(keys) > crowded:
                keys, values = keys[crowded:], values[crowded:]
                raise ResourceExhaustedError(
                    f"{len(keys)} block(s) of up to {max(map(len, values))} bytes fit no tier "
                    f"(capacities: {[t.capacity_bytes for t in self._tiers]})"
                )
        return published

    def _fits_somewhere(self, nbytes: int) -> bool:
        if self._shared is not None and not self._write_through:
            return True
        return any(t.footprint(nbytes) <= (t.capacity_bytes or 0) for t in self._tiers)

    def _stale(self, key: BlockKey, level: int, source: int | None,
               deleted: Callable[[BlockKey], bool] | None) -> bool:
        """Whether a block just written into ``level``, where it was not before, must not be published there."""
        if source is not None and key not in self._policies[source]:
            return True  # deleted (or moved) while it was being written
        if deleted is not None and deleted(key):
            return True  # deleted during its copy (a put's placement, or a copy out of the shared tier)
        return any(key in policy for i, policy in enumerate(self._policies) if i != source)

    async def _write_tier(
        self,
        level: int,
        keys: list[BlockKey],
        values: list[bytes],
        metas: list[BlockMeta],
        source: int | None,
        deleted: Callable[[BlockKey], bool] | None = None,
        protect: Sequence[BlockKey] = (),
    ) -> tuple[list[BlockKey], list[int]]:
        """Write and publish blocks in tier ``level``; returns the keys published, and the indices of the
        blocks ``protect`` left no room for (all of them, or none)."""
        policy = self._policies[level]
        guarded = [key for key in dict.fromkeys(protect) if key in policy]
        for key in guarded:
            policy.pin(key)
        try:
            tier = self._tiers[level]
            sizes = [tier.footprint(len(v)) for v in values]
            room = (tier.capacity_bytes or 0) - sum(policy.size_of(key) for key in guarded if key in policy)
            if guarded and sizes and max(sizes) > room:
                return [], list(range(len(keys)))
            return await self._write_batches(level, keys, values, metas, sizes, room, source, deleted), []
        finally:
            for key in guarded:
                policy.unpin(key)

    async def _write_batches(
        self,
        level: int,
        keys: list[BlockKey],
        values: list[bytes],
        metas: list[BlockMeta],
        sizes: list[int],
        room: int,
        source: int | None,
        deleted: Callable[[BlockKey], bool] | None,
    ) -> list[BlockKey]:
        tier = self._tiers[level]
        capacity = tier.capacity_bytes or 0
        published: list[BlockKey] = []
        end = len(keys)
        while end > 0:  # batches that fit the room at once, tail first, so a head written last evicts the tail
            start, need = end, 0
            while start > 0 and need + sizes[start - 1] <= room:
                start -= 1
                need += sizes[start]
            async with self._locks[level]:  # make room, write and publish as one step per tier
                await self._make_room(level, need)
                try:
                    stored = await tier.put(keys[start:end], values[start:end], metas[start:end])
                except TierFullError:  # room the first pass could not see: pages a reader leased while their
                    # blocks were demoted (a lending tier counts them now), or a full LMDB map (twice the room)
                    await self._make_room(level, need if self._lenders[level] is not None else min(capacity, 2 * need))
                    try:
                        stored = await tier.put(keys[start:end], values[start:end], metas[start:end])
                    except TierFullError as exc:
                        raise ResourceExhaustedError(f"tier {tier.name} is full: {exc}") from exc
                stale = []
                policy = self._policies[level]
                for i in reversed(range(start, end)):  # tail first: the head ends most recent
                    key = keys[i]
                    if not stored[i - start]:  # the tier could not write it (a damaged disk page): not published
                        continue
                    if key in policy:  # already here, e.g. a block demoted back into the source of its promotion:
                        self._forget(level, key)  # the write replaced the block, and its entry is replaced too
                    elif self._stale(key, level, source, deleted):
                        stale.append(key)
                        continue
                    self._publish(level, key, sizes[i], metas[i].priority, metas[i].expires_at)
                    published.append(key)
                if stale:
                    await tier.delete(stale)
            end = start
        return published

    async def _make_room(self, level: int, need: int) -> None:
        """Evict from tier ``level`` until ``need`` more bytes fit; victims are demoted or dropped.

        The caller holds the tier's lock.

        Raises:
            ResourceExhaustedError: if pinned blocks leave too little to evict.
        """
        tier, policy = self._tiers[level], self._policies[level]
        capacity = tier.capacity_bytes or 0
        lender = self._lenders[level]
        # a block deleted or replaced while a reader holds it keeps its pages until the reader is done: the room
        # it holds must come from victims too
        held = max(0, lender.used_bytes - policy.nbytes) if lender is not None else 0
        excess = policy.nbytes + held + need - capacity
        if excess <= 0:
            return
        victims = policy.victims(excess, self._clock())
        if sum(policy.size_of(v) for v in victims) < excess:
            raise ResourceExhaustedError(
                f"no room in tier {tier.name}: {need} bytes needed and the rest of its {capacity} bytes is leased"
            )
        for key in victims:
            policy.pin(key)  # claimed while they move out
        try:
            await self._evict(level, victims)
        finally:
            for key in victims:  # the claim ends with the move (a lease outlives the key's removal)
                policy.unpin(key)
            if self._forgotten_pinned:
                self._unmark_forgotten([(key, level) for key in victims])

    async def _evict(self, level: int, victims: list[BlockKey], flush_to: int | None = None) -> None:
        """Move ``victims`` out of tier ``level``: those at or above ``demote_min_priority`` are demoted to the
        next tier down or to the shared one, the rest dropped.

        ``flush_to`` (closing the store): the persistent tier every victim goes straight into, those below
        ``demote_min_priority`` too where its free room holds them (:meth:`_demote`).
        """
        policy = self._policies[level]
        floor = self.config.demote_min_priority
        demote = list(victims) if flush_to is not None else [k for k in victims if policy.priority_of(k) >= floor]
        below = level + 1 < len(self._tiers)
        to_shared = not below and self._shared is not None and not self._write_through
        epoch = self._tombstones.begin() if demote and to_shared else None
        try:
            if demote and (below or to_shared):
                await self._demote(level, demote, level + 1 if flush_to is None else flush_to, epoch,
                                   flush=flush_to is not None)
        finally:
            if epoch is not None:
                self._tombstones.end(epoch)
        for key in victims:
            self._forget(level, key)
        self._counters[level].evictions += len(victims)
        await self._tiers[level].delete(victims)

    async def _demote(self, level: int, demote: list[BlockKey], target: int, epoch: int | None,
                      flush: bool = False) -> None:
        """Copy the victims ``demote`` of tier ``level`` into local tier ``target`` (when there is one below),
        or into the shared tier (``epoch``: the copy window opened for it, ``kvstore.tombstones``).

        With ``flush`` (closing the store) victims below ``demote_min_priority`` go only into the target's
        free room, most valuable first, so that they push out nothing of a higher priority.
        """
        policy = self._policies[level]
        kept = {k: (policy.priority_of(k), policy.expiry_of(k)) for k in demote}  # a delete may forget them below
        values = await self._tiers[level].get(demote)
        found = [(k, v) for k, v in zip(demote, values) if v is not None and k in policy]  # not deleted meanwhile
        if target < len(self._tiers) and flush:
            found = self._fit_flush(found, kept, target)
        keys = [k for k, _ in found]
        now = self._clock()
        metas = [BlockMeta(*kept[k], now) for k in keys]
        if target < len(self._tiers):
            try:
                placed = await self._place(keys, [v for _, v in found], metas, source=level, target=target)
            except (ResourceExhaustedError, UnavailableError) as exc:  # no room below, or a failing disk:
                # the victims are dropped, as evicted from the last tier; the put that needed the room goes on
                logger.warning("demotion from %s dropped %d blocks: %s", self._tiers[level].name, len(keys), exc)
                placed = []
            self._counters[target].demotions += len(placed)
        else:
            assert epoch is not None
            # a victim is never older than a delete of it in progress (that forgot the older block): only a
            # delete that began after the demotion's window makes it stale
            deleted = functools.partial(self._delete_began_since, epoch)
            values = [v for _, v in found]
            waiting = [any(deleting.covers(key) for deleting in self._shared_deletes) for key in keys]
            if any(waiting):
                # a block a delete under way covers waits for that delete's DEL: in the background, with its own
                # share of the copy window, so that the put which made room here does not hold the tier's lock
                # meanwhile (the block misses until then); the others are written now
                later = [i for i, wait in enumerate(waiting) if wait]
                self._tombstones.share(epoch)
                self._spawn(self._demote_to_shared([keys[i] for i in later], [values[i] for i in later],
                                                   [metas[i] for i in later], deleted),
                            functools.partial(self._end_copy, epoch))
            now = [i for i, wait in enumerate(waiting) if not wait]
            if now:
                await self._demote_to_shared([keys[i] for i in now], [values[i] for i in now],
                                             [metas[i] for i in now], deleted)

    async def _demote_to_shared(self, keys: list[BlockKey], values: list[bytes], metas: list[BlockMeta],
                                deleted: Callable[[BlockKey], bool]) -> None:
        self._counters[-1].demotions += await self._copy_to_shared(keys, values, metas, deleted)

    def _fit_flush(self, found: list[tuple[BlockKey, bytes]], kept: dict[BlockKey, tuple[int, float]],
                   target: int) -> list[tuple[BlockKey, bytes]]:
        """Of the blocks a close flushes into tier ``target`` (in eviction order): every one at or above
        ``demote_min_priority``, then those below it, most valuable first, that fit the room left free."""
        floor = self.config.demote_min_priority
        tier = self._tiers[target]
        chosen = {k for k, _ in found if kept[k][0] >= floor}
        free = (tier.capacity_bytes or 0) - self._policies[target].nbytes
        free -= sum(tier.footprint(len(v)) for k, v in found if k in chosen)
        for key, value in reversed(found):  # most valuable first
            if key not in chosen and tier.footprint(len(value)) <= free:
                chosen.add(key)
                free -= tier.footprint(len(value))
        return [(k, v) for k, v in found if k in chosen]

    async def _delete_keys(self, keys: list[BlockKey]) -> int:
        self._tombstones.record_delete(keys)  # it ends when the shared tier has deleted them too
        return await self._delete_everywhere(keys)

    async def _delete_everywhere(self, keys: list[BlockKey]) -> int:
        for key in keys:  # a put still placing them loses to this delete (``deleted``): a later put must not wait
            self._pending.pop(key, None)  # for it, but place them afresh
        by_level: dict[int, list[BlockKey]] = {}
        for key in keys:
            for level, policy in enumerate(self._policies):
                if key in policy:
                    self._forget(level, key)
                    by_level.setdefault(level, []).append(key)
        end = functools.partial(self._tombstones.record_delete, keys, ended=True)
        # started first, and shielded: a delete cancelled while the local tiers delete still deletes from Redis
        shared = self._delete_from_shared(self._delete_shared(keys), _SharedDelete(frozenset(keys), None), end) \
            if self._shared is not None and keys else None
        try:
            await self._delete_local(by_level)
        finally:
            if shared is None:
                end()
        if shared is not None:
            await asyncio.shield(shared)
        return sum(map(len, by_level.values()))

    async def _delete_local(self, by_level: dict[int, list[BlockKey]]) -> None:
        """Delete forgotten blocks from their local tiers, ``{level: keys}``, fastest tier first.

        No await comes before a tier's delete starts, and a tier's delete takes effect for its later calls as
        it starts (:meth:`~kvstore.tiers.base.Tier.delete`), so a put of the same key made meanwhile into a
        tier not yet reached is not deleted with it: memory tiers never suspend in a delete, and the one disk
        tier comes last. If the caller is cancelled, the tiers not yet reached delete in the background.
        """
        levels = sorted(by_level)
        for n, level in enumerate(levels):
            try:
                await self._tiers[level].delete(by_level[level])
            except asyncio.CancelledError:
                if n + 1 < len(levels):
                    self._spawn(self._delete_local({later: by_level[later] for later in levels[n + 1:]}))
                raise

    def _delete_from_shared(self, work: Awaitable[None], deleting: _SharedDelete,
                            end: Callable[[], None]) -> asyncio.Future[object]:
        """Start a delete or clear of the shared tier (``work``) in the background, registered as ``deleting``
        until it ends, when ``end`` records its end (``kvstore.tombstones``)."""
        self._shared_deletes.add(deleting)

        def ended(_task: object) -> None:
            self._shared_deletes.discard(deleting)
            deleting.done.set()
            end()

        return self._spawn(work, ended)

    async def _delete_shared(self, keys: list[BlockKey]) -> None:
        """Delete ``keys`` from the shared tier once the writes into it already under way for them have ended."""
        wanted = set(keys)
        await self._await_shared_copies(lambda copying: not copying.isdisjoint(wanted))
        await self._shared.delete(keys)  # type: ignore[union-attr]

    async def _copy_to_shared(self, keys: list[BlockKey], values: Sequence[bytes], metas: list[BlockMeta],
                              deleted: Callable[[BlockKey], bool] | None) -> int:
        """Write blocks into the shared tier, except those ``deleted`` says were deleted during the copy (a
        question to ``kvstore.tombstones`` about the copy's window); returns how many were stored.

        The write is registered (:attr:`_shared_copies`) from the check on, with no await in between, and a
        delete waits for registered writes of its keys before it deletes from the shared tier, so its DEL
        always lands after their SET. A write that a delete already under way does not wait for (``deleted``
        spares it: it is newer) waits instead for that delete's DEL to land, so its SET lands after it.
        """
        deletes = [d.done.wait() for d in self._shared_deletes if any(map(d.covers, keys))]
        if deletes:
            await asyncio.gather(*deletes)
        live = [i for i, key in enumerate(keys) if deleted is None or not deleted(key)]
        if not live:
            return 0
        copy = _SharedCopy(frozenset(keys[i] for i in live))
        self._shared_copies.add(copy)
        try:
            stored = await self._shared.put(  # type: ignore[union-attr]
                [keys[i] for i in live], [values[i] for i in live], [metas[i] for i in live]
            )
        finally:
            self._shared_copies.discard(copy)
            copy.done.set()
        return sum(stored)

    async def _await_shared_copies(self, overlaps: Callable[[frozenset[BlockKey]], bool]) -> None:
        """Wait for the shared-tier writes in flight whose keys ``overlaps`` picks (a delete's, a clear's)."""
        waits = [copy.done.wait() for copy in self._shared_copies if overlaps(copy.keys)]
        if waits:
            await asyncio.gather(*waits)

    def _end_copy(self, epoch: int, _task: object = None) -> None:
        self._tombstones.end(epoch)

    def _delete_began_since(self, epoch: int, key: BlockKey) -> bool:
        return self._tombstones.delete_began_since(key, epoch)

    def _spawn(self, work: Awaitable[object],
               on_done: Callable[[asyncio.Future[object]], None] | None = None) -> asyncio.Future[object]:
        """Run ``work`` in the background (:meth:`drain` waits for it); ``on_done`` runs when it ends, even
        if it was cancelled before it started."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        if on_done is not None:
            task.add_done_callback(on_done)
        return task

    def _background_done(self, task: asyncio.Future[object]) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if isinstance(task.exception(), UnavailableError):  # a tier down or closed: expected, and reported
            logger.warning("background store task stopped: %s", task.exception())  # to whoever awaits it
        else:
            logger.error("background store task failed", exc_info=task.exception())

    async def drain(self) -> None:
        """Wait until puts in flight, background promotions and write-through puts have finished (tests, shutdown)."""
        while self._background or self._placements:
            await asyncio.gather(*self._background, *self._placements, return_exceptions=True)


class _SharedDelete:
    """One delete of keys, or clear of a namespace, of the shared tier in flight; ``done`` is set when it ends."""

    __slots__ = ("keys", "tag", "done")

    def __init__(self, keys: frozenset[BlockKey], tag: bytes | None) -> None:
        self.keys = keys
        self.tag = tag
        self.done = asyncio.Event()

    def covers(self, key: BlockKey) -> bool:
        """Whether this delete or clear deletes ``key``."""
        return key.startswith(self.tag) if self.tag is not None else key in self.keys


class _SharedCopy:
    """One write into the shared tier in flight: its keys, and an event set when it has ended."""

    __slots__ = ("keys", "done")

    def __init__(self, keys: frozenset[BlockKey]) -> None:
        self.keys = keys
        self.done = asyncio.Event()


class BlockRead:
    """One read of :meth:`TieredStore.read`: ``async with store.read(namespace, hashes) as blocks``.

    Entering pins and leases the longest cached prefix and returns its blocks;
    leaving, also by an error or a cancelled call, releases them. A plain class
    rather than ``contextlib.asynccontextmanager``: it runs on every Get, and a
    generator-based manager costs several microseconds more.

    Attributes:
        namespace: namespace of the blocks.
        block_hashes: the hashes asked for, in prefix order.
        lend: whether a tier that lends may return views (``False``: copies).
        pinned: ``(key, tier level)`` of every pinned block, once entered.
        releases: the leases to give back, once entered.
        promotions: lower-tier hits to copy into the top tier on leaving.
        shared_epoch: the copy window (``kvstore.tombstones``) opened before asking the
            shared tier, which its hits' promotion closes; ``None`` if it was not asked.
        replies: once entered, per block, its ready Get reply message where the
            top tier holds one (:attr:`~kvstore.tiers.base.TierLease.replies`),
            valid as long as the blocks are; ``None`` when none was lent.
        num_lent: the blocks of a read the top tier lent whole (pinned only if it does not lend by reference).
        top_misses: for such a read, until it is closed, whether it asked for
            more blocks than were cached (its counts are made then); else ``None``.
    """

    __slots__ = ("_store", "namespace", "block_hashes", "lend", "pinned", "releases", "promotions", "shared_epoch",
                 "replies", "num_lent", "top_misses", "_closed")

    def __init__(self, store: TieredStore, namespace: Namespace, block_hashes: Sequence[BlockHash], lend: bool) -> None:
        self._store = store
        self.namespace = namespace
        self.block_hashes = block_hashes
        self.lend = lend
        self.pinned: list[tuple[BlockKey, int | None]] = []
        self.releases: list[Callable[[], None]] = []
        self.promotions: list[tuple[int | None, list[BlockKey], list[bytes]]] = []
        self.shared_epoch: int | None = None
        self.replies: list[bytes | None] | None = None
        self.num_lent = 0
        self.top_misses: bool | None = None
        self._closed = False

    async def open(self) -> list[Buffer]:
        """Pin and lease the prefix and return its blocks (``async with`` calls it); pair it with :meth:`close`.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        try:
            return await self._store._open_read(self)
        except BaseException:
            self.close()  # what was pinned or leased before the error
            raise

    def open_now(self) -> list[Buffer] | None:
        """:meth:`open` without waiting, in the common case: the top tier lends the whole cached prefix.

        ``None`` when that is not the case; then call :meth:`open`. The
        service's Get takes this path first: a coroutine less on every call.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        return self._store._open_read_now(self)

    def close(self) -> None:
        """Release what :meth:`open` took, count the read, and start its promotions; a second call does nothing.

        A plain call, so that a caller may run it a moment later (the service's
        Get, with ``loop.call_soon``, once its reply is on the way).
        """
        if not self._closed:
            self._closed = True
            self._store._close_read(self)

    async def __aenter__(self) -> list[Buffer]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def chain_metas(meta: BlockMeta, num_blocks: int) -> list[BlockMeta]:
    """``meta`` for each of ``num_blocks`` blocks in prefix order, the head most recent.

    A restart rebuilds the eviction order by sorting on ``last_access``
    (:meth:`TieredStore.start`); with one time for a whole put, the blocks of a
    chain tied and came back in key order, so one eviction could take a head and
    kill the whole prefix. A step of :data:`~kvstore.tiers.base.CHAIN_STEP_S` per block keeps the
    rule that a chain's tail goes before its head.
    """
    return [dataclasses.replace(meta, last_access=meta.last_access - i * CHAIN_STEP_S) for i in range(num_blocks)]


def _namespace_mismatch(namespace: Namespace, header: BlockHeader) -> str:
    """How a block's header contradicts its namespace (dtype, layout, tokens per block); ``""`` if it does not."""
    if header.dtype != namespace.dtype or header.layout.value != namespace.layout:
        return (f"{header.dtype}/{header.layout.value} does not match the namespace's "
                f"{namespace.dtype}/{namespace.layout}")
    tokens = header.shape[3] if header.layout is Layout.KV else header.shape[2]
    if tokens != namespace.block_size:
        return f"holds {tokens} tokens, the namespace's block size is {namespace.block_size}"
    return ""


async def open_async_store(config: StoreConfig | None = None, *,
                           reply_head: Callable[[int], bytes | None] | None = None) -> TieredStore:
    """Build the tiers named by ``config`` and open a started :class:`TieredStore`.

    The memory tier comes first when enabled, then the LMDB tier when
    ``disk.path`` is set, then Redis as the shared tier when ``redis.url`` is set.

    Args:
        config: the store's configuration; the defaults when ``None``.
        reply_head: given by ``kvstore serve``: the head of the Get reply of a
            block of ``n`` bytes (``kvstore.server.wire.reply_head``); with it, a
            ``cpu`` memory tier of ``storage: auto`` is the heap tier, which
            stores every block as its ready reply (``kvstore.tiers.heap``).

    Raises:
        ConfigError: if no tier is enabled.
    """
    from kvstore.errors import ConfigError

    config = config or StoreConfig()
    tiers: list[Tier] = []
    memory = config.memory
    if memory.enabled and memory.capacity_bytes > 0:
        if memory.storage == "heap" or (memory.storage == "auto" and reply_head is not None
                                        and memory.device == "cpu"):
            from kvstore.tiers.heap import HeapTier

            tiers.append(HeapTier.from_config(memory, reply_head=reply_head))
        else:
            from kvstore.tiers.memory import MemoryTier

            tiers.append(MemoryTier.from_config(memory))
    if config.disk.path:
        from kvstore.tiers.lmdb import LMDBTier

        tiers.append(LMDBTier.from_config(config.disk))
    shared = None
    if config.redis.url:
        from kvstore.tiers.redis import RedisTier

        shared = RedisTier.from_config(config.redis)
    if not tiers and shared is None:
        raise ConfigError("store", "no tier is enabled: enable memory, or set disk.path or redis.url")
    store = TieredStore(tiers, config, shared=shared)
    await store.start()
    return store


