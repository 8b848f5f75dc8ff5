"""Whether and how a node offers the bulk path: its listener, grant table and control calls, made from the config."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING

from kvstore.bulk.node.grants import GrantBudget, GrantTable
from kvstore.bulk.node.listener import BulkListener
from kvstore.bulk.node.operations import BulkOperations
from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.shm.node.pool import SharedPool

if TYPE_CHECKING:
    from kvstore.server.service import NodeService

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or name (``127.*``, ``::1``, ``localhost``)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def bulk_refusal(config: Config) -> str | None:
    """Why the node must not offer the bulk path with ``config``, or ``None`` when it may.

    Off loopback, a node whose clients send bearer tokens offers it only over
    TLS: its grants and blocks would otherwise cross the network in the clear
    beside tokens that are meant to protect them.
    """
    bulk, security = config.bulk, config.security
    if not bulk.enabled:
        return "bulk.enabled is off"
    host = bulk.host or config.server.host
    tokens = bool(security.auth_tokens or security.auth_tokens_file)
    if tokens and not security.tls_cert_file and not is_loopback(host):
        return (f"the node authenticates with bearer tokens but has no TLS, and bulk.host {host} is not loopback: "
                "set security.tls_cert_file and security.tls_key_file")
    return None


def server_ssl_context(config: Config) -> ssl.SSLContext:
    """The listener's TLS context: the node's certificate; client certificates required with ``tls_client_ca_file``.

    Raises:
        ConfigError: if a file cannot be read or used.
    """
    security = config.security
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
        if security.tls_client_ca_file:
            context.load_verify_locations(security.tls_client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("security", f"the bulk listener cannot use the TLS files: {exc}") from exc
    return context


def start_bulk(config: Config, service: NodeService) -> BulkListener | None:
    """Start the node's bulk listener and give ``service`` its control calls; ``None`` when it offers none.

    Raises:
        ConfigError: if ``bulk.port`` cannot be bound, or the TLS files cannot be used.
    """
    reason = bulk_refusal(config)
    if reason is not None:
        if config.bulk.enabled:
            logger.warning("no bulk path: %s; remote clients use Get and Put", reason)
        return None
    bulk = config.bulk
    host = bulk.host or config.server.host
    loop = asyncio.get_running_loop()
    grants = GrantTable(loop, bulk.grant_s, GrantBudget(bulk.tenant_grant_bytes, bulk.max_grant_bytes))
    tls = server_ssl_context(config) if config.security.tls_cert_file else None
    listener = BulkListener(bulk, host, grants, loop, tls, service.count,
                            max_request_bytes=config.server.max_message_bytes)
    try:
        listener.start()
    except OSError as exc:
        raise ConfigError("bulk.port", f"cannot listen on {host}:{bulk.port}: {exc}; pick another with "
                                       "--bulk-port, or 0 for a free one") from exc
    pool = next((tier for tier in service.store.tiers if isinstance(tier, SharedPool)), None)
    service.bulk = BulkOperations(service, grants, pool, (bulk.advertise_host, listener.port, tls is not None))
    listener.dispatch = service.bulk.dispatch
    logger.info("bulk path on %s:%d%s", host, listener.port, " (TLS)" if tls is not None else "")
    return listener
