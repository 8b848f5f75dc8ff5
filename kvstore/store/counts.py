"""Event counts of the store's tiers: one owner, counted by the store and its mover, exported by the server."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from kvstore.api import StoreStats, TierStats
from kvstore.store.explain import MissLedger
from kvstore.store.index import Index
from kvstore.keys import BlockKey
from kvstore.policy.sessions import SessionTracker
from kvstore.tiers.base import Tier, tier_status


@dataclass(slots=True)
class TierCounts:
    """Event counts of one tier, each defined once (``docs/service.md``, "Metrics"), the same way for every tier.

    Attributes:
        hits: blocks a get served from this tier.
        misses: blocks a lookup or a get asked this tier for and it could not serve: a get's blocks
            served from a tier below it, the first block a get found in no tier, and every block a
            lookup asked for past the cached prefix (in every tier: none held it).
        evictions: blocks that left this tier to make room, or as the store closed (a volatile
            tier is flushed into a persistent one): demoted or dropped.
        demotions: blocks written into this tier by an eviction from the tier above.
        promotions: blocks copied from this tier into the top tier after a hit.
        lost_records: blocks the index placed in this tier that a read did not
            find there (gone, corrupt or unreadable): forgotten at once.
        mismatched: blocks read from a persistent tier that did not fit their
            namespace (dtype, layout, block size): deleted, and counted as corrupt.
        copies_dropped: copies into this tier given up because the background queue was full.
        dropped_demotions: victims of this tier that were to be demoted and were dropped instead, by reason
            (``no_room``: the tier below could not take them; ``unavailable``: a tier failed).
        refused_puts: blocks of puts this tier refused, by reason (``no_room``: it could not make room once
            the evictions in flight ended; ``too_large``: larger than every tier).
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    lost_records: int = 0
    mismatched: int = 0
    copies_dropped: int = 0
    dropped_demotions: dict[str, int] = field(default_factory=dict)
    refused_puts: dict[str, int] = field(default_factory=dict)


def count(counts: dict[str, int], reason: str, num_blocks: int) -> None:
    """Add ``num_blocks`` to ``counts[reason]``."""
    counts[reason] = counts.get(reason, 0) + num_blocks


def count_get(counts: Sequence[TierCounts], hit_tiers: list[int], num_asked: int) -> None:
    """Count one get: ``hit_tiers`` are the tiers (indexes into ``TieredStore.tier_names``) of the blocks it served.

    A block served from tier ``t`` is a hit there and a miss in every tier
    above; the first block it did not find (if it asked for more) is a miss
    in every tier. These are the definitions of ``docs/service.md``.
    """
    for t in hit_tiers:
        counts[t].hits += 1
        for above in range(t):
            counts[above].misses += 1
    if len(hit_tiers) < num_asked:
        for c in counts:
            c.misses += 1


MAX_TENANTS = 64
"""Tenants whose lookups are counted apart (:class:`TenantLookups`); the others share the label ``other``."""


def tenant_label(cache_salt: str) -> str:
    """The label of a tenant in the stats and metrics: ``default`` without a salt, else ``t-`` and the first 8
    hex digits of the salt's SHA-256 (``/metrics`` is unauthenticated, and a salt may be a secret)."""
    if not cache_salt:
        return "default"
    return "t-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:8]


class TenantLookups:
    """Blocks lookups found cached and missed, by tenant (:func:`tenant_label`), for at most :data:`MAX_TENANTS`."""

    def __init__(self, max_tenants: int = MAX_TENANTS) -> None:
        self._max = max_tenants
        self._labels: dict[str, str] = {}
        self.counts: dict[str, list[int]] = {}

    def count(self, cache_salt: str, hit: int, miss: int) -> None:
        """Count one lookup of the tenant ``cache_salt``: ``hit`` blocks in the cached prefix, ``miss`` past it."""
        label = self._labels.get(cache_salt)
        if label is None:
            label = tenant_label(cache_salt) if len(self._labels) < self._max else "other"
            if label != "other":
                self._labels[cache_salt] = label
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = [0, 0]
        counts[0] += hit
        counts[1] += miss

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """The counts, ``{label: (hit, miss)}``."""
        return {label: (c[0], c[1]) for label, c in self.counts.items()}


def count_lookup(counts: Sequence[TierCounts], num_missed: int) -> None:
    """Count one lookup's blocks past its cached prefix, ``num_missed``, as misses of every tier.

    With :func:`count_get` a tier's ``hits / (hits + misses)`` is then the share of the
    blocks asked of it that it served, for clients that look up, then get the prefix
    (every connector): a lookup that finds nothing is a miss, though no get follows.
    """
    if num_missed > 0:
        for c in counts:
            c.misses += num_missed


def store_stats(index: Index, tiers: Sequence[Tier], counts: Sequence[TierCounts], lookup_hit_blocks: int,
                lookup_miss_blocks: int, tenants: TenantLookups | None = None) -> StoreStats:
    """A store's :class:`StoreStats`: per tier (the local ones, fastest first, then the shared one), its blocks and
    bytes (local tiers: the index's; the shared tier: ``-1`` and 0, it is not indexed), capacity, these counts and
    the tier's own counters; and the blocks lookups hit and missed."""
    result = []
    for level, (tier, tier_counts) in enumerate(zip(tiers, counts)):
        extra = dict(tier.counters())
        status = tier_status(tier)
        local = level < len(index.policies)
        if local:
            extra["lost_records"] = tier_counts.lost_records
        if tier_counts.copies_dropped:
            extra["copies_dropped"] = tier_counts.copies_dropped
        for reason, num_blocks in tier_counts.dropped_demotions.items():
            extra[f"dropped_demotions_{reason}"] = num_blocks
        for reason, num_blocks in tier_counts.refused_puts.items():
            extra[f"refused_puts_{reason}"] = num_blocks
        result.append(TierStats(
            name=tier.name,
            blocks=len(index.policies[level]) if local else -1,
            bytes=index.policies[level].nbytes if local else 0,
            logical_bytes=index.logical.logical_bytes(level, index.policies[level].nbytes) if local else 0,
            capacity_bytes=tier.capacity_bytes or 0,
            hits=tier_counts.hits,
            misses=tier_counts.misses,
            evictions=tier_counts.evictions,
            demotions=tier_counts.demotions,
            promotions=tier_counts.promotions,
            corrupt_records=extra.pop("corrupt_records", 0) + tier_counts.mismatched,
            counters=extra,
            state=status.get("state", ""),
            last_error=status.get("last_error", ""),
        ))
    return StoreStats(tuple(result), lookup_hit_blocks, lookup_miss_blocks,
                      tenants.snapshot() if tenants is not None else {})


def agentic_stats(stats: StoreStats, index: Index, misses: MissLedger, sessions: SessionTracker[BlockKey] | None,
                  ttl_clamped: int) -> StoreStats:
    """``stats`` with the missed blocks by cause and reuse gaps of ``misses``, and the counts of the TTLs and
    sessions (``StoreStats.counters``), and each local tier's pinned bytes (``TierStats.pinned_bytes``).

    Args:
        stats: what :func:`store_stats` made.
        index: the store's index (its pins, history and policies).
        misses: the store's :class:`~kvstore.store.explain.MissLedger`.
        sessions: the ``session`` policy's tracker, or ``None`` under another policy.
        ttl_clamped: TTLs taken at ``store.pins.max_ttl_s`` (``TieredStore.ttl_clamped``).
    """
    refused = index.pins.refused
    counters = {
        "pinned_bytes": index.pins.pinned_bytes(),
        "pins_refused_tier": refused.get("tier", 0),
        "pins_refused_node": refused.get("node", 0),
        "pins_refused_tenant": refused.get("tenant", 0),
        "pins_displaced": index.pins.displaced,
        "ttl_clamped": ttl_clamped,
        "sessions": len(sessions) if sessions is not None else 0,
        "cooled_chains": sessions.cooled_chains if sessions is not None else 0,
        "bounded_puts": sessions.bounded_puts if sessions is not None else 0,
        "miss_history_blocks": len(index.history),
    }
    tiers = tuple(
        dataclasses.replace(tier, pinned_bytes=index.policies[level].pinned_nbytes)
        if level < len(index.policies) else tier
        for level, tier in enumerate(stats.tiers))
    counts = misses.counts
    return dataclasses.replace(stats, tiers=tiers, missed_blocks=misses.snapshot(),
                               reuse_gap_counts=tuple(counts.reuse_gap_counts), reuse_gap_sum_s=counts.reuse_gap_sum_s,
                               counters=counters)
