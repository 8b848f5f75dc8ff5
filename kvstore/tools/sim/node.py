"""The simulator's node: the store's own ``TieredStore`` over metadata-only tiers, replaying requests as a client does.

``kvstore simulate`` runs this; ``kvstore loadtest`` with one worker runs the same requests against a real node,
and the two count the same hits and name the same misses (``tests/sim/test_node_agreement.py`` checks it exactly).
There is no second copy of the store's order here: every touch, insert, hold, pin, eviction, demotion and promotion
is the store's (``kvstore.store.placement``, ``kvstore.store.reads``, ``kvstore.store.mover``, ``kvstore.store.index``), over tiers that keep
only which keys they hold (``kvstore.tiers.metadata``), each block one unit of capacity, so a capacity is a number
of blocks.

One request, with trace block ids ``b[0..n)`` (head first), is what a load-test worker sends a node
(``kvstore.tools.loadtest.runner``): a lookup of ``b``, a get of the cached prefix ``b[0..h)``, and a put of ``b[h..n)``.
The get reads as the same-host Get does: settled at once (its promotions offered), the memory blocks it lent still
leased, and the lease released at the promotion's first disk I/O (the disk tier lets the loop turn there, as LMDB's
thread does). The clock is the trace's: a request runs at its timestamp. Between two calls the store's background
work is drained (a promotion of the get's disk hits ends before the put), as the node's ends while the client waits
for a reply; ``docs/simulate.md`` explains the order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.blocks.tensors import Layout, encode_header
from kvstore.config import PinsConfig, StoreConfig
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockHash, BlockKey, Namespace, block_keys
from kvstore.config import DEFAULT_HISTORY_BLOCKS
from kvstore.store.misses import MissCounts
from kvstore.policy import DEFAULT_PRIORITY, EvictionPolicy, resolve_policy_name
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.metadata import LendingMetadataTier, MetadataTier
from kvstore.tools.trace import TraceRequest
from kvstore.validation import BlockChecker, CheckedBlocks

SIM_MODEL = "kvstore-simulate"
"""``Namespace.model`` of the simulated blocks; a request's namespace label is its ``revision``."""

_BLOCK_TOKENS = 16  # tokens per simulated block: any size does, each block is one unit of capacity
_HASH_BYTES = 16  # xxh3-128: a trace block id, little-endian, is its block hash


_QUIET_LOGGERS = ("kvstore.store.mover",)
"""Loggers whose warnings a simulation expects (a demotion that finds no room) and keeps to itself."""


class _BelowError(logging.Filter):
    """Lets through only records of ``ERROR`` and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@dataclass(slots=True)
class RequestHits:
    """What one request hit: blocks of its prefix found in the memory tier and in the disk tier."""

    memory: int = 0
    disk: int = 0


def _placeholder_block(namespace: Namespace) -> bytes:
    """One small encoded block of ``namespace`` (``uint8``, ``kv``): the value every simulated put carries."""
    shape = (1, 2, 1, namespace.block_size, 1)
    payload = bytes(2 * namespace.block_size)
    return encode_header(namespace.dtype, Layout.KV, shape, payload) + payload


class SimNode:
    """One node's local tiers, memory and an optional disk tier, as a ``TieredStore`` over metadata-only tiers.

    Sessions, TTLs and pins (``docs/agentic.md``) are the store's own: a request's TTL pins what its lookup finds,
    its get hits and its put stores, clamped to ``store.pins.max_tier_fraction`` of each tier
    (``max_pinned_fraction``; the node's byte caps per node and tenant are not set); with the ``session`` policy
    the store's :class:`~kvstore.policy.sessions.SessionTracker` runs, whose clock is the count of lookups.
    Misses are named by the store (``kvstore.store.explain.MissLedger``): :attr:`misses`.

    Use it as a context manager, or call :meth:`close`: it owns an event loop of its own.

    Args:
        policy: a name ``kvstore.policy.make_policy`` takes (``lru``, ``slru``, ``adaptive``, ``session``,
            ``default``).
        capacity_blocks: blocks the memory tier holds (> 0).
        disk_capacity_blocks: blocks the disk tier holds; 0 for no disk tier.
        default_priority: the tiers' default priority.
        max_pinned_fraction: the share of a tier's blocks that may be pinned at once.
        history_blocks: removals remembered to name misses (the node's ``store.miss_history_blocks``).
        top_policy: a policy to run in the memory tier instead of ``policy``'s (a simulator baseline,
            ``kvstore.tools.sim.baselines``); ``None`` for the store's own.

    Raises:
        InvalidArgumentError: on an unknown policy or a capacity out of range.
    """

    def __init__(self, policy: str, capacity_blocks: int, *, disk_capacity_blocks: int = 0,
                 default_priority: int = DEFAULT_PRIORITY, max_pinned_fraction: float = 0.5,
                 history_blocks: int = DEFAULT_HISTORY_BLOCKS, top_policy: EvictionPolicy[Any] | None = None) -> None:
        if capacity_blocks <= 0 or disk_capacity_blocks < 0:
            raise InvalidArgumentError(f"capacities must be > 0 (memory) and >= 0 (disk) blocks, "
                                       f"got {capacity_blocks} and {disk_capacity_blocks}")
        try:
            resolve_policy_name(policy)
            config = StoreConfig(policy=policy, default_priority=default_priority,
                                 pins=PinsConfig(max_tier_fraction=max_pinned_fraction),
                                 miss_history_blocks=history_blocks)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        tiers: list[Tier] = [LendingMetadataTier(capacity_blocks, name="memory")]
        if disk_capacity_blocks:
            tiers.append(MetadataTier(disk_capacity_blocks, name="disk", yields=True))
        self.now = 0.0
        self._loop = asyncio.new_event_loop()
        self.store = TieredStore(tiers, config, clock=self._clock)
        """The store the requests run through."""
        if top_policy is not None:
            self.store.index.policies[0] = top_policy
        self._top = self.store.index.policies[0]
        self._begin = getattr(self._top, "begin_request", None)  # a baseline's (``kvstore.tools.sim.baselines``)
        self._admit = getattr(self._top, "admit_put", None)
        self._namespace = Namespace(model=SIM_MODEL, dtype="uint8", layout=Layout.KV.value, block_size=_BLOCK_TOKENS)
        self._namespaces: dict[str, tuple[Namespace, BlockChecker]] = {}
        self._block = _placeholder_block(self._namespace)
        self._quiet = _BelowError()
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).addFilter(self._quiet)
        self._loop.run_until_complete(self.store.start())
        self._closed = False

    def _clock(self) -> float:
        return self.now

    @property
    def policies(self) -> list[EvictionPolicy[BlockKey]]:
        """The store's eviction policies, memory first."""
        return self.store.index.policies

    @property
    def misses(self) -> MissCounts:
        """Blocks missed by cause, as the store names them (``kvstore.store.misses``)."""
        return self.store.misses.counts

    @property
    def evicted_blocks(self) -> int:
        """Blocks that left the last tier (dropped)."""
        return self.store.stats().tiers[-1].evictions

    @property
    def demoted_blocks(self) -> int:
        """Blocks the memory tier evicted into the disk tier (0 with no disk tier)."""
        tiers = self.store.stats().tiers
        return tiers[0].evictions if len(tiers) > 1 else 0

    def key_of(self, block_id: int, namespace: str = "") -> BlockKey:
        """The store's key of trace block ``block_id`` in the namespace labelled ``namespace``."""
        return block_keys(self._namespace_of(namespace)[0], [self._hash(block_id)])[0]

    def tier_of(self, block_id: int, namespace: str = "") -> int | None:
        """The tier holding trace block ``block_id`` (0 memory, 1 disk), or ``None``."""
        return self.store.index.level_of(self.key_of(block_id, namespace))

    @staticmethod
    def _hash(block_id: int) -> BlockHash:
        return BlockHash(block_id.to_bytes(_HASH_BYTES, "little"))

    def _namespace_of(self, label: str) -> tuple[Namespace, BlockChecker]:
        """The namespace of a request's label (its ``revision``, as the load test names it) and its block checker."""
        found = self._namespaces.get(label)
        if found is None:
            namespace = dataclasses.replace(self._namespace, revision=label[:128]) if label else self._namespace
            found = self._namespaces[label] = (namespace, BlockChecker(namespace,
                                                                       self.store.config.max_block_bytes))
        return found

    def request(self, blocks: Sequence[int], now: float = 0.0, priority: int | None = None,
                expires_at: float = 0.0, session: str = "", ttl_s: float = 0.0, namespace: str = "") -> RequestHits:
        """Replay one request (module docstring) and return its hits.

        Args:
            blocks: the request's chained trace block ids, head first (ints ``>= 0``).
            now: the request's time, seconds (the store's clock: retention and TTLs).
            priority: the priority of its put (the store's default when ``None``).
            expires_at: when that priority's retention ends (0.0 for none), the store's clock.
            session: the session it names (``""``: none).
            ttl_s: the TTL its lookup, get and put carry, seconds (0.0: none).
            namespace: its namespace label (``""``: the simulator's namespace): a label is a namespace of its
                own, so its blocks are apart from every other label's and a miss in a label never put under
                names ``other_namespace``.

        Raises:
            InvalidArgumentError: as the store raises it (a bad session id or TTL), or after :meth:`close`.
        """
        if self._closed:
            raise InvalidArgumentError("the simulated node is closed")
        return self._loop.run_until_complete(self._request(blocks, now, priority, expires_at, session, ttl_s,
                                                           namespace))

    def replay(self, requests: Sequence[TraceRequest]) -> list[RequestHits]:
        """Replay trace requests in order (each as :meth:`request`, with its time, session, TTL and namespace
        label), in one run of the loop; each request's hits.

        Raises:
            InvalidArgumentError: as :meth:`request`.
        """
        if self._closed:
            raise InvalidArgumentError("the simulated node is closed")
        return self._loop.run_until_complete(self._replay(requests))

    async def _replay(self, requests: Sequence[TraceRequest]) -> list[RequestHits]:
        one = self._request
        return [await one(r.block_ids, r.timestamp_s, None, 0.0, r.session, r.ttl_s, r.namespace) for r in requests]

    async def _request(self, blocks: Sequence[int], now: float, priority: int | None, expires_at: float,
                       session: str, ttl_s: float, label: str) -> RequestHits:
        self.now = now
        store = self.store
        if self._begin is not None:
            self._begin()
        namespace, checker = self._namespace_of(label)
        hashes = [BlockHash(block_id.to_bytes(_HASH_BYTES, "little")) for block_id in blocks]
        session_id = session or None
        ttl = ttl_s or None
        located = await store.locate(namespace, hashes, session_id=session_id, ttl_s=ttl)
        hit = len(located)
        hits = RequestHits()
        if hit:
            hits.memory = located.count(0)
            hits.disk = hit - hits.memory
            read = store.read(namespace, hashes[:hit], session_id=session_id, ttl_s=ttl)
            if read.open_now() is None:  # as the service's Get: the top tier lends the whole prefix, or it awaits
                await read.open()
            read.settle()  # as the same-host Get: counted, let go in the index, promotions offered; still leased
            # the lease is released where the loop next turns: a promotion's first disk I/O, as a client's release
            # lands on a node while LMDB's thread works (at once when nothing is promoted); the promotion ends first
            asyncio.get_running_loop().call_soon(read.close)
            await store.drain()
            read.close()
        if hit < len(hashes):
            rest = hashes[hit:]
            if self._admit is not None:  # a baseline's gate: a put it refuses is not made at all
                keys = block_keys(namespace, rest)
                fresh = [key for key in keys if store.index.level_of(key) is None]
                if fresh and not self._admit(list(dict.fromkeys(fresh)), hit):
                    return hits
            await store.put(namespace, rest, CheckedBlocks([self._block] * len(rest), checker), priority=priority,
                            retention_s=(expires_at - now) if expires_at > now else None, session_id=session_id,
                            ttl_s=ttl)
            await store.drain()
        return hits

    def close(self) -> None:
        """Close the store and the loop; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run_until_complete(self.store.close())
        finally:
            self._loop.close()
            for name in _QUIET_LOGGERS:
                logging.getLogger(name).removeFilter(self._quiet)

    def __enter__(self) -> SimNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
