"""The merge of several nodes' answers to Stats and Health."""

from __future__ import annotations

from typing import Any, Sequence

from kvstore.api import StoreStats, TierStats, merge_tier_status
from kvstore.errors import UnavailableError


def merge_store_stats(node_stats: Sequence[StoreStats]) -> StoreStats:
    """The tier-by-tier sum of several nodes' stats (tiers in order of first appearance).

    Every count is summed (the lookup counts too), ``counters`` key by key; ``blocks`` is ``-1`` when any
    node reports ``-1`` for that tier (e.g. a shared Redis). Nodes that share one
    Redis each count their own Redis hits, so the sums stay meaningful.

    Args:
        node_stats: one :class:`StoreStats` per node.
    """
    merged: dict[str, dict[str, Any]] = {}
    for stats in node_stats:
        for tier in stats.tiers:
            acc = merged.get(tier.name)
            if acc is None:
                merged[tier.name] = {f: getattr(tier, f) for f in _TIER_FIELDS} | {"counters": dict(tier.counters)}
                merged[tier.name].update(merge_tier_status({}, tier))  # state and last_error
                continue
            acc.update(merge_tier_status(acc, tier))
            for f in _TIER_FIELDS:
                value = getattr(tier, f)
                acc[f] = -1 if f == "blocks" and (value < 0 or acc[f] < 0) else acc[f] + value
            for key, count in tier.counters.items():
                acc["counters"][key] = acc["counters"].get(key, 0) + count
    gaps = [stats.reuse_gap_counts for stats in node_stats if stats.reuse_gap_counts]
    return StoreStats(tuple(TierStats(name=name, **fields) for name, fields in merged.items()),
                      sum(stats.lookup_hit_blocks for stats in node_stats),
                      sum(stats.lookup_miss_blocks for stats in node_stats),
                      missed_blocks=_sum_maps([stats.missed_blocks for stats in node_stats]),
                      reuse_gap_counts=tuple(map(sum, zip(*gaps))) if gaps else (),
                      reuse_gap_sum_s=sum(stats.reuse_gap_sum_s for stats in node_stats),
                      counters=_sum_maps([stats.counters for stats in node_stats]))


def _sum_maps(maps: Sequence[dict[str, int]]) -> dict[str, int]:
    """Key-by-key sums of counts (``StoreStats.missed_blocks``, ``counters``)."""
    out: dict[str, int] = {}
    for counts in maps:
        for key, count in counts.items():
            out[key] = out.get(key, 0) + count
    return out


_TIER_FIELDS = ("blocks", "bytes", "capacity_bytes", "logical_bytes", "hits", "misses", "evictions", "demotions", "promotions",
                "corrupt_records", "pinned_bytes")


def merge_health(statuses: Sequence[str | None]) -> str:
    """Several nodes' health statuses as one: ``SERVING`` if any node serves, else the first answer.

    Args:
        statuses: each node's status name, ``None`` for a node that did not answer.

    Raises:
        UnavailableError: if no node answered.
    """
    answered = [s for s in statuses if s is not None]
    if not answered:
        raise UnavailableError("no kvstore node answered the health check")
    return "SERVING" if "SERVING" in answered else answered[0]
