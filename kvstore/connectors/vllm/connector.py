"""The connector class vLLM instantiates in its scheduler and in every worker; it delegates to the two sides."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.events import open_connector_events
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.connectors.vllm.layout import PageFormat, check_kv_cache_config, paged_kv
from kvstore.connectors.vllm.metrics import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.connectors.vllm.namespaces import RankInfo, model_identity
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.versions import check_vllm_version
from kvstore.connectors.vllm.worker import WorkerSide, open_worker_store

try:  # vLLM 0.32 and later split the external hit by source; 0.30 and 0.31 never call the hook that does
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - vLLM < 0.32
    CacheHitSource = None

if TYPE_CHECKING:  # vLLM is untyped to mypy (kvstore.connectors.kit.bases)
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorBase_V1
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorHandshakeMetadata
else:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorHandshakeMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

@dataclass
class KVStoreHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler at start-up: its page format and, embedded, its lookup endpoint."""

    page_format: PageFormat
    lookup_target: str | None = None
    lookup_token: str | None = None


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's v1 KV connector for kvstore, both roles (module docstring; ``docs/vllm.md``).

    Args:
        vllm_config: the engine's ``VllmConfig``; ``kv_transfer_config.kv_connector_extra_config``
            holds the settings (:class:`~kvstore.connectors.vllm.config.VLLMConnectorConfig`).
        role: ``SCHEDULER`` or ``WORKER``.
        kv_cache_config: the engine's KV-cache groups.

    Raises:
        UnsupportedVLLMError: on a vLLM outside ``SUPPORTED_VLLM`` (``kvstore.connectors.vllm.versions``).
        ConfigError: on an unknown setting or a bad value, naming the key.
        UnsupportedModelError: on a model whose KV cache the connector cannot
            restore exactly (hybrid, sliding-window, Mamba, cross-layer sharing,
            an unknown attention backend), naming the group or layer.
    """

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        warning = check_vllm_version()  # before anything else: outside the range, a clear error at engine start
        if warning:
            logger.warning(warning)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_config(transfer.kv_connector_extra_config)
        check_kv_cache_config(kv_cache_config)
        self._vllm_block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        if self.settings.block_size is not None and self.settings.block_size % self._vllm_block_size:
            from kvstore.errors import ConfigError

            raise ConfigError("kv_connector_extra_config.block_size",
                              f"must be a multiple of vLLM's block size {self._vllm_block_size}, got "
                              f"{self.settings.block_size}")
        self._identity = model_identity(vllm_config, self.settings.model_id)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.load_failure_policy == "recompute" and transfer.kv_load_failure_policy != "recompute":
                # kvstore is a cache: a block that fails to load is a miss, recomputed, never a failed request.
                logger.info("kvstore connector: kv_load_failure_policy=recompute (a block that fails to load is "
                            "recomputed; set load_failure_policy=fail in kv_connector_extra_config to keep %r)",
                            transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            self.scheduler_side = SchedulerSide(self.settings, self._identity, self._vllm_block_size,
                                                load=transfer.is_kv_consumer, save=transfer.is_kv_producer)
            self.scheduler_side.events = open_connector_events(vllm_config, self.settings, self._vllm_block_size,
                                                               self.scheduler_side.block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        """``False``: a save that does not happen is a future miss, not a lost hand-off."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read the paged KV layout from vLLM and open the worker's store.

        Raises:
            UnsupportedModelError: on a layout the connector cannot serve (see :func:`paged_kv`).
        """
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        paged = paged_kv(self._vllm_config, self._kv_cache_config, kv_caches)
        rank = (get_pp_group().rank_in_group, get_tp_group().rank_in_group)
        client, endpoint = open_worker_store(self.settings)
        writer = paged.page_format.layout.value != "mla" or rank[1] == 0
        self.worker_side = WorkerSide(self.settings, self._identity, paged, rank, self._vllm_block_size, client,
                                      endpoint=endpoint, writer=writer)
        logger.info("kvstore connector worker %s: %s, %s", rank, paged.page_format.descriptor,
                    "embedded store" if endpoint else f"nodes {self.settings.target}")

    def get_handshake_metadata(self) -> KVStoreHandshake | None:
        """This worker's page format and lookup endpoint, for the scheduler."""
        if self.worker_side is None:
            return None
        info = self.worker_side.info
        return KVStoreHandshake(info.page_format, info.lookup_target, info.lookup_token)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load the step's blocks into vLLM's paged KV, before the forward pass (synchronous, bounded by ``timeout_s``)."""
        if self.worker_side is not None and isinstance(self._connector_metadata, KVStoreConnectorMetadata):
            self.worker_side.start_load(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` writes every layer before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: :meth:`wait_for_save` copies whole blocks (all layers) after the forward pass."""

    def wait_for_save(self) -> None:
        """Copy the step's completed blocks out of vLLM's cache and queue their puts (never waits for a put)."""
        if self.worker_side is not None and isinstance(self._connector_metadata, KVStoreConnectorMetadata):
            self.worker_side.save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose end-of-request save is copied out (vLLM frees their blocks); loads are synchronous."""
        if self.worker_side is None:
            return None, None
        side = self.worker_side
        return side.take_finished_sending() or None, side.take_finished_recving() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks that failed to load this step; vLLM recomputes them."""
        return self.worker_side.take_load_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        """The step's failed loads, by request, so the scheduler saves the recomputed blocks."""
        return self.worker_side.take_worker_meta() if self.worker_side is not None else None

    def shutdown(self) -> None:
        """Finish queued saves for a bounded time, then close the store or clients."""
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()

    # ------------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' handshakes without pipeline ranks (stage 0)."""
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): meta for tp, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Learn every worker's page format and lookup endpoint (vLLM calls this once, at start-up)."""
        if self.scheduler_side is None:
            return
        ranks = [RankInfo(pp, tp, meta.page_format, meta.lookup_target, meta.lookup_token)
                 for (pp, tp), meta in metadata.items() if isinstance(meta, KVStoreHandshake)]
        self.scheduler_side.set_ranks(ranks)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past vLLM's local hit that kvstore holds (whole blocks, never the last token); loads are synchronous."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The external hit split by the kvstore tier that held it (memory: host, disk: disk)."""
        assert self.scheduler_side is not None
        return {CacheHitSource(source): count
                for source, count in self.scheduler_side.hit_sources(request, num_external_tokens).items()}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the request's external tokens into the blocks vLLM allocated."""
        assert self.scheduler_side is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's load and save jobs."""
        assert self.scheduler_side is not None
        manager = self._kv_cache_manager

        def block_ids_of(req_id: str) -> list[int]:
            return list(manager.get_block_ids(req_id)[0]) if manager is not None else []

        return self.scheduler_side.build_meta(scheduler_output, block_ids_of)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the workers' failed loads, so the recomputed blocks are saved again."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler_side is not None and isinstance(meta, KVStoreWorkerMetadata):
            self.scheduler_side.load_failed(meta.failed_loads)

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM events of the blocks saved to kvstore, and of those the node let go (``events.py``); vLLM publishes them."""
        events = self.scheduler_side.events if self.scheduler_side is not None else None
        return events.take() if events is not None else []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Plan the save of the request's generated-token blocks; ``True`` while vLLM must keep them."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids), None

    # ------------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """This side's counts since the last call (vLLM logs them and feeds its Prometheus endpoint)."""
        side = self.worker_side if self.worker_side is not None else self.scheduler_side
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        """vLLM's way to rebuild the counts from their serialized dict."""
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStorePromMetrics:
        """The ``vllm:kvstore_*`` counters on vLLM's Prometheus endpoint."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
