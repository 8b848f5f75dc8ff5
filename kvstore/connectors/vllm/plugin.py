"""vLLM's plugin hook: after ``pip install``, ``{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}`` is enough.

kvstore's distribution declares an entry point in vLLM's ``vllm.general_plugins``
group (``pyproject.toml``); vLLM calls :func:`register` in every process it starts
(the API server, the engine core, each worker) before it builds a connector.
:func:`register` adds ``KVStoreConnector`` to vLLM's ``KVConnectorFactory`` by
module path, so the connector is imported only by engines that name it, and
``kv_connector_module_path`` is no longer needed (it still works).

The node comes from ``kv_connector_extra_config.target``, else from the
environment variable ``KVSTORE_TARGET``, else each worker keeps an embedded
store (``kvstore.connectors.vllm.config``).
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVStoreConnector"
"""The name engines give as ``kv_connector``."""

CONNECTOR_MODULE = "kvstore.connectors.vllm"
"""The module vLLM imports the connector class from, on first use."""

ENTRY_POINT_GROUP = "vllm.general_plugins"
"""vLLM's entry point group of plugins loaded in every process (``vllm.plugins.load_general_plugins``)."""

logger = logging.getLogger(__name__)


def register() -> None:
    """Make ``KVStoreConnector`` known to vLLM's connector factory by name.

    Idempotent (vLLM may load plugins more than once per process), and it never
    raises: a vLLM whose factory differs logs a warning, and an engine that names
    the connector can still give ``kv_connector_module_path``. It imports neither the
    connector nor torch; the connector checks vLLM's version when an engine creates it.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as exc:  # an unexpected vLLM must not stop vLLM from starting
        logger.warning("kvstore: cannot register %s with vLLM (%s); give kv_connector_module_path=%r instead",
                       CONNECTOR_NAME, exc, CONNECTOR_MODULE)
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered meanwhile ("already registered")
        return
    except Exception as exc:
        logger.warning("kvstore: cannot register %s with vLLM (%s); give kv_connector_module_path=%r instead",
                       CONNECTOR_NAME, exc, CONNECTOR_MODULE)
