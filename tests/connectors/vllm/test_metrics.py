"""Tests of the connector's counters in vLLM's stats protocol and on a Prometheus registry."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.connectors.vllm.metrics import COUNTERS, DURATIONS, KVStoreConnectorStats, KVStorePromMetrics


def test_stats_aggregate_reduce_and_take() -> None:
    worker, scheduler = KVStoreConnectorStats(), KVStoreConnectorStats()
    assert worker.is_empty() and worker.take() is None
    worker.add("loaded_blocks", 6)
    worker.observe("load_seconds", 0.02)
    scheduler.add("lookup_tokens", 200)
    scheduler.add("hit_tokens", 150)
    scheduler.observe("lookup_seconds", 0.001)
    other = KVStoreConnectorStats()
    other.add("loaded_blocks", 2)
    other.observe("load_seconds", 0.04)
    total = worker.aggregate(scheduler).aggregate(other)
    assert total.data["loaded_blocks"] == 8 and total.data["load_seconds"] == [0.02, 0.04]
    reduced = total.reduce()
    assert reduced["hit_ratio"] == 0.75 and reduced["mean_load_seconds"] == 0.03 and reduced["loaded_blocks"] == 8
    assert set(reduced) >= set(COUNTERS)
    taken = total.take()
    assert taken is not None and taken.data["loaded_blocks"] == 8 and total.is_empty()
    assert KVStoreConnectorStats(data=taken.data).data["load_seconds"] == [0.02, 0.04]  # vLLM rebuilds from data


def test_prometheus_metrics_count_per_engine() -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVStorePromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    stats = KVStoreConnectorStats()
    stats.add("hit_blocks", 5)
    stats.observe("load_seconds", 0.02)
    stats.observe("load_seconds", 0.2)
    prom.observe(stats.data, engine_idx=1)
    prom.observe(stats.data, engine_idx=1)
    labels = {"model_name": "m", "engine": "1"}
    assert registry.get_sample_value("vllm:kvstore_hit_blocks_total", labels) == 10
    assert registry.get_sample_value("vllm:kvstore_hit_blocks_total", {"model_name": "m", "engine": "0"}) == 0
    assert registry.get_sample_value("vllm:kvstore_load_seconds_count", labels) == 4
    assert abs(registry.get_sample_value("vllm:kvstore_load_seconds_sum", labels) - 0.44) < 1e-9
    for name in (*COUNTERS, *DURATIONS):
        suffix = "_count" if name in DURATIONS else "_total"
        assert registry.get_sample_value(f"vllm:kvstore_{name}{suffix}", labels) is not None, name
