"""Prometheus export of the event publisher's counts, read at scrape time (the publisher only counts)."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class EventsCollector(Collector):
    """``kvstore_events_total{event}`` (the publisher's counts) and its gauges ``kvstore_events_queued``,
    ``kvstore_events_replays_pending`` and ``kvstore_events_buffered_bytes``.

    Counts (``EventPublisher.counters``): ``batches`` sent, ``events`` in them,
    ``dropped_events`` (block changes the full log dropped), ``overflows`` (each
    announced as a clear), ``subscriber_overruns`` (sends that found a
    subscriber's queue at its high-water mark: it lost one or more batches),
    ``replays``, ``replay_errors`` (malformed requests), ``replays_refused``
    (too many at once), ``replays_abandoned`` (their peer read nothing), ``replayed_batches`` (sent to
    replay peers).

    Args:
        counters: the publisher's counts by name; safe to call from the scrape thread (plain ints).
    """

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The families, empty."""
        return list(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The counts, and the levels as gauges."""
        try:
            counts = dict(self._counters())
        except Exception as exc:  # noqa: BLE001 - a closed publisher must not break /metrics
            logger.warning("event publisher counts unavailable for /metrics: %s", exc)
            return
        total, *gauges = self._families()
        for gauge, name in zip(gauges, _GAUGES):
            gauge.add_metric([], counts.pop(name, 0))
        for name, count in sorted(counts.items()):
            total.add_metric([name], count)
        yield total
        yield from gauges

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (CounterMetricFamily("kvstore_events", "Counts of the KV event publisher.", labels=["event"]),
                GaugeMetricFamily("kvstore_events_queued", "Block changes queued for the event publisher."),
                GaugeMetricFamily("kvstore_events_replays_pending", "Replays under way on the replay socket."),
                GaugeMetricFamily("kvstore_events_buffered_bytes", "Bytes of batches kept for replay, every stream."))


_GAUGES = ("queued", "replays_pending", "buffered_bytes")
"""The levels among the publisher's counts, in the order of the gauge families."""
