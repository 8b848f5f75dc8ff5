"""kvstore as SGLang's HiCache storage backend: engines keep evicted prefix pages in kvstore and read them back.

Use (SGLang 0.5.23; ``docs/sglang.md`` documents every setting)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "target": "127.0.0.1:50051"}'

Without ``target`` each rank keeps an embedded store in its own process.
:class:`KVStoreHiCacheStorage` (``kvstore.connectors.sglang.storage``) imports
SGLang; the settings (``kvstore.connectors.sglang.config``) and the page keys
(``kvstore.connectors.sglang.pages``) do not.
"""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED_SGLANG = ">=0.5.23,<0.6"
"""The SGLang releases the backend is written against (tested with 0.5.23)."""

_EXPORTS = {
    "KVStoreHiCacheStorage": "kvstore.connectors.sglang.storage",
    "HybridModelError": "kvstore.connectors.sglang.storage",
    "SGLangStorageConfig": "kvstore.connectors.sglang.config",
    "parse_config": "kvstore.connectors.sglang.config",
    "StorageCounters": "kvstore.connectors.sglang.stores",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562), so the settings check where SGLang is not installed."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.connectors.sglang' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
