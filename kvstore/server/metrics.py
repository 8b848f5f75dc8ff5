"""Prometheus metrics of the service: request counts and latencies, and the store's stats pulled at scrape time.

The store never imports Prometheus (pull model, as vLLM's ``BlockPool.take_events``):
the servicer counts requests in :class:`CallStats`, and :class:`StoreCollector` asks the store for its
:class:`~kvstore.api.StoreStats` on the store's own event loop whenever
``/metrics`` is scraped. Every metric lives in a private ``CollectorRegistry``,
so several servers in one process (tests) do not collide.

Exported series (conventional ``_total``, ``_bytes`` and ``_seconds`` suffixes):

* ``kvstore_requests_total{method, code}``: finished calls by gRPC method and status code.
* ``kvstore_request_duration_seconds{method}``: call latency histogram.
* ``kvstore_tier_blocks{tier}``, ``kvstore_tier_bytes{tier}`` (stored), ``kvstore_tier_capacity_bytes{tier}``,
  ``kvstore_tier_logical_bytes{tier}`` (decoded, uncompressed) and ``kvstore_tier_logical_ratio{tier}``
  (logical per stored byte): gauges.
* ``kvstore_tier_hits_total``, ``kvstore_tier_misses_total``, ``kvstore_tier_evictions_total``,
  ``kvstore_tier_demotions_total``, ``kvstore_tier_promotions_total``,
  ``kvstore_tier_corrupt_records_total`` ``{tier}``: counters.
* ``kvstore_tier_events_total{tier, event}``: the tiers' extra counters (e.g. Redis ``errors``).
* ``kvstore_lookup_blocks_total{result}``: blocks asked for by lookups, ``hit`` (in the cached prefix)
  or ``miss``; ``hit / (hit + miss)`` is the traffic's prefix hit ratio; and
  ``kvstore_tenant_lookup_blocks_total{tenant, result}`` the same by tenant (``kvstore.store.counts.tenant_label``).
* ``kvstore_tier_up{tier}``: 1 while the tier serves, 0 while it is down (the shared Redis tier).
* ``kvstore_shm_sessions``, ``kvstore_shm_leases``, ``kvstore_shm_leased_bytes``: gauges of the same-host
  data plane (sessions open, leases in force and the bytes they hold), and
  ``kvstore_shm_events_total{event}``: its counts (``sessions_opened``, ``leases_expired``, ``no_room``, ...).
* ``kvstore_reply_budget_waits_total{outcome}``: Gets that waited for their reply budget, ``admitted``
  (their turn came) or ``abandoned`` (deadline, ``max_stream_s``, the client gone);
  ``kvstore_reply_budget_wait_seconds``: a histogram of how long they waited; and
  ``kvstore_reply_budget_held_bytes``: a gauge of the bytes Get replies hold now, over all connections.
* ``kvstore_put_budget_waits_total{outcome}``, ``kvstore_put_budget_wait_seconds`` and
  ``kvstore_put_budget_held_bytes``: the same of the Put budget (a Put block that waited before it was read,
  and the bytes of Put bodies being received).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstore.api import StoreStats
from kvstore.store.misses import REUSE_GAP_BUCKETS_S

if TYPE_CHECKING:
    from kvstore.server.budgets import ByteBudget, PutBudget, ReplyBudget

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Histogram buckets of ``kvstore_request_duration_seconds``, seconds (100 us to 10 s)."""

SCRAPE_TIMEOUT_S = 5.0
"""Seconds a scrape waits for the store's loop to report its stats."""

T = TypeVar("T")


class StoreCollector(Collector):
    """A custom collector that reads the store's stats at scrape time.

    Args:
        stats: returns the store's current stats; must be safe to call from the
            scrape thread (see :meth:`on_loop`), and may raise to skip the tier metrics.
    """

    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    @staticmethod
    def on_loop(loop: asyncio.AbstractEventLoop, stats: Callable[[], T]) -> Callable[[], T]:
        """Wrap ``stats`` so that it runs on ``loop`` (the store's owner) and the caller waits for it.

        The store's counters and index belong to its loop; reading them from the
        HTTP thread directly could see a dict change size mid-iteration. ``stats``
        may return anything (the store's stats, the same-host plane's counts).
        """

        def call() -> T:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:  # already on the owner (e.g. a test calling generate_latest)
                return stats()

            async def collect() -> T:
                return stats()

            return asyncio.run_coroutine_threadsafe(collect(), loop).result(SCRAPE_TIMEOUT_S)

        return call

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The families, empty, so that a filtered scrape finds them and registering never calls the store."""
        gauges, counters, events, lookups, up, tenants = self._families()
        return [*gauges.values(), *counters.values(), events, lookups, up, tenants, *agentic_families(None)]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Yield one family per stat, labelled by tier (called by ``prometheus_client`` on scrape)."""
        try:
            stats = self._stats()
        except Exception as exc:  # a closed loop or a slow store must not break /metrics
            logger.warning("store stats unavailable for /metrics: %s", exc)
            return
        gauges, counters, events, lookups, up, tenants = self._families()
        for tier in stats.tiers:
            up.add_metric([tier.name], 0.0 if tier.state == "down" else 1.0)
            for name, family in gauges.items():
                family.add_metric([tier.name], getattr(tier, name))
            for name, family in counters.items():
                family.add_metric([tier.name], getattr(tier, name))
            for event, count in sorted(tier.counters.items()):
                events.add_metric([tier.name, event], count)
        lookups.add_metric(["hit"], stats.lookup_hit_blocks)
        lookups.add_metric(["miss"], stats.lookup_miss_blocks)
        for tenant, (hit, miss) in sorted(stats.lookup_blocks_by_tenant.items()):
            tenants.add_metric([tenant, "hit"], hit)
            tenants.add_metric([tenant, "miss"], miss)
        yield from gauges.values()
        yield from counters.values()
        yield events
        yield lookups
        yield up
        yield tenants
        yield from agentic_families(stats)

    @staticmethod
    def _families() -> tuple[dict[str, GaugeMetricFamily], dict[str, CounterMetricFamily], CounterMetricFamily,
                             CounterMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
        """The exported families, empty: tier gauges and counters by stat name, tier events, lookup blocks,
        tier up, lookup blocks by tenant."""
        gauges = {
            "blocks": GaugeMetricFamily("kvstore_tier_blocks", "Blocks resident in the tier (-1: unknown).",
                                        labels=["tier"]),
            "pinned_bytes": GaugeMetricFamily("kvstore_tier_pinned_bytes", "Capacity bytes of the tier's blocks whose "
                                              "TTL runs (docs/agentic.md).", labels=["tier"]),
            "bytes": GaugeMetricFamily("kvstore_tier_bytes", "Capacity bytes the tier's blocks occupy.",
                                       labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity of the tier, bytes.",
                                                labels=["tier"]),
            "logical_bytes": GaugeMetricFamily(
                "kvstore_tier_logical_bytes", "Bytes of the tensors the tier's blocks hold, decoded and uncompressed "
                "(what the engine holds; 0 for shared Redis).", labels=["tier"]),
            "logical_ratio": GaugeMetricFamily(
                "kvstore_tier_logical_ratio", "Logical bytes per stored byte of the tier (kvstore_tier_logical_bytes "
                "/ kvstore_tier_bytes; 0 when it holds nothing or cannot tell).", labels=["tier"]),
        }
        counters = {
            name: CounterMetricFamily(f"kvstore_tier_{name}", help_text, labels=["tier"])
            for name, help_text in (  # defined once, in docs/service.md ("Metrics")
                ("hits", "Blocks a get served from the tier."),
                ("misses", "Blocks a lookup or get asked the tier for and it could not serve (served from a tier "
                           "below, or found in none; a lookup's blocks past the cached prefix)."),
                ("evictions", "Blocks that left the tier to make room, or as the store closed (demoted or dropped)."),
                ("demotions", "Blocks written into the tier by an eviction from the tier above."),
                ("promotions", "Blocks copied from the tier into the top tier after a hit."),
                ("corrupt_records", "Records that failed their checksum and were deleted."),
            )
        }
        events = CounterMetricFamily("kvstore_tier_events", "Tier-specific event counts.", labels=["tier", "event"])
        lookups = CounterMetricFamily("kvstore_lookup_blocks", "Blocks asked for by lookups, by whether they were "
                                      "in the cached prefix (the traffic's prefix hit ratio).", labels=["result"])
        up = GaugeMetricFamily("kvstore_tier_up", "1 while the tier serves, 0 while it is down (the shared Redis "
                               "tier can be; a local tier is up while the node serves).", labels=["tier"])
        tenants = CounterMetricFamily(
            "kvstore_tenant_lookup_blocks", "kvstore_lookup_blocks_total by tenant: 'default' (no cache_salt), "
            "'t-' and 8 hex digits of the salt's SHA-256, 'other' past the 64th tenant.", labels=["tenant", "result"])
        return gauges, counters, events, lookups, up, tenants


class SharedMemoryCollector(Collector):
    """The same-host data plane's sessions, leases and counts, read at scrape time.

    Args:
        counters: the counts by name (``kvstore.shm.node.sessions.SessionTable.counters``); may raise to skip them.
    """

    GAUGES = {"sessions": "Same-host sessions open.", "leases": "Same-host leases in force.",
              "leased_bytes": "Bytes of get segments under same-host leases."}

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The families, empty (registering never calls the data plane)."""
        gauges, events = self._families()
        return [*gauges.values(), events]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """One gauge per level, and the counts as ``kvstore_shm_events_total{event}``."""
        try:
            counts = self._counters()
        except Exception as exc:  # a closed loop must not break /metrics
            logger.warning("same-host data plane counts unavailable for /metrics: %s", exc)
            return
        gauges, events = self._families()
        for name, count in sorted(counts.items()):
            if name in gauges:
                gauges[name].add_metric([], count)
            else:
                events.add_metric([name], count)
        yield from gauges.values()
        yield events

    @classmethod
    def _families(cls) -> tuple[dict[str, GaugeMetricFamily], CounterMetricFamily]:
        gauges = {name: GaugeMetricFamily(f"kvstore_shm_{name}", help_text) for name, help_text in cls.GAUGES.items()}
        return gauges, CounterMetricFamily("kvstore_shm_events", "Counts of the same-host data plane.",
                                           labels=["event"])


class BudgetCollector(Collector):
    """A byte budget's waits and held bytes (``kvstore.server.budgets.ByteBudget``), read at scrape time.

    Exports ``kvstore_<kind>_budget_waits_total{outcome}``, ``kvstore_<kind>_budget_wait_seconds`` (a
    histogram) and ``kvstore_<kind>_budget_held_bytes``.

    Args:
        budget: the servicer's budget; counted on the server's loop, read here from the HTTP thread (copies).
        kind: ``"reply"`` (:class:`~kvstore.server.budgets.ReplyBudget`) or ``"put"``
            (:class:`~kvstore.server.budgets.PutBudget`), the metrics' infix.
        waiters: what waits, for the help texts (``"Gets"``, ``"Put blocks"``).
        holders: what holds the bytes, for the help texts (``"Get replies"``, ``"Put bodies being received"``).
    """

    def __init__(self, budget: ByteBudget, kind: str, waiters: str, holders: str) -> None:
        self._budget = budget
        self._kind, self._waiters, self._holders = kind, waiters, holders

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        """The three families, empty."""
        return list(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        """``kvstore_<kind>_budget_waits_total{outcome}``, ``_wait_seconds`` and ``_held_bytes``."""
        waits_total, wait_seconds, held = self._families()
        waits = self._budget.waits
        counts, sum_s = list(waits.counts), waits.sum_s
        waits_total.add_metric(["admitted"], waits.admitted)
        waits_total.add_metric(["abandoned"], waits.abandoned)
        cumulative, total = [], 0
        for count in counts:
            total += count
            cumulative.append(total)
        bounds = [*map(floatToGoString, waits.buckets), "+Inf"]
        wait_seconds.add_metric([], list(zip(bounds, cumulative)), sum_s)
        try:
            held.add_metric([], self._budget.held_bytes())
        except RuntimeError:  # the loop changed the dict while this summed it: skip the gauge this scrape
            pass
        yield waits_total
        yield wait_seconds
        yield held

    def _families(self) -> tuple[CounterMetricFamily, HistogramMetricFamily, GaugeMetricFamily]:
        prefix = f"kvstore_{self._kind}_budget"
        return (
            CounterMetricFamily(f"{prefix}_waits", f"{self._waiters} that waited for their {self._kind} budget, "
                                "by outcome.", labels=["outcome"]),
            HistogramMetricFamily(f"{prefix}_wait_seconds",
                                  f"How long {self._waiters} waited for their {self._kind} budget, seconds."),
            GaugeMetricFamily(f"{prefix}_held_bytes", f"Bytes {self._holders} hold now, all connections."),
        )


class CallStats(Collector):
    """Finished calls by method and status code, and a latency histogram by method, exported at scrape time.

    Plain counts rather than ``prometheus_client``'s ``Counter`` and ``Histogram``,
    which take a lock per increment and walk the buckets in Python: with both, the
    metrics cost a Get about 6 µs, here a dict update and a ``bisect``. Count only
    from one thread (the server's event loop); a scrape, from the HTTP thread,
    reads copies (copying a dict or list is atomic under the GIL).

    Args:
        buckets: upper bounds of the latency buckets, seconds, increasing (``+Inf`` is added).
    """

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self._calls: dict[tuple[str, str], int] = {}
        self._latency: dict[str, _Latency] = {}

    def observe(self, method: str, code: str, duration_s: float) -> None:
        """Count one finished call and its latency.

        Args:
            method: RPC name, e.g. ``Get``.
            code: status code name, e.g. ``OK``, ``INVALID_ARGUMENT``.
            duration_s: seconds from the call's start to its end.
        """
        calls = self._calls
        key = (method, code)
        calls[key] = calls.get(key, 0) + 1
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = _Latency(len(self.buckets))
        latency.counts[bisect.bisect_left(self.buckets, duration_s)] += 1  # Prometheus' le: duration <= bound
        latency.sum_s += duration_s

    def describe(self) -> list[CounterMetricFamily | HistogramMetricFamily]:
        """The two families, empty: their names let a filtered scrape (``/metrics?name[]=...``) find them."""
        return list(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """``kvstore_requests_total`` and ``kvstore_request_duration_seconds`` (called by ``prometheus_client``)."""
        requests, durations = self._families()
        for (method, code), count in sorted(dict(self._calls).items()):
            requests.add_metric([method, code], count)
        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        for method, latency in sorted(dict(self._latency).items()):
            counts, sum_s = list(latency.counts), latency.sum_s
            cumulative, total = [], 0
            for count in counts:
                total += count
                cumulative.append(total)
            durations.add_metric([method], list(zip(bounds, cumulative)), sum_s)
        yield requests
        yield durations

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, HistogramMetricFamily]:
        return (
            CounterMetricFamily("kvstore_requests", "Finished gRPC calls by method and status code.",
                                labels=["method", "code"]),
            HistogramMetricFamily("kvstore_request_duration_seconds", "gRPC call latency by method, seconds.",
                                  labels=["method"]),
        )


class _Latency:
    """One method's latency histogram: calls per bucket (the last one ``+Inf``) and their sum, seconds."""

    __slots__ = ("counts", "sum_s")

    def __init__(self, num_buckets: int) -> None:
        self.counts = [0] * (num_buckets + 1)
        self.sum_s = 0.0


class ServiceMetrics:
    """The service's Prometheus registry: request metrics (:class:`CallStats`) plus the store collector.

    Args:
        registry: where to register; a fresh private registry when ``None``.

    Attributes:
        calls: the request counts and latencies.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.calls = CallStats()
        self.registry.register(self.calls)
        self._http_server = None
        self._http_thread = None

    def observe(self, method: str, code: str, duration_s: float) -> None:
        """Count one finished call and its latency (see :meth:`CallStats.observe`)."""
        self.calls.observe(method, code, duration_s)

    def add_store(self, stats: Callable[[], StoreStats]) -> None:
        """Export the store's stats through ``stats`` (see :meth:`StoreCollector.on_loop`)."""
        self.registry.register(StoreCollector(stats))

    def add_shared_memory(self, counters: Callable[[], dict[str, int]]) -> None:
        """Export the same-host data plane's counts through ``counters`` (``SharedMemoryNode.counters``, run on
        its loop: see :meth:`StoreCollector.on_loop`)."""
        self.registry.register(SharedMemoryCollector(counters))

    def add_budgets(self, replies: ReplyBudget, puts: PutBudget) -> None:
        """Export the reply and Put budgets' waits and held bytes (see :class:`BudgetCollector`)."""
        self.registry.register(BudgetCollector(replies, "reply", "Gets", "Get replies"))
        self.registry.register(BudgetCollector(puts, "put", "Put blocks", "Put bodies being received"))

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP in a daemon thread.

        Args:
            host: bind address.
            port: TCP port; 0 picks a free one.

        Returns:
            The bound port.
        """
        self._http_server, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http_server.server_port)

    def stop_http(self) -> None:
        """Stop the HTTP endpoint, if running."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
        if self._http_thread is not None:
            self._http_thread.join(timeout=5)
            self._http_thread = None


def agentic_families(stats: StoreStats | None) -> list[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
    """The families of missed blocks by cause, reuse gaps, TTLs and sessions (``docs/agentic.md``), filled from
    ``stats`` (empty for ``None``)."""
    missed = CounterMetricFamily(
        "kvstore_missed_blocks", "Blocks lookups missed (and gets did not return after their lookup: lease_lost), by "
        "cause; they sum to the misses (docs/agentic.md).", labels=["cause"])
    bounds = [*(str(bound) for bound in REUSE_GAP_BUCKETS_S), "+Inf"]
    counters = {name: CounterMetricFamily(f"kvstore_{name}", text) for name, text in (
        ("ttl_clamped", "TTLs over store.pins.max_ttl_s taken at that maximum."),
        ("session_cooled_chains", "Dead chains (compacted, or of finished subagents) moved to the front of eviction "
                                  "by the session policy."),
        ("session_bounded_puts", "Puts of a session whose new blocks the session policy's admission cut short."),
        ("pins_displaced", "Pins a tier's share (store.pins.max_tier_fraction) ended, the least recently used "
                           "first, for newer ones."),
    )}
    refused = CounterMetricFamily("kvstore_pins_refused", "Blocks stored without their TTL because a bound on pinned "
                                  "bytes refused it (store.pins), by bound.", labels=["bound"])
    gauges = {name: GaugeMetricFamily(f"kvstore_{name}", text) for name, text in (
        ("pinned_bytes", "Capacity bytes of the blocks whose TTL runs, over every local tier."),
        ("sessions", "Agentic sessions the session policy tracks."),
        ("miss_history_blocks", "Removals remembered to name the cause of a later miss (store.miss_history_blocks)."),
    )}
    if stats is None:
        gap = HistogramMetricFamily("kvstore_reuse_gap_seconds", "Seconds from a block's eviction to the next request "
                                    "for it (mass at short gaps: the cache is too small).")
        return [missed, gap, *counters.values(), refused, *gauges.values()]
    for cause, count in sorted(stats.missed_blocks.items()):
        missed.add_metric([cause], count)
    cumulative, total = [], 0
    for bound, count in zip(bounds, stats.reuse_gap_counts or [0] * len(bounds)):
        total += count
        cumulative.append((bound, total))
    gap = HistogramMetricFamily("kvstore_reuse_gap_seconds", "Seconds from a block's eviction to the next request "
                                "for it (mass at short gaps: the cache is too small).", buckets=cumulative,
                                sum_value=stats.reuse_gap_sum_s)
    node = stats.counters
    counters["ttl_clamped"].add_metric([], node.get("ttl_clamped", 0))
    counters["session_cooled_chains"].add_metric([], node.get("cooled_chains", 0))
    counters["session_bounded_puts"].add_metric([], node.get("bounded_puts", 0))
    counters["pins_displaced"].add_metric([], node.get("pins_displaced", 0))
    for bound in ("tier", "node", "tenant"):
        refused.add_metric([bound], node.get(f"pins_refused_{bound}", 0))
    gauges["pinned_bytes"].add_metric([], node.get("pinned_bytes", 0))
    gauges["sessions"].add_metric([], node.get("sessions", 0))
    gauges["miss_history_blocks"].add_metric([], node.get("miss_history_blocks", 0))
    return [missed, gap, *counters.values(), refused, *gauges.values()]
