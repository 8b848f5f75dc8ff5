"""Serve an embedded store over gRPC from inside its own process: :func:`serve_in_process`."""

from __future__ import annotations

import dataclasses
import logging

from kvstore.config import Config, SecurityConfig
from kvstore.embedded import EmbeddedStore
from kvstore.security import new_token, token_sha256
from kvstore.server.app import KVStoreServer
from kvstore.server.auth import ALL_TENANTS

logger = logging.getLogger(__name__)

DEFAULT_STOP_TIMEOUT_S = 10.0
"""How long :meth:`InProcessServer.close` waits for the server to stop, seconds."""


class InProcessServer:
    """A ``kvstore.v1.KVStore`` server of an :class:`~kvstore.embedded.EmbeddedStore`, on the store's own loop.

    Made by :func:`serve_in_process`. Clients reach it at :attr:`target` with
    the bearer :attr:`token` (``kvstore.security.bearer_metadata``); it serves
    every tenant's namespaces to that token. Closing it stops serving and
    leaves the store open (the store's owner closes it).

    Attributes:
        target: ``host:port`` the server listens on.
        token: the bearer token every call must carry (a fresh random one per server).
    """

    def __init__(self, store: EmbeddedStore, server: KVStoreServer, token: str) -> None:
        self._store = store
        self._server = server
        self.token = token
        self.target = server.target

    def close(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Stop serving at once (calls in flight are cancelled); the store stays open. Never raises: a server that
        does not stop within ``timeout_s`` seconds is logged."""
        try:
            self._store.run(self._server.stop(0.0), timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - closing at shutdown: log, never raise
            logger.warning("the in-process kvstore server at %s did not stop cleanly", self.target, exc_info=True)

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_in_process(store: EmbeddedStore, config: Config | None = None, *, host: str = "127.0.0.1",
                     port: int = 0) -> InProcessServer:
    """Serve ``store`` over gRPC from this process, on the store's own event loop, until closed.

    What a connector uses to let another process (e.g. vLLM's scheduler in the
    engine-core process) reach a store that lives in a worker process, with no
    ``kvstore serve`` node: the server calls the same ``TieredStore`` the worker
    uses in-process, so both see one cache. Authentication is always on, with a
    fresh token (:attr:`InProcessServer.token`) that serves every tenant; no
    metrics endpoint is started.

    Example::

        store = kvstore.open_store()
        with kvstore.serve_in_process(store) as served:
            client = KVStoreClient(served.target, metadata=bearer_metadata(served.token))

    Args:
        store: the embedded store to serve (it stays owned by the caller).
        config: its configuration: the server, limits and store sections apply (``server.host``,
            ``server.port``, ``server.metrics_port`` and ``security`` are replaced); the defaults when ``None``.
        host: the address to listen on (loopback by default: only this host can connect).
        port: the TCP port, 0 for a free one.

    Returns:
        The running server (:attr:`InProcessServer.target`, :attr:`InProcessServer.token`).

    Raises:
        ConfigError: if the port cannot be bound.
        UnavailableError: if the store is closed, or used in a forked child.
    """
    config = config if config is not None else Config()
    token = new_token()
    server_config = dataclasses.replace(config.server, host=host, port=port, metrics_port=-1)
    security = SecurityConfig(auth_tokens=f"sha256:{token_sha256(token)}={ALL_TENANTS}", require_sha256=False)
    whole = Config(store=config.store, server=server_config, limits=config.limits, security=security)
    server = KVStoreServer(whole, store=store.store)
    store.run(server.start())
    return InProcessServer(store, server, token)
