"""kvstore: a distributed, multi-tier KV-cache store for LLM inference.

Embedded use::

    import kvstore
    store = kvstore.open_store()                       # memory tier, no server
    ns = kvstore.Namespace(model="my-llama", dtype="float16", block_size=16)
    hashes = kvstore.hash_blocks(ns, token_ids)        # one hash per full block
    store.put(ns, hashes, blocks)                      # [L, 2, H, block_size, D] tensors
    hit = store.lookup(ns, hashes).num_blocks          # longest cached prefix

Names are imported lazily, so light entry points (``kvstore health``) do not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BlockClient": "kvstore.api", "LookupResult": "kvstore.api", "StoreStats": "kvstore.api",
    "TierStats": "kvstore.api",
    "Layout": "kvstore.blocks.tensors", "decode_block": "kvstore.blocks.tensors", "encode_block": "kvstore.blocks.tensors",
    "Config": "kvstore.config", "StoreConfig": "kvstore.config", "load_config": "kvstore.config",
    "EmbeddedStore": "kvstore.embedded", "open_store": "kvstore.embedded",
    "CodecError": "kvstore.errors", "ConfigError": "kvstore.errors", "InvalidArgumentError": "kvstore.errors",
    "KVStoreError": "kvstore.errors", "ResourceExhaustedError": "kvstore.errors",
    "UnavailableError": "kvstore.errors",
    "BlockHash": "kvstore.keys", "BlockKey": "kvstore.keys", "HashAlgorithm": "kvstore.keys",
    "Namespace": "kvstore.keys", "hash_blocks": "kvstore.keys",
    "DEFAULT_PRIORITY": "kvstore.policy",
    "KVStoreClient": "kvstore.client", "AsyncKVStoreClient": "kvstore.client",
    "InProcessServer": "kvstore.server.in_process", "serve_in_process": "kvstore.server.in_process",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
