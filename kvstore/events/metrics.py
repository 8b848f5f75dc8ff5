"""Prometheus export of the event publisher's counts, read at scrape time (the publisher only counts)."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class EventsCollector(Collector):
    """``kvstore_events_total{event}`` (the publisher's counts) and ``kvstore_events_queued`` (a gauge).

    Counts (``EventPublisher.counters``): ``batches`` sent, ``events`` in them,
    ``dropped_events`` (block changes the full log dropped), ``overflows`` (each
    announced as a clear), ``subscriber_overruns`` (sends that found a
    subscriber's queue at its high-water mark: it lost one or more batches),
    ``replays``, ``replay_errors`` (malformed requests).

    Args:
        counters: the publisher's counts by name; safe to call from the scrape thread (plain ints).
    """

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The families, empty."""
        return list(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The counts, and the queue's length as a gauge."""
        try:
            counts = dict(self._counters())
        except Exception as exc:  # noqa: BLE001 - a closed publisher must not break /metrics
            logger.warning("event publisher counts unavailable for /metrics: %s", exc)
            return
        total, queued = self._families()
        queued.add_metric([], counts.pop("queued", 0))
        for name, count in sorted(counts.items()):
            total.add_metric([name], count)
        yield total
        yield queued

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        return (CounterMetricFamily("kvstore_events", "Counts of the KV event publisher.", labels=["event"]),
                GaugeMetricFamily("kvstore_events_queued", "Block changes queued for the event publisher."))
