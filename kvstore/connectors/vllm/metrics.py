"""The connector's counters, in vLLM's connector-stats protocol: its logs and its Prometheus endpoint.

Both sides count: the scheduler its lookups, each worker its loads and saves.
vLLM collects ``get_kv_connector_stats()`` from both every step, sums the
workers' and the scheduler's (:meth:`KVStoreConnectorStats.aggregate`), logs
them with its own throughput line ("KV Transfer metrics: ...") and feeds them to
:class:`KVStorePromMetrics`, whose counters appear on vLLM's ``/metrics`` as
``vllm:kvstore_<name>_total`` and whose durations as the histograms
``vllm:kvstore_lookup_seconds``, ``vllm:kvstore_load_seconds`` and ``vllm:kvstore_save_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # vLLM is untyped to mypy (kvstore.connectors.kit.bases)
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorPromMetrics
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorStats
else:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS: dict[str, str] = {
    "lookups": "Lookups sent to kvstore (one per request scheduled with a prompt beyond vLLM's local hit).",
    "lookup_errors": "Lookups that failed or timed out, or were skipped while the store was down.",
    "lookup_blocks": "kvstore blocks looked up (beyond vLLM's local prefix-cache hit).",
    "lookup_tokens": "Prompt tokens those blocks hold.",
    "hit_blocks": "Looked-up blocks found in kvstore.",
    "hit_tokens": "Tokens those blocks hold: the external prefix-cache hit.",
    "loaded_blocks": "Blocks fetched and written into vLLM's KV cache.",
    "loaded_tokens": "Tokens those blocks hold (whole kvstore blocks, vLLM's local part included).",
    "load_failed_blocks": "Blocks that failed to load (store down or slow, a miss after the lookup, a corrupt or "
                          "mismatched block); vLLM recomputes them.",
    "lost_blocks": "Blocks a lookup found that were gone by the load (evicted or deleted in between despite the "
                   "lookup's pin, hit_pin_s); among load_failed_blocks.",
    "saved_blocks": "Blocks sent to kvstore by finished saves (already cached ones included).",
    "saved_tokens": "Tokens those blocks hold.",
    "save_failed_blocks": "Blocks whose save failed, timed out, or was dropped (store down, save queue full).",
}
"""Every counter, and what it counts."""

DURATIONS: dict[str, str] = {
    "lookup_seconds": "Seconds one lookup took, in the scheduler (hashing and the Lookup calls).",
    "load_seconds": "Seconds one worker spent on one step's loads (fetch, check and copy into vLLM's cache).",
    "save_seconds": "Seconds one put of a save took (encode and send).",
}
"""Every duration, observed one value per load step or put, and what it measures."""

DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets of :data:`DURATIONS`, seconds."""


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counts since the last report (vLLM resets them each interval).

    ``data`` maps each :data:`COUNTERS` name to an int and each :data:`DURATIONS`
    name to a list of seconds (plain types: vLLM sends them between processes).
    """

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in DURATIONS:
            self.data.setdefault(name, [])

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name``."""
        self.data[name] = self.data.get(name, 0) + amount

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration ``name``."""
        self.data.setdefault(name, []).append(float(seconds))

    def reset(self) -> None:
        """Zero every counter and forget every duration."""
        for name in list(self.data):
            self.data[name] = [] if name in DURATIONS else 0

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        """Add ``other`` (another worker's or the scheduler's counts) to this one; returns ``self``."""
        for name, value in other.data.items():
            if name in DURATIONS:
                self.data.setdefault(name, []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts for vLLM's log line, the mean durations, and the lookups' hit ratio (hit / looked-up tokens)."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k in COUNTERS}
        for name in DURATIONS:
            values = self.data.get(name) or []
            out[f"mean_{name}"] = round(sum(values) / len(values), 4) if values else 0.0
        looked = self.data.get("lookup_tokens", 0)
        out["hit_ratio"] = round(self.data.get("hit_tokens", 0) / looked, 4) if looked else 0.0
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())

    def take(self) -> KVStoreConnectorStats | None:
        """A copy of the counts, zeroing these; ``None`` when there were none (vLLM then sends nothing)."""
        if self.is_empty():
            return None
        copy = KVStoreConnectorStats(data=dict(self.data))
        self.reset()
        return copy


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The metrics on vLLM's Prometheus endpoint, one child per engine.

    Counters ``vllm:kvstore_<name>`` (``_total`` added) and the histograms of :data:`DURATIONS`.
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for name, documentation in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvstore_{name}", documentation=documentation,
                                       labelnames=labelnames)
            self._metrics[name] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
        for name, documentation in DURATIONS.items():
            metric = self._histogram_cls(name=f"vllm:kvstore_{name}", documentation=documentation,
                                         labelnames=labelnames, buckets=DURATION_BUCKETS_S)
            self._metrics[name] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one report (``KVStoreConnectorStats.data``) to the metrics."""
        for name, value in transfer_stats_data.items():
            child = self._metrics.get(name, {}).get(engine_idx)
            if child is None or not value:
                continue
            if name in DURATIONS:
                for seconds in value:
                    child.observe(seconds)
            else:
                child.inc(value)
