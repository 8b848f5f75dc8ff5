"""The bulk path's counts as Prometheus metrics: ``kvstore_bulk_events_total{event}`` and a few gauges."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

GAUGES = {"connections": "Bulk connections open.", "grants_outstanding": "Bulk grants issued and not yet redeemed.",
          "grant_held_bytes": "Bytes leased or reserved by bulk grants outstanding or being transferred."}
"""The levels among the counts (``BulkListener.counters``); every other count is an event total."""


class BulkCollector(Collector):
    """The bulk listener's counts, read at scrape time.

    Args:
        counters: the counts by name (``kvstore.bulk.node.listener.BulkListener.counters``); may raise to skip them.
    """

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The families, empty (registering reads nothing)."""
        gauges, events = _families()
        return [*gauges.values(), events]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """One gauge per level, and the other counts as ``kvstore_bulk_events_total{event}``."""
        try:
            counts = self._counters()
        except Exception as exc:  # a closed loop must not break /metrics
            logger.warning("bulk path counts unavailable for /metrics: %s", exc)
            return
        gauges, events = _families()
        for name, count in sorted(counts.items()):
            if name in gauges:
                gauges[name].add_metric([], count)
            else:
                events.add_metric([name], count)
        yield from gauges.values()
        yield events


def _families() -> tuple[dict[str, GaugeMetricFamily], CounterMetricFamily]:
    gauges = {name: GaugeMetricFamily(f"kvstore_bulk_{name}", text) for name, text in GAUGES.items()}
    events = CounterMetricFamily("kvstore_bulk_events", "Bulk path events since start, by event.", labels=["event"])
    return gauges, events
