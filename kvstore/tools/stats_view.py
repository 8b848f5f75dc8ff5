"""``kvstore stats`` for people and for machines: a table of each node's tiers, JSON, and a live view.

A node's :class:`~kvstore.api.StoreStats` become:

* :func:`stats_report`: the JSON document (``--json``, or stdout not a terminal): every field of the
  stats, plus each tier's ``hit_ratio`` and ``fill`` and the node's ``lookup_hit_ratio``; a local
  tier's ``state`` is ``up`` (it is part of the serving node) and a count a tier cannot tell
  (Redis' ``blocks``) is ``null``.
* :func:`format_table`: the table on a terminal: human units, the hit ratio per tier and the
  node's prefix hit ratio, each tier's fill of its capacity.
* :func:`format_watch`: one frame of ``kvstore stats --watch``: the same table, with the rates
  since the previous frame (blocks looked up and served per second, the hit ratio over the interval).

Ratios are defined in ``docs/service.md`` ("Metrics"): a tier's hit ratio is ``hits / (hits +
misses)``, the share of the blocks asked of it that it served; the node's prefix hit ratio is the
blocks lookups found in the cached prefix over the blocks they asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from kvstore.api import StoreStats, TierStats

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

FOOTNOTE = ("hit ratio = hits / (hits + misses): the share of the blocks asked of the tier that it served "
            "(a lookup's blocks past the cached prefix are misses of every tier); fill = stored / capacity; "
            "errors: the tier's errors and corrupt records. docs/service.md defines every counter.")
"""Printed under the table: what its derived columns mean."""


def human_bytes(num_bytes: float) -> str:
    """``1536`` as ``1.5 KiB``: binary units, three significant digits; ``-`` for a negative (unknown) size."""
    if num_bytes < 0:
        return "-"
    value, unit = float(num_bytes), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.3g} {_UNITS[unit]}" if value < 100 else f"{value:.0f} {_UNITS[unit]}"


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or ``None`` when there is nothing to divide by."""
    return numerator / denominator if denominator > 0 else None


def percent(value: float | None) -> str:
    """``0.25`` as ``25.0%``; ``-`` for ``None``; ``<0.1%`` for a share that is not zero but rounds to it."""
    if value is None:
        return "-"
    return "<0.1%" if 0 < value < 0.0005 else f"{100 * value:.1f}%"


def tier_hit_ratio(tier: TierStats) -> float | None:
    """The share of the blocks asked of ``tier`` that it served, ``None`` before any was asked."""
    return ratio(tier.hits, tier.hits + tier.misses)


def tier_fill(tier: TierStats) -> float | None:
    """Stored bytes over capacity, ``None`` for a tier that manages its own (Redis)."""
    return ratio(tier.bytes, tier.capacity_bytes)


def tier_errors(tier: TierStats) -> int:
    """The tier's errors (its own ``errors`` counter, e.g. Redis round trips that failed) and corrupt records."""
    return tier.corrupt_records + int(tier.counters.get("errors", 0))


def lookup_hit_ratio(stats: StoreStats) -> float | None:
    """The node's prefix hit ratio: blocks lookups found cached over blocks they asked for."""
    return ratio(stats.lookup_hit_blocks, stats.lookup_hit_blocks + stats.lookup_miss_blocks)


def stats_report(stats: StoreStats) -> dict[str, Any]:
    """The JSON document of one node's stats (module docstring)."""
    report = dataclasses.asdict(stats)
    for tier, fields in zip(stats.tiers, report["tiers"]):
        fields["logical_ratio"] = round(tier.logical_ratio, 4)  # logical bytes per stored byte
        fields["hit_ratio"] = _rounded(tier_hit_ratio(tier))
        fields["fill"] = _rounded(tier_fill(tier))
        if tier.blocks < 0:
            fields["blocks"] = None  # the tier cannot tell (shared Redis)
        if not tier.state:
            fields["state"] = "up"  # a local tier is part of the node that answered
    report["lookup_hit_ratio"] = _rounded(lookup_hit_ratio(stats))
    return report


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _count(value: int) -> str:
    return "-" if value < 0 else f"{value:,}"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 or i == 1 else cell.rjust(w) for i, (cell, w) in
                      enumerate(zip(row, widths))).rstrip() for row in rows]


def format_table(target: str, stats: StoreStats) -> str:
    """One node's stats as a table: its prefix hit ratio, then a line per tier, fastest first."""
    looked = stats.lookup_hit_blocks + stats.lookup_miss_blocks
    head = (f"node {target}: prefix hit ratio {percent(lookup_hit_ratio(stats))} "
            f"({stats.lookup_hit_blocks:,} of {looked:,} blocks looked up were cached)")
    rows = [("tier", "state", "blocks", "stored", "capacity", "fill", "hits", "misses", "hit ratio", "evictions",
             "demotions", "promotions", "errors")]
    for tier in stats.tiers:
        rows.append((tier.name, tier.state or "up", _count(tier.blocks),
                     human_bytes(tier.bytes) if tier.capacity_bytes else "-",
                     human_bytes(tier.capacity_bytes) if tier.capacity_bytes else "-",
                     percent(tier_fill(tier)), f"{tier.hits:,}", f"{tier.misses:,}", percent(tier_hit_ratio(tier)),
                     f"{tier.evictions:,}", f"{tier.demotions:,}", f"{tier.promotions:,}", f"{tier_errors(tier):,}"))
    lines = [head, *_columns(rows)]
    for tier in stats.tiers:
        if tier.state == "down" or (tier.last_error and tier.state != "up"):
            lines.append(f"  {tier.name}: {tier.state}" + (f", last error: {tier.last_error}" if tier.last_error else ""))
    return "\n".join(lines)


def format_watch(target: str, stats: StoreStats, previous: StoreStats | None, interval_s: float) -> str:
    """One frame of the live view: the rates since ``previous`` (``interval_s`` ago), then :func:`format_table`."""
    if previous is None or interval_s <= 0:
        rates = "rates: from the next refresh on"
    else:
        hit = stats.lookup_hit_blocks - previous.lookup_hit_blocks
        miss = stats.lookup_miss_blocks - previous.lookup_miss_blocks
        served = {t.name: t.hits - p.hits for t, p in zip(stats.tiers, previous.tiers)}
        rates = (f"last {interval_s:.1f} s: prefix hit ratio {percent(ratio(hit, hit + miss))}, "
                 f"{(hit + miss) / interval_s:,.0f} blocks looked up/s, "
                 + ", ".join(f"{name} {n / interval_s:,.0f} served/s" for name, n in served.items()))
    return f"{format_table(target, stats)}\n{rates}"
