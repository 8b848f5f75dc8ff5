"""What the scheduler tells the workers each step: which blocks to load into which vLLM blocks, which to save."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.keys import BlockHash

if TYPE_CHECKING:  # vLLM is untyped to mypy (kvstore.connectors.kit.bases)
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorMetadata
    from kvstore.connectors.kit.bases import EngineBase as KVConnectorWorkerMetadata
else:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

RankKey = tuple[int, int]
"""``(pp_rank, tp_rank)`` of a worker."""


@dataclass(frozen=True, slots=True)
class TenantKey:
    """The per-request part of a namespace: the tenant's ``cache_salt`` and the LoRA adapter (``name#id``)."""

    cache_salt: str = ""
    adapter: str = ""


@dataclass(slots=True)
class LoadJob:
    """Fetch consecutive kvstore blocks of one request and write them into the vLLM blocks allocated for them.

    Attributes:
        req_id: the request.
        tenant: its tenant and adapter.
        first_block: index of the first fetched kvstore block in the request.
        hashes: per worker, the hashes of the kvstore blocks to fetch, in order.
        skip_tokens: tokens at the start of the first block that vLLM's local
            prefix cache already holds: they are fetched but not written.
        block_ids: the vLLM blocks to fill, in token order, from the first token
            past ``skip_tokens``; every one lies in exactly one kvstore block.
        session_id: the request's agentic session (``docs/agentic.md``); ``""`` for none.
        ttl_s: the TTL its blocks are read with, seconds (0.0: none).
    """

    req_id: str
    tenant: TenantKey
    first_block: int
    hashes: dict[RankKey, list[BlockHash]]
    skip_tokens: int
    block_ids: list[int]
    session_id: str = ""
    ttl_s: float = 0.0


@dataclass(slots=True)
class SaveJob:
    """Copy full kvstore blocks of one request out of vLLM's cache and put them into kvstore.

    Attributes:
        req_id: the request.
        tenant: its tenant and adapter.
        hashes: per worker, the hashes of the blocks, in order.
        block_ids: the vLLM blocks they consist of, in token order (``kvstore block
            size / vLLM block size`` per kvstore block).
        at_finish: a save planned by ``request_finished``: vLLM keeps the blocks
            until the worker reports the request in ``finished_sending``.
        session_id: the request's agentic session (``docs/agentic.md``); ``""`` for none.
        ttl_s: the TTL its blocks are put with, seconds (0.0: none).
    """

    req_id: str
    tenant: TenantKey
    hashes: dict[RankKey, list[BlockHash]]
    block_ids: list[int]
    at_finish: bool = False
    session_id: str = ""
    ttl_s: float = 0.0


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's jobs; vLLM sends it to every worker before the step's forward pass."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler after a step: the loads that failed, by request.

    Attributes:
        failed_loads: ``req_id -> index of the first kvstore block that did not load``.
    """

    failed_loads: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVStoreWorkerMetadata:
        """Merge another worker's report: per request, the earliest failed block."""
        if isinstance(other, KVStoreWorkerMetadata):
            for req_id, block in other.failed_loads.items():
                self.failed_loads[req_id] = min(block, self.failed_loads.get(req_id, block))
        return self
