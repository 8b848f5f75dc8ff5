"""A connector's way to the store: one client (or embedded store) from its settings, and the backoff after failures.

Every connector's settings name the nodes (``targets``), a deadline, TLS files
and a bearer token alike (:class:`ConnectionSettings`); :func:`open_client`
turns them into a :class:`~kvstore.client.KVStoreClient`, and
:func:`open_block_store` into that or, with no nodes named, an embedded store.

:class:`StoreHealth` keeps a process from calling a store that just failed:
after a failure it answers "down" for a backoff that doubles per consecutive
failure, so an unreachable node costs one timeout per backoff, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from kvstore.api import BlockClient
from kvstore.client import KVStoreClient
from kvstore.config import load_config
from kvstore.embedded import EmbeddedStore
from kvstore.security import bearer_metadata, channel_credentials

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 16
"""The longest backoff of :class:`StoreHealth` (and of a client's down node), in multiples of ``down_backoff_s``."""


class ConnectionSettings(Protocol):
    """What a connector's settings say about its way to the nodes (``VLLMConnectorConfig``, ``SGLangStorageConfig``).

    Attributes:
        targets: the nodes' ``host:port``, in order; empty for an embedded store.
        config: a kvstore config file for the embedded store, or ``None``.
        timeout_s: the longest one store call may take, seconds.
        down_backoff_s: the first backoff after a failed call, seconds.
        tls_ca_file: CA certificate(s) of the nodes (TLS), or ``None``.
        tls_cert_file: the client certificate (mutual TLS), or ``None``.
        tls_key_file: its private key, or ``None``.
    """

    @property
    def targets(self) -> tuple[str, ...]: ...

    @property
    def config(self) -> str | None: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def down_backoff_s(self) -> float: ...

    @property
    def tls_ca_file(self) -> str | None: ...

    @property
    def tls_cert_file(self) -> str | None: ...

    @property
    def tls_key_file(self) -> str | None: ...

    def bearer_token(self) -> str | None:
        """The bearer token to send, or ``None``."""
        ...


def channel_security(settings: ConnectionSettings) -> tuple[grpc.ChannelCredentials | None, Sequence[tuple[str, str]],
                                                             str | None]:
    """The TLS credentials, call metadata and bearer token the settings give for calls to the nodes.

    Returns:
        ``(credentials, metadata, token)``: ``None`` credentials for plaintext, ``()`` metadata and a ``None``
        token when no token is set.

    Raises:
        ConfigError: on an unreadable TLS or token file.
    """
    credentials = None
    if settings.tls_ca_file or settings.tls_cert_file:
        credentials = channel_credentials(settings.tls_ca_file, cert_file=settings.tls_cert_file,
                                          key_file=settings.tls_key_file)
    token = settings.bearer_token()
    return credentials, bearer_metadata(token) if token else (), token


def open_client(settings: ConnectionSettings, target: str | None = None, token: str | None = None) -> KVStoreClient:
    """A client of the configured nodes, with the settings' deadline, TLS, token and down-node backoff.

    Args:
        settings: the connector's settings.
        target: another endpoint instead of the configured nodes (a worker's lookup endpoint: plaintext loopback).
        token: that endpoint's token, with ``target``.

    Raises:
        ConfigError: on an unreadable TLS or token file.
    """
    if target is None:
        credentials, metadata, _ = channel_security(settings)
        targets = list(settings.targets)
    else:
        credentials, metadata, targets = None, bearer_metadata(token) if token else (), [target]
    return KVStoreClient(targets, timeout_s=settings.timeout_s, credentials=credentials, metadata=metadata,
                         down_backoff_s=settings.down_backoff_s,
                         max_down_backoff_s=settings.down_backoff_s * MAX_BACKOFF_FACTOR)


def open_block_store(settings: ConnectionSettings) -> BlockClient:
    """A client of the configured nodes (:func:`open_client`), or an embedded store when the settings name none.

    The embedded store is configured by ``settings.config`` (a file; ``KVSTORE_*`` variables apply on top).

    Raises:
        ConfigError: on an unreadable TLS or token file, or a bad embedded-store config.
    """
    if not settings.targets:
        return EmbeddedStore(load_config(settings.config).store)
    return open_client(settings)


def agentic(session_id: str | None, ttl_s: float | None) -> dict[str, Any]:
    """The keywords of a store call that carry a request's session and TTL, only those set (``docs/agentic.md``)."""
    extra: dict[str, Any] = {}
    if session_id:
        extra["session_id"] = session_id
    if ttl_s:
        extra["ttl_s"] = ttl_s
    return extra


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
