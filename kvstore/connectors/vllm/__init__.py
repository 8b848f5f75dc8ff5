"""kvstore as a vLLM v1 KV connector: engines fetch prefix KV blocks from kvstore instead of recomputing prefill.

Use (vLLM 0.30 to 0.34, ``kvstore.connectors.vllm.versions``; ``docs/vllm.md`` documents every setting)::

    KVSTORE_TARGET=127.0.0.1:50051 vllm serve MODEL \
        --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}'

or ``LLM(..., kv_transfer_config=KVTransferConfig(...))`` with the same fields. The
package's ``vllm.general_plugins`` entry point (``kvstore.connectors.vllm.plugin``)
makes the name known to vLLM; other settings go in ``kv_connector_extra_config``
(``target`` there overrides ``KVSTORE_TARGET``). Without either, each worker keeps
an embedded store in its own process.

:class:`KVStoreConnector` is thin: vLLM creates it once in the scheduler
(``KVConnectorRole.SCHEDULER``, ``kvstore.connectors.vllm.scheduler``) and once
in every worker (``WORKER``, ``kvstore.connectors.vllm.worker``); it checks the
settings and the model, then hands each hook to its side. The worker's side
sends its page format (and, embedded, its lookup endpoint) to the scheduler
through vLLM's connector handshake, so both sides key blocks alike.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.connectors.vllm.versions import SUPPORTED_VLLM  # the supported range; imports no vLLM

_EXPORTS = {
    "KVStoreConnector": "kvstore.connectors.vllm.connector",
    "KVStoreHandshake": "kvstore.connectors.vllm.connector",
    "UnsupportedModelError": "kvstore.connectors.vllm.layout",
    "VLLMConnectorConfig": "kvstore.connectors.vllm.config",
    "parse_config": "kvstore.connectors.vllm.config",
    "on_worker": "kvstore.connectors.vllm.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562): vLLM is imported only by the parts that need it,
    so ``kvstore.connectors.vllm.config`` checks settings where vLLM is not installed."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.connectors.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
