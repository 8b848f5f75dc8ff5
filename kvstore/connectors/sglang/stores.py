"""The SGLang backend's way to the store: a client of ``kvstore serve`` nodes, or an embedded store; and its counts."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

from kvstore.api import BlockClient
from kvstore.client import KVStoreClient
from kvstore.config import load_config
from kvstore.connectors.sglang.config import SGLangStorageConfig
from kvstore.embedded import open_store
from kvstore.security import bearer_metadata, channel_credentials

MAX_BACKOFF_FACTOR = 16
"""The longest backoff of a down node, in multiples of ``down_backoff_s`` (as the vLLM connector's)."""


def open_block_store(config: SGLangStorageConfig) -> BlockClient:
    """A client of the configured nodes (deadline, TLS, token, down-node backoff), or an embedded store.

    Raises:
        ConfigError: on an unreadable TLS or token file, or a bad embedded-store config.
    """
    if not config.targets:
        return open_store(load_config(config.config))
    credentials = None
    if config.tls_ca_file or config.tls_cert_file:
        credentials = channel_credentials(config.tls_ca_file, cert_file=config.tls_cert_file,
                                          key_file=config.tls_key_file)
    token = config.bearer_token()
    return KVStoreClient(list(config.targets), timeout_s=config.timeout_s, credentials=credentials,
                         metadata=bearer_metadata(token) if token else (), down_backoff_s=config.down_backoff_s,
                         max_down_backoff_s=config.down_backoff_s * MAX_BACKOFF_FACTOR)


@dataclass(slots=True)
class StorageCounters:
    """What one backend did since it opened (a rank's view; the nodes count their own as usual).

    Attributes:
        hit_pages: pages a read copied into the host pool.
        miss_pages: pages a read or an existence check asked for past the stored prefix.
        read_bytes: payload bytes copied into the host pool.
        written_pages: pages a write handed to the store.
        written_bytes: payload bytes of those pages.
        errors: store calls that failed (each also starts a backoff).
        skipped_calls: calls answered without the store because it was down (a backoff).
    """

    hit_pages: int = 0
    miss_pages: int = 0
    read_bytes: int = 0
    written_pages: int = 0
    written_bytes: int = 0
    errors: int = 0
    skipped_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every count by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CounterBox:
    """:class:`StorageCounters` behind a lock: SGLang's prefetch and backup threads call the backend at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = StorageCounters()

    def add(self, **deltas: int) -> None:
        """Add to the named counts."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + delta)

    def snapshot(self) -> StorageCounters:
        """A copy of the counts now."""
        with self._lock:
            return StorageCounters(**self._counts.as_dict())


def clear_namespace(store: Any, namespace: Any) -> int:
    """Delete every page of ``namespace`` (``clear`` of the embedded store or the client); returns how many."""
    return int(store.clear(namespace))
