"""The connector's counters, in vLLM's connector-stats protocol: its logs and its Prometheus endpoint.

Both sides count: the scheduler its lookups, each worker its loads and saves.
vLLM collects ``get_kv_connector_stats()`` from both every step, sums the
workers' and the scheduler's (:meth:`KVStoreConnectorStats.aggregate`), logs
them with its own throughput line ("KV Transfer metrics: ...") and feeds them to
:class:`KVStorePromMetrics`, whose counters appear on vLLM's ``/metrics`` as
``vllm:kvstore_<name>_total``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    "saved_blocks": "Blocks sent to kvstore by finished saves (already cached ones included).",
    "saved_tokens": "Tokens those blocks hold.",
    "save_failed_blocks": "Blocks whose save failed, timed out, or was dropped (store down, save queue full).",
}
"""Every counter, and what it counts."""

SECONDS: dict[str, str] = {
    "load_seconds": "Seconds workers spent loading blocks (fetch, check and copy), summed.",
    "save_seconds": "Seconds the save threads spent saving blocks, summed.",
}
"""Every summed duration, and what it measures."""


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counts since the last report (vLLM resets them each interval); ``data`` maps a :data:`COUNTERS` or :data:`SECONDS` name to a number."""

    def __post_init__(self) -> None:
        for name in (*COUNTERS, *SECONDS):
            self.data.setdefault(name, 0)

    def add(self, name: str, amount: int | float = 1) -> None:
        """Add ``amount`` to the counter ``name``."""
        self.data[name] = self.data.get(name, 0) + amount

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.data:
            self.data[name] = 0

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        """Sum ``other`` (another worker's or the scheduler's counts) into this one; returns ``self``."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts for vLLM's log line, with the hit ratio of the lookups (hit / looked-up tokens)."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k in COUNTERS}
        for name in SECONDS:
            out[name] = round(float(self.data.get(name, 0)), 4)
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
    """The counters on vLLM's Prometheus endpoint: ``vllm:kvstore_<name>`` (``_total`` added), one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in {**COUNTERS, **SECONDS}.items():
            counter = self._counter_cls(name=f"vllm:kvstore_{name}", documentation=documentation,
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one report's counts (``KVStoreConnectorStats.data``) to the counters."""
        for name, value in transfer_stats_data.items():
            children = self._counters.get(name)
            if children is not None and value and engine_idx in children:
                children[engine_idx].inc(value)
