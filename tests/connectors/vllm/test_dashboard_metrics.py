"""Every ``vllm:kvstore_*`` series the shipped dashboard and alert rules read is one the connector exports.

The names come from a real registry: the connector's ``KVStorePromMetrics`` built with
``prometheus_client``'s classes, as vLLM's Prometheus logger builds it, and rendered in
Prometheus' text format. The node's ``kvstore_*`` series are checked against a live
node in ``tests/deploy/test_monitoring.py``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvstore.connectors.vllm.metrics import KVStorePromMetrics
from tests.support.dashboard import alert_queries, dashboard_queries, exported_names, metric_names, unexported


def test_every_engine_series_of_the_dashboard_and_the_alerts_is_exported() -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    KVStorePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    exported = exported_names(generate_latest(registry).decode())
    assert "vllm:kvstore_hit_tokens_total" in exported and "vllm:kvstore_load_seconds_bucket" in exported
    read = {n for _, e in [*dashboard_queries(), *alert_queries()] for n in metric_names(e)}
    assert {n for n in read if n.startswith("vllm:kvstore_")}, "the dashboard shows the engine's side"
    missing = unexported(dashboard_queries(), exported, "vllm:") + unexported(alert_queries(), exported, "vllm:")
    assert not missing, f"panels or alerts read engine series the connector does not export: {missing}"
