"""The gRPC server: composes the store, the servicer, health, reflection and metrics, and shuts down in order.

Shutdown order (grpc's ``examples/python/`` and the house style): health reports
NOT_SERVING and the servicer refuses new calls with UNAVAILABLE (for
``server.shutdown_delay_s`` with the port open), then ``server.stop(grace_s)``
lets running calls finish, then the store is closed (memory demoted, LMDB
flushed), then the metrics endpoint stops. ``kvstore serve`` runs
``kvstore.server.process.serve``, which does this on SIGTERM or SIGINT; a second
signal cuts the waits short. Tuning the process (malloc, threads, the event
loop) is ``kvstore.server.process``'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.events import NodeEvents
from kvstore.events.metrics import EventsCollector
from kvstore.server.admission import Admission
from kvstore.server.health import NodeHealth
from kvstore.server.logs import LIFECYCLE_LOGGER
from kvstore.server.metrics import ServiceMetrics, StoreCollector
from kvstore.server.node_events import open_tenants_and_events
from kvstore.server.call import SERVICE_NAME
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.service import CallFailed, NodeService
from kvstore.wire import channel_options, chunk_bytes_for, reply_head
from kvstore.store.factory import open_async_store
from kvstore.store.tiered import TieredStore
from kvstore.unix_sockets import SOCKET_MODE, claim_socket_path, remove_socket_path

if TYPE_CHECKING:
    from kvstore.bulk.node.listener import BulkListener
    from kvstore.server.tenants import TenantTags
    from kvstore.shm.node.plane import SharedMemoryNode

logger = logging.getLogger(__name__)
lifecycle = logging.getLogger(LIFECYCLE_LOGGER)


class KVStoreServer:
    """One kvstore node: a ``grpc.aio`` server around a :class:`TieredStore`.

    Use from one asyncio loop (the store's owner)::

        server = KVStoreServer(load_config())
        await server.start()
        ...
        await server.stop()

    Args:
        config: the whole configuration (``store``, ``server``, ``limits``, ``security``).
        store: an already started store to serve; it is then not closed by
            :meth:`stop`. ``None`` opens one from ``config.store``.
        interceptors: ``grpc.aio.ServerInterceptor`` s to run on every call, in
            order (none by default: the servicer admits calls itself, see
            ``kvstore.server.admission``, and any interceptor slows every call).

    Attributes:
        service: the node's service, its checks and operations for every transport (after :meth:`start`).
        servicer: the ``kvstore.v1.KVStore`` servicer, gRPC's transport for it (after :meth:`start`).
        admission: authenticates calls and limits them per connection
            (``kvstore.server.admission``; after :meth:`start`).
        shm: the same-host data plane (``kvstore.shm.node.plane``), ``None`` when off or unsupported (after :meth:`start`).
        bulk: the bulk listener (``kvstore.bulk.node.listener``), ``None`` when off (after :meth:`start`).

    Raises:
        ConfigError: from :meth:`start`, on an unreadable TLS file or a malformed
            tokens file (see ``kvstore.server.auth`` and ``docs/security.md``).
    """

    def __init__(
        self,
        config: Config,
        *,
        store: TieredStore | None = None,
        interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
    ) -> None:
        self.config = config
        self._store = store
        self._own_store = store is None
        self._interceptors = interceptors
        self.metrics = ServiceMetrics()
        self.health = NodeHealth()
        self.service: NodeService | None = None
        self.servicer: KVStoreServicer | None = None
        self.admission: Admission | None = None
        self._server: grpc.aio.Server | None = None
        self.shm: SharedMemoryNode | None = None
        self.bulk: BulkListener | None = None
        self._unix_inode: int | None = None
        self.events: NodeEvents | None = None  # the KV event stream (``events.endpoint``), after :meth:`start`
        self.tenants: TenantTags | None = None  # the pairs tenant -> namespace (quota, event routes), after start
        self.port = 0
        self.metrics_port = -1
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._hurry: asyncio.Event | None = None

    @property
    def store(self) -> TieredStore:
        """The store being served (after :meth:`start`)."""
        if self._store is None:
            raise RuntimeError("the server is not started")
        return self._store

    @property
    def target(self) -> str:
        """``host:port`` that clients connect to (after :meth:`start`); ``unix://<path>`` with no TCP port."""
        if self.config.server.port < 0:
            return self.unix_target
        return f"{self.config.server.host}:{self.port}"

    @property
    def unix_target(self) -> str:
        """``unix://<path>`` of ``server.unix_socket``, ``""`` when the node listens on none."""
        path = self.config.server.unix_socket
        return f"unix://{os.path.abspath(path)}" if path else ""

    async def start(self) -> None:
        """Open the store (unless given), bind the port, report SERVING and start the metrics endpoint.

        Raises:
            ConfigError: on an unusable security setting (a TLS or tokens file), or a gRPC or
                metrics port that cannot be bound (naming ``server.port`` or ``server.metrics_port``).
        """
        server_cfg, security = self.config.server, self.config.security
        admission = Admission.from_config(self.config)  # before anything opens: a bad tokens file fails fast
        credentials = _server_credentials(self.config) if security.tls_cert_file else None
        if admission.authenticates and credentials is None and not _is_loopback(server_cfg.host):
            logger.warning("bearer tokens are on without TLS on %s: tokens cross the network in plaintext; "
                           "set security.tls_cert_file and security.tls_key_file", server_cfg.host)
        self.admission = admission
        self._stopped, self._hurry = asyncio.Event(), asyncio.Event()
        self.tenants, self.events = open_tenants_and_events(self.config, admission, with_events=self._store is None)
        if self._store is None:
            try:
                self._store = await open_async_store(self.config.store, framing=functools.partial(
                    reply_head, chunk_bytes=chunk_bytes_for(self.config.server.max_message_bytes)),
                    events=self.events.log if self.events is not None else None,
                    shared_pool=_shared_memory_on(self.config))
            except BaseException:
                if self.events is not None:
                    self.events.close()
                raise
        elif self.config.events.endpoint:
            logger.warning("events.endpoint is ignored: the node serves a store it did not open (its events go to "
                           "whatever observer that store was given)")
        self.health.tier_states = self._tier_states
        self.tenants.namespace_bytes = self._store.namespace_bytes
        try:
            self.shm = await _start_shared_memory(self.config, self._store)
            self.service = NodeService(self._store, self.config, self.metrics, admission, tenants=self.tenants)
            if self.shm is not None:
                from kvstore.shm.node.operations import SameHostOperations

                self.service.same_host = SameHostOperations(self.service, self.shm, CallFailed)
            from kvstore.bulk.node.setup import start_bulk

            self.bulk = start_bulk(self.config, self.service)
            self.servicer = KVStoreServicer(self.service)
            if self.events is not None:  # Capabilities tells clients (the vLLM connector) where the events are
                publisher = self.events.publisher
                self.servicer.events_offer = (publisher.endpoint, publisher.replay_endpoint or "",
                                              publisher.settings.topic, publisher.authenticated)
            server = grpc.aio.server(
                interceptors=self._interceptors or None,
                options=[*channel_options(server_cfg.max_message_bytes), ("grpc.so_reuseport", 0)],
            )
            self.servicer.add_to_server(server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
            if server_cfg.port >= 0:
                address = f"{server_cfg.host}:{server_cfg.port}"
                self.port = _add_port(server, address, credentials)
                if self.port == 0:
                    raise ConfigError("server.port", f"cannot listen on {address}: the port is in use (or the "
                                                     "address is not this host's); pick another with --port "
                                                     "(KVSTORE_PORT), or --port 0 for a free one")
            if server_cfg.unix_socket:
                claim_socket_path(server_cfg.unix_socket)  # a stale file is replaced; a live node's is an error
                if _add_port(server, self.unix_target, credentials) == 0:
                    raise ConfigError("server.unix_socket", f"cannot listen on the Unix socket "
                                                            f"{server_cfg.unix_socket} (is its directory there "
                                                            "and writable?); pick another with --unix-socket "
                                                            "(KVSTORE_UNIX_SOCKET)")
            await server.start()
            self._server = server
            if server_cfg.unix_socket:
                os.chmod(server_cfg.unix_socket, SOCKET_MODE)
                self._unix_inode = os.lstat(server_cfg.unix_socket).st_ino
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if server_cfg.metrics_port >= 0:
                self.metrics.add_store(StoreCollector.on_loop(asyncio.get_running_loop(), self._store.stats))
                self.metrics.add_budgets(self.service.replies, self.service.puts)
                if self.bulk is not None:
                    from kvstore.bulk.node.metrics import BulkCollector

                    self.metrics.registry.register(BulkCollector(self.bulk.counters))  # plain ints: any thread
                if self.shm is not None:
                    self.metrics.add_shared_memory(StoreCollector.on_loop(asyncio.get_running_loop(),
                                                                          self.shm.counters))
                if self.events is not None:
                    self.metrics.registry.register(EventsCollector(self.events.publisher.counters))
                self.metrics_port = _start_metrics(self.metrics, server_cfg.metrics_host, server_cfg.metrics_port)
        except BaseException:
            await self._abandon()
            self._stopped.set()
            raise
        lifecycle.info(
            "serving",
            extra={"fields": {"host": server_cfg.host, "port": self.port, "unix_socket": server_cfg.unix_socket,
                              "shared_memory": self.shm.handoff_address if self.shm is not None else "",
                              "bulk_port": self.bulk.port if self.bulk is not None else -1,
                              "metrics_port": self.metrics_port,
                              "events": self.events.publisher.endpoint if self.events is not None else "",
                              "tiers": self._store.tier_names, "tls": credentials is not None,
                              "mtls": bool(security.tls_client_ca_file), "auth": admission.authenticates,
                              "require_sha256": self.service.require_sha256,
                              "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0]}},
        )

    def _tier_states(self) -> dict[str, str]:
        """``{tier: "up" | "down"}`` of the store's tiers that can be down, for :class:`NodeHealth`."""
        return {t.name: t.state for t in self.store.stats().tiers if t.state}

    async def begin_shutdown(self) -> None:
        """Report NOT_SERVING and refuse new calls with UNAVAILABLE; running calls go on."""
        await self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.begin_shutdown()
        if self.service is not None:
            self.service.bulk = None  # no new grants; transfers of grants issued go on until the server stops
        if self.shm is not None:
            self.shm.begin_shutdown()  # sessions end: clients detach and use gRPC while the node drains

    async def stop(self, grace_s: float | None = None) -> None:
        """Shut down in order: NOT_SERVING, ``server.shutdown_delay_s``, ``server.stop(grace_s)``, close the store.

        During the delay the port stays open: health checks answer NOT_SERVING
        and KVStore calls UNAVAILABLE. Then new connections are refused and
        running calls get ``grace_s`` to finish; then the store is closed (memory
        demoted to disk, LMDB flushed) and the metrics endpoint stopped. A call
        while a shutdown is under way waits for that one to finish (use
        :meth:`cut_grace_short` to hurry it).

        Args:
            grace_s: seconds running calls get to finish; ``server.grace_s`` when ``None``.
        """
        if self._stopped is None or self._stopped.is_set():
            return
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        hurry = self._hurry
        assert hurry is not None  # set with self._stopped by start()
        grace_s = self.config.server.grace_s if grace_s is None else grace_s
        lifecycle.info("shutting down", extra={"fields": {"grace_s": grace_s}})
        await self.begin_shutdown()
        delay_s = self.config.server.shutdown_delay_s
        if delay_s > 0 and self._server is not None:
            with contextlib.suppress(TimeoutError):  # the port stays open, reporting NOT_SERVING
                await asyncio.wait_for(hurry.wait(), delay_s)
        if self._server is not None:
            await self._server.stop(0 if hurry.is_set() else grace_s)
        if self.servicer is not None:
            self.servicer.close()
        await self._close_listeners()
        await self._close_store()
        self.metrics.stop_http()
        self._stopped.set()
        lifecycle.info("stopped")

    async def cut_grace_short(self) -> None:
        """During :meth:`stop`, end the shutdown delay and cancel the running calls now, not after the grace period.

        The rest of the shutdown goes on as usual: the store is still closed, so
        the memory tier is still demoted to disk. Does nothing unless a stop is under way.
        """
        if not self._stopping or self._stopped is None or self._stopped.is_set() or self._hurry is None:
            return
        lifecycle.info("cutting the shutdown short: cancelling running calls")
        self._hurry.set()
        if self._server is not None:
            await self._server.stop(0)  # grpc.aio: a shorter grace overrides the running stop's

    async def _abandon(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
        if self.servicer is not None:
            self.servicer.close()
        await self._close_listeners()
        await self._close_store()
        self.metrics.stop_http()

    async def _close_listeners(self) -> None:
        """End the same-host sessions and bulk connections, and remove the socket files this node made."""
        if self.bulk is not None:
            bulk, self.bulk = self.bulk, None
            await bulk.close()
            bulk.grants.close()
        if self.shm is not None:
            await self.shm.close()
        if self._unix_inode is not None:
            remove_socket_path(self.config.server.unix_socket, self._unix_inode)
            self._unix_inode = None

    async def _close_store(self) -> None:
        if self.tenants is not None:  # the pairs of namespaces that hold bytes, for the next start
            self.tenants.save()
        if self._own_store and self._store is not None:
            await self._store.close()
        if self.events is not None:  # after the store: its last moves are published
            self.events.close()

    async def __aenter__(self) -> KVStoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on ``address`` (``host:port`` or ``unix://<path>``); the port bound (0: failed; 1 for a Unix socket)."""
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError:  # grpc: "Failed to bind to address ...; set GRPC_VERBOSITY=debug"
        return 0


def _shared_memory_on(config: Config) -> bool:
    """Whether the node will offer the same-host data plane: ``shared_memory.enabled``, on a platform that has it."""
    from kvstore.shm.segment import unsupported_reason

    return config.shared_memory.enabled and unsupported_reason() is None


async def _start_shared_memory(config: Config, store: TieredStore) -> SharedMemoryNode | None:
    """The node's same-host data plane, started; ``None`` when ``shared_memory.enabled`` is off or unsupported here.

    Its blocks are read in place where the store's memory tier is the shared pool (``kvstore.shm.node.pool``).

    Raises:
        OSError: if the handoff socket cannot be bound (its path is in use).
    """
    if not config.shared_memory.enabled:
        return None
    from kvstore.shm.host import default_handoff_address
    from kvstore.shm.node.plane import SharedMemoryNode
    from kvstore.shm.node.pool import SharedPool
    from kvstore.shm.segment import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        logger.info("no same-host data plane: %s; clients use gRPC", reason)
        return None
    unix_socket = os.path.abspath(config.server.unix_socket) if config.server.unix_socket else ""
    address = config.shared_memory.handoff_socket or default_handoff_address(unix_socket)
    if not address.startswith("@"):
        address = os.path.abspath(address)
    pool = next((tier for tier in store.tiers if isinstance(tier, SharedPool)), None)
    node = SharedMemoryNode(config.shared_memory, address, pool, config.server.max_message_bytes)
    await node.start()
    return node


def _start_metrics(metrics: ServiceMetrics, host: str, port: int) -> int:
    """Start the Prometheus endpoint; the bound port.

    Raises:
        ConfigError: naming ``server.metrics_port`` and the flags that change it, if it cannot listen there.
    """
    try:
        return metrics.start_http(host, port)
    except OSError as exc:
        raise ConfigError("server.metrics_port", f"cannot listen on {host}:{port} for Prometheus metrics: "
                                                 f"{exc.strerror or exc}; pick another with --metrics-port "
                                                 "(KVSTORE_METRICS_PORT), --metrics-port 0 for a free one, or "
                                                 "--metrics-port -1 for no metrics endpoint") from None


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _server_credentials(config: Config) -> grpc.ServerCredentials:
    """TLS credentials of the server; with ``tls_client_ca_file``, client certificates are required and verified.

    Raises:
        ConfigError: if a file cannot be read.
    """
    security = config.security
    try:
        key = Path(security.tls_key_file).read_bytes()
        cert = Path(security.tls_cert_file).read_bytes()
        client_ca = Path(security.tls_client_ca_file).read_bytes() if security.tls_client_ca_file else None
    except OSError as exc:
        raise ConfigError("security", f"cannot read a TLS file: {exc}") from exc
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
