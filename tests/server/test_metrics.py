"""The service's request metrics (:class:`CallStats`) as Prometheus exposes them."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.server.metrics import ServiceMetrics


def _samples(metrics: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_calls_are_counted_by_method_and_code_with_a_cumulative_latency_histogram() -> None:
    metrics = ServiceMetrics()
    metrics.observe("Get", "OK", 0.0005)  # exactly on a bound: that bucket (Prometheus' le is <=)
    metrics.observe("Get", "OK", 0.003)
    metrics.observe("Get", "CANCELLED", 20.0)  # past the last bound: +Inf only
    metrics.observe("Put", "INVALID_ARGUMENT", 0.00001)
    samples = _samples(metrics)
    assert samples[("kvstore_requests_total", (("code", "OK"), ("method", "Get")))] == 2
    assert samples[("kvstore_requests_total", (("code", "CANCELLED"), ("method", "Get")))] == 1
    assert samples[("kvstore_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "Put")))] == 1

    def bucket(method: str, le: str) -> float:
        return samples[("kvstore_request_duration_seconds_bucket", (("le", le), ("method", method)))]

    assert [bucket("Get", le) for le in ("0.00025", "0.0005", "0.0025", "0.005", "10.0", "+Inf")] == [0, 1, 1, 2, 2, 3]
    assert bucket("Put", "0.0001") == 1
    assert samples[("kvstore_request_duration_seconds_count", (("method", "Get"),))] == 3
    assert abs(samples[("kvstore_request_duration_seconds_sum", (("method", "Get"),))] - 20.0035) < 1e-9


def test_a_filtered_scrape_finds_the_request_and_store_series() -> None:
    """``/metrics?name[]=...`` serves only the families whose names the collectors describe up front."""
    from kvstore.api import StoreStats, TierStats

    metrics = ServiceMetrics()
    metrics.add_store(lambda: StoreStats((TierStats("memory", blocks=1, bytes=2, capacity_bytes=3, hits=4),), 5, 6))
    metrics.observe("Get", "OK", 0.001)
    names = ["kvstore_requests_total", "kvstore_request_duration_seconds_count", "kvstore_tier_hits_total",
             "kvstore_lookup_blocks_total"]
    text = generate_latest(metrics.registry.restricted_registry(names)).decode()
    samples = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples == set(names)


async def test_refused_puts_are_exported_by_reason() -> None:
    """The store counts a refused put with its reason (issue 32); the node exports the count per tier."""
    import pytest
    import torch

    from kvstore.blocks.tensors import encode_block
    from kvstore.errors import ResourceExhaustedError
    from kvstore.store.tiered import TieredStore
    from tests.support.store import NS, make_blocks, memory_tier

    async with TieredStore([memory_tier(1)]) as store:  # two 4 KiB pages
        hashes, _ = make_blocks(1)
        block = encode_block(torch.zeros(2, 2, 2, NS.block_size, 512, dtype=torch.float16))  # 32 KiB
        with pytest.raises(ResourceExhaustedError, match="larger than every tier"):
            await store.put(NS, hashes, [block])
        metrics = ServiceMetrics()
        metrics.add_store(store.stats)
        samples = _samples(metrics)
    assert samples[("kvstore_tier_events_total", (("event", "refused_puts_too_large"), ("tier", "memory")))] == 1
