"""The connector's way to the store: gRPC clients of ``kvstore serve`` nodes, or an embedded store with a lookup endpoint.

With ``target`` set, the scheduler and every worker each open a
:class:`~kvstore.client.KVStoreClient` of the nodes. Without it, every worker
opens an embedded store (``kvstore.open_store``) in its own process, so that
loads and saves are in-process copies; the scheduler, which runs in vLLM's
engine-core process, reaches each worker's store for its lookups through a
:class:`LookupEndpoint`: the same store served by :func:`kvstore.serve_in_process` on a
free loopback port, whose address the worker sends in its handshake.

:class:`StoreHealth` keeps a process from calling a store that just failed:
after a failure it answers "down" for a backoff that doubles per consecutive
failure, so an unreachable node costs one timeout per backoff, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvstore.client import KVStoreClient
from kvstore.config import Config, load_config
from kvstore.connectors.vllm.config import VLLMConnectorConfig
from kvstore.embedded import EmbeddedStore
from kvstore.security import bearer_metadata, channel_credentials

logger = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 16
"""The longest backoff of :class:`StoreHealth`, in multiples of ``down_backoff_s``."""


def open_client(config: VLLMConnectorConfig, target: str | None = None, token: str | None = None) -> KVStoreClient:
    """A client of the configured nodes, with the connector's deadline, TLS and token.

    Args:
        config: the connector's settings.
        target: a worker's lookup endpoint instead of the configured nodes (plaintext loopback).
        token: the endpoint's token, with ``target``.

    Raises:
        ConfigError: on an unreadable TLS or token file.
    """
    credentials = None
    if target is None and (config.tls_ca_file or config.tls_cert_file):
        credentials = channel_credentials(config.tls_ca_file, cert_file=config.tls_cert_file,
                                          key_file=config.tls_key_file)
    if target is None:
        token = config.bearer_token()
    metadata = bearer_metadata(token) if token else ()
    targets = [target] if target is not None else list(config.targets)
    return KVStoreClient(targets, timeout_s=config.timeout_s, credentials=credentials,
                         metadata=metadata, down_backoff_s=config.down_backoff_s,
                         max_down_backoff_s=config.down_backoff_s * MAX_BACKOFF_FACTOR)


def embedded_config(config: VLLMConnectorConfig) -> Config:
    """The embedded store's whole configuration: the ``config`` file (if any), then ``KVSTORE_*`` variables.

    Raises:
        ConfigError: naming the field, on a bad file or variable.
    """
    return load_config(config.config)


class LookupEndpoint:
    """An embedded store of a worker, served on a free loopback port so the scheduler's lookups reach it.

    The endpoint serves the store's ``kvstore.v1.KVStore`` service over
    loopback, without metrics, and only to callers that present a bearer token
    made for it (:attr:`token`, which the scheduler gets in the worker's
    handshake), so other local users cannot read the cache through the port.
    The connector uses only Lookup through it; the worker's own loads and
    saves go to the store in-process.

    Args:
        store: the worker's embedded store.
        config: its configuration (limits apply to the endpoint too).

    Attributes:
        target: ``127.0.0.1:<port>``.
        token: the bearer token of every call.
    """

    def __init__(self, store: EmbeddedStore, config: Config) -> None:
        from kvstore.server.in_process import serve_in_process

        self._served = serve_in_process(store, config)
        self.token = self._served.token
        self.target = self._served.target

    def close(self) -> None:
        """Stop serving (the store stays open); never raises."""
        self._served.close()


class StoreHealth:
    """Whether to call the store now: down for a backoff after each failure, doubling up to a cap.

    Thread-safe. ``backoff_s == 0`` never marks the store down.

    Args:
        backoff_s: the first backoff, seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff_s = backoff_s
        self._now = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._down_until = 0.0

    def up(self) -> bool:
        """Whether a call may go to the store now."""
        with self._lock:
            return self._now() >= self._down_until

    def failed(self, what: str, exc: BaseException | None) -> None:
        """Record a failed call: the store is down for the next backoff."""
        with self._lock:
            self._failures += 1
            backoff = self._backoff_s * min(2 ** (self._failures - 1), MAX_BACKOFF_FACTOR)
            self._down_until = self._now() + backoff
        logger.warning("kvstore %s failed (%s); serving misses for %.1f s", what,
                       f"{type(exc).__name__}: {exc}" if exc else "timed out", backoff)

    def succeeded(self) -> None:
        """Record a call that worked: the backoff starts over."""
        if self._failures:
            with self._lock:
                self._failures = 0
                self._down_until = 0.0
