"""kvstore: a distributed, multi-tier KV-cache store for LLM inference.

Embedded use::

    import kvstore
    store = kvstore.open_store()                       # memory tier, no server
    ns = kvstore.Namespace(model="my-llama", dtype="float16", block_size=16)
    hashes = kvstore.hash_blocks(ns, token_ids)        # one hash per full block
    store.put(ns, hashes, blocks)                      # [L, 2, H, block_size, D] tensors
    hit = store.lookup(ns, hashes).num_blocks          # longest cached prefix
"""

from kvstore.api import BlockClient, LookupResult, StoreStats, TierStats
from kvstore.codec import Layout, decode_block, encode_block
from kvstore.config import Config, StoreConfig, load_config
from kvstore.embedded import EmbeddedStore, open_store
from kvstore.errors import (
    CodecError,
    ConfigError,
    InvalidArgumentError,
    KVStoreError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvstore.keys import BlockHash, BlockKey, HashAlgorithm, Namespace, hash_blocks
from kvstore.policy import DEFAULT_PRIORITY

__version__ = "0.1.0"

__all__ = [
    "BlockClient", "BlockHash", "BlockKey", "CodecError", "Config", "ConfigError", "DEFAULT_PRIORITY",
    "EmbeddedStore", "HashAlgorithm", "InvalidArgumentError", "KVStoreError", "Layout", "LookupResult",
    "Namespace", "ResourceExhaustedError", "StoreConfig", "StoreStats", "TierStats", "UnavailableError",
    "decode_block", "encode_block", "hash_blocks", "load_config", "open_store",
]
