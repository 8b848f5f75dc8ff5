"""Naming misses on a node: the namespaces it has seen, the counts of missed blocks by cause, and ``explain``.

``kvstore.store.misses`` holds the causes and the history of removals (pure logic,
shared with the simulator); this module is the store's use of them. A lookup's
missed blocks are counted by cause (:meth:`MissLedger.lookup_missed`); a get
that falls short of a prefix a lookup had found counts its missing blocks as
``lease_lost`` (evicted in between); and :meth:`MissLedger.explain`
gives one request's blocks, hit or cause, in words and as data (``kvstore
explain``, ``docs/agentic.md``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey, Namespace
from kvstore.store.misses import (
    AFTER_MISS,
    CAUSES,
    DELETED,
    DROPPED,
    EVICTED,
    EXPIRED,
    LEASE_LOST,
    LOST,
    NEVER_STORED,
    OTHER_NAMESPACE,
    TIER_UNAVAILABLE,
    MissCounts,
    MissHistory,
    Removal,
    classify,
)

MAX_RECENT_REQUESTS = 4096
"""Lookups a node remembers by their ``request_id``, for ``kvstore explain --request-id``."""

MAX_RECENT_BLOCKS = 1 << 16
"""Block hashes those remembered lookups keep at most (the oldest lookups are forgotten first past it)."""

MAX_PROMISED = 4096
"""Cached prefixes lookups found, remembered by their last block, so that a get falling short of one counts."""

MAX_NAMESPACES = 4096
"""Namespaces a node remembers (the first put of each), the least recently stored to forgotten first."""

NEAR_FIELDS = ("model", "revision", "dtype", "layout", "block_size", "tp_size", "adapter", "cache_salt",
               "hash_algorithm", "kv_encoding")
"""The fields whose difference makes another namespace a *near* one (``other_namespace``); a rank alone is not."""

MAX_NEAR_DIFFERENCES = 2
"""A namespace differing in at most this many of :data:`NEAR_FIELDS` is near."""


def differing_fields(a: Namespace, b: Namespace) -> list[str]:
    """The fields of :data:`NEAR_FIELDS` (and ``tp_rank``) in which two namespaces differ, in that order."""
    return [name for name in (*NEAR_FIELDS, "tp_rank") if getattr(a, name) != getattr(b, name)]


class NamespaceRegistry:
    """The namespaces a node stored blocks under, by tag: to tell a miss in a namespace it never stored from a
    configuration that changed (a near namespace holds blocks)."""

    def __init__(self, capacity: int = MAX_NAMESPACES) -> None:
        self._namespaces: OrderedDict[bytes, Namespace] = OrderedDict()
        self._near: dict[bytes, tuple[Namespace, list[str]] | None] = {}
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._namespaces)

    def learn(self, namespace: Namespace) -> None:
        """A put stored blocks under ``namespace``."""
        tag = namespace.tag
        if tag in self._namespaces:
            return
        self._namespaces[tag] = namespace
        self._near.clear()  # a verdict may change with a new namespace
        while len(self._namespaces) > self._capacity:
            self._namespaces.popitem(last=False)

    def known(self, tag: bytes) -> bool:
        """Whether blocks were stored under the namespace ``tag`` since the node started."""
        return tag in self._namespaces

    def get(self, tag: bytes) -> Namespace | None:
        """The namespace of ``tag``, if known."""
        return self._namespaces.get(tag)

    def nearest(self, namespace: Namespace) -> tuple[Namespace, list[str]] | None:
        """The known namespace nearest ``namespace`` and the fields they differ in, when it differs in at most
        :data:`MAX_NEAR_DIFFERENCES` of :data:`NEAR_FIELDS`; ``None`` otherwise."""
        tag = namespace.tag
        if tag in self._near:
            return self._near[tag]
        best: tuple[Namespace, list[str]] | None = None
        for other in self._namespaces.values():
            if other.tag == tag:
                continue
            fields = differing_fields(namespace, other)
            near = [name for name in fields if name != "tp_rank"]
            if near and len(near) <= MAX_NEAR_DIFFERENCES and (best is None or len(fields) < len(best[1])):
                best = (other, fields)
        if len(self._near) >= self._capacity:  # a verdict per namespace asked about: bounded as the namespaces are
            self._near.clear()
        self._near[tag] = best
        return best


@dataclass(frozen=True, slots=True)
class BlockExplanation:
    """One block of an explained request.

    Attributes:
        position: its position in the request, 0 the head.
        block_hash: its hash, hex.
        hit: whether a lookup now finds it (in the cached prefix).
        tier: the tier holding it (a hit, or ``after_miss``), ``""`` otherwise.
        cause: for a miss, one of ``kvstore.store.misses.CAUSES``; ``""`` for a hit.
        detail: the cause in words a person reads.
        removed_s: when it was removed (``evicted``, ``expired``, ``dropped``, ``lost``, ``deleted``), wall-clock
            seconds; 0.0 otherwise.
        removed_from: the tier it was removed from, ``""`` if none.
        priority: its priority when removed (-1 when unknown).
        other_namespace: for ``other_namespace``, the near namespace's fields that differ, e.g. ``["dtype"]``.
    """

    position: int
    block_hash: str
    hit: bool
    tier: str = ""
    cause: str = ""
    detail: str = ""
    removed_s: float = 0.0
    removed_from: str = ""
    priority: int = -1
    other_namespace: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {**dataclasses.asdict(self), "other_namespace": list(self.other_namespace)}


_WORDS = {
    NEVER_STORED: "never stored on this node (or removed before the oldest removal it remembers)",
    EVICTED: "evicted",
    EXPIRED: "evicted after its TTL ran out",
    DROPPED: "dropped instead of demoted (under the demotion floor, or the demotion failed)",
    LOST: "its record could not be read, so it was forgotten",
    DELETED: "deleted by a client (Delete or Clear)",
    AFTER_MISS: "cached, but after a block that missed: a hit is a prefix",
    TIER_UNAVAILABLE: "it had left for the shared tier, which is down",
    LEASE_LOST: "a get did not find it after its lookup had (evicted in between)",
}


class MissLedger:
    """A store's counts of missed blocks by cause, its namespace registry, and ``explain``.

    Args:
        history: the index's history of removals.
        tier_names: the store's tier names, fastest first (the shared tier last, if any).
        policy: the store's policy name (for explanations).
        clock: wall clock, seconds.
    """

    def __init__(self, history: MissHistory[BlockKey], tier_names: Sequence[str], policy: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.history = history
        self.counts = MissCounts()
        self.namespaces = NamespaceRegistry()
        self._tier_names = tuple(tier_names)
        self._policy = policy
        self._clock = clock
        self._recent: OrderedDict[str, tuple[Namespace, list[bytes]]] = OrderedDict()
        self._recent_blocks = 0
        self._promised: OrderedDict[BlockKey, None] = OrderedDict()

    def namespace_cause(self, namespace: Namespace, namespace_bytes: int) -> str:
        """What a block with no record of its own is in ``namespace``: ``other_namespace`` when the node never
        stored under it, holds none of its blocks, and knows a near namespace; else ``never_stored``."""
        tag = namespace.tag
        if namespace_bytes or self.namespaces.known(tag):
            return NEVER_STORED
        return OTHER_NAMESPACE if self.namespaces.nearest(namespace) is not None else NEVER_STORED

    def lookup_missed(self, namespace: Namespace, keys: Sequence[BlockKey],
                      resident_many: Callable[[Sequence[BlockKey]], Sequence[bool]],
                      namespace_bytes: Callable[[bytes], int], shared_down: bool) -> None:
        """Count the missed blocks of one lookup (``keys``, from its first miss) by cause.

        ``resident_many`` (whether a local tier holds each key) and ``namespace_bytes`` (bytes of a namespace tag)
        are the index's, asked only when some key has no removal in the history (a key it holds is in no tier:
        the history forgets a block stored again). The common cases cost one C pass: the tail of a chain
        evicted together (one removal record, equal for every block) and a chain never seen.
        """
        removals = self.history.get_many(keys)
        first = removals[0]
        if first is not None and removals.count(first) == len(removals) and not (shared_down and first & 0x10):
            self.counts.count_removal(first, len(removals), self._clock())
            return
        if None not in removals:
            causes = classify(None, removals, shared_down=shared_down)
        else:
            causes = classify(resident_many(keys), removals, shared_down=shared_down,
                              namespace_cause=self.namespace_cause(namespace, namespace_bytes(namespace.tag)))
        self.counts.count(causes, removals, self._clock() if self.history.capacity else 0.0)

    def promise(self, last_key: BlockKey) -> None:
        """A lookup found a cached prefix ending at ``last_key``: a get of it that falls short lost a race."""
        promised = self._promised
        promised[last_key] = None
        promised.move_to_end(last_key)
        if len(promised) > MAX_PROMISED:
            promised.popitem(last=False)

    def get_missed(self, last_key: BlockKey | None, num_blocks: int) -> None:
        """A get (whose last key is ``last_key``) did not return ``num_blocks`` of its blocks: counted as
        ``lease_lost`` when a lookup had found them (:meth:`promise`); a get no lookup promised is no request of
        its own (a connector that gets without a lookup looks up before its put, where misses are counted)."""
        if num_blocks > 0 and last_key is not None and self._promised.pop(last_key, 0) is None:
            self.counts.by_cause[LEASE_LOST] += num_blocks

    def explain(self, namespace: Namespace, block_hashes: Sequence[bytes], keys: Sequence[BlockKey],
                levels: Sequence[int | None], hit: int, namespace_bytes: int,
                shared_down: bool) -> list[BlockExplanation]:
        """Each block of a request: hit, or the cause of its miss with what the node knows of it.

        Args:
            namespace: the request's namespace.
            block_hashes: its block hashes, head first.
            keys: their tier keys.
            levels: per block, the tier index holding it (into the store's tier names), or ``None``.
            hit: the cached prefix's length, blocks.
            namespace_bytes: bytes the namespace holds in the local tiers.
            shared_down: whether the shared tier is down now.
        """
        removals = self.history.get_many(keys[hit:])
        causes = classify([level is not None for level in levels[hit:]], removals,
                          namespace_cause=self.namespace_cause(namespace, namespace_bytes), shared_down=shared_down)
        near = self.namespaces.nearest(namespace) if OTHER_NAMESPACE in causes else None
        out: list[BlockExplanation] = []
        for position, (block_hash, level) in enumerate(zip(block_hashes, levels)):
            tier = self._tier_names[level] if level is not None else ""
            if position < hit:
                out.append(BlockExplanation(position, bytes(block_hash).hex(), True, tier))
                continue
            cause = causes[position - hit]
            packed = removals[position - hit]
            removal = Removal.unpack(packed) if packed is not None else None
            out.append(self._missed(position, bytes(block_hash).hex(), tier, cause, removal, near))
        return out

    def _missed(self, position: int, block_hash: str, tier: str, cause: str, removal: Removal | None,
                near: tuple[Namespace, list[str]] | None) -> BlockExplanation:
        detail = _WORDS.get(cause, cause)
        fields: tuple[str, ...] = ()
        if cause == OTHER_NAMESPACE and near is not None:
            other, differ = near
            fields = tuple(differ)
            changes = ", ".join(f"{name} {getattr(other, name)!r} here, {name} of the request differs"
                                for name in differ)
            detail = (f"never stored under this namespace; blocks of a namespace that differs in "
                      f"{' and '.join(differ)} are here ({changes})")
        removed_from = ""
        if removal is not None and cause not in (AFTER_MISS,):
            removed_from = self._tier_names[removal.level] if removal.level < len(self._tier_names) else ""
            age = max(0.0, self._clock() - removal.at_s)
            detail = (f"{detail}: removed from {removed_from} {age:.0f} s ago"
                      f"{f' under the {self._policy} policy' if removal.cause in (EVICTED, EXPIRED) else ''}"
                      f", at priority {removal.priority}")
            if removal.shared:
                detail += "; it was then in the shared tier"
        return BlockExplanation(position, block_hash, False, tier, cause, detail,
                                float(removal.at_s) if removal is not None else 0.0, removed_from,
                                removal.priority if removal is not None else -1, fields)

    def snapshot(self) -> dict[str, int]:
        """Blocks missed per cause (every cause present)."""
        return {cause: self.counts.by_cause.get(cause, 0) for cause in CAUSES}

    def near_namespace(self, namespace: Namespace, blocks: Sequence[BlockExplanation]) -> Namespace | None:
        """For an explanation with ``other_namespace`` blocks, the near namespace the node holds blocks of."""
        if not any(block.cause == OTHER_NAMESPACE for block in blocks):
            return None
        near = self.namespaces.nearest(namespace)
        return near[0] if near is not None else None

    def remember(self, request_id: str, namespace: Namespace, block_hashes: Sequence[bytes]) -> None:
        """Keep a lookup's namespace and hashes under its ``request_id`` (bounded: :data:`MAX_RECENT_REQUESTS`,
        :data:`MAX_RECENT_BLOCKS`)."""
        recent = self._recent
        old = recent.pop(request_id, None)
        if old is not None:
            self._recent_blocks -= len(old[1])
        hashes = [bytes(h) for h in block_hashes][:MAX_RECENT_BLOCKS]
        recent[request_id] = (namespace, hashes)
        self._recent_blocks += len(hashes)
        while len(recent) > MAX_RECENT_REQUESTS or self._recent_blocks > MAX_RECENT_BLOCKS:
            _, (_, dropped) = recent.popitem(last=False)
            self._recent_blocks -= len(dropped)

    def recent(self, request_id: str) -> tuple[Namespace, list[bytes]] | None:
        """The namespace and hashes of the last lookup named ``request_id``, if it is still remembered; else of the
        last one named ``request_id`` and a suffix (vLLM adds ``-<8 hex digits>`` to the ids it is given)."""
        found = self._recent.get(request_id)
        if found is None:
            prefix = request_id + "-"
            found = next((value for name, value in reversed(self._recent.items()) if name.startswith(prefix)), None)
        return found
