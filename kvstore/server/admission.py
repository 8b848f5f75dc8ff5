"""Admission of ``kvstore.v1.KVStore`` calls: the bearer token, then the per-connection in-flight limit.

The servicer admits every call first thing, before it parses the request (its
handlers take raw bytes), inside the one wrapper that also maps errors and
counts metrics (``KVStoreServicer._call`` for gRPC, ``NodeService.scope`` for
a same-host session's control channels). Doing it there rather than in a
``grpc.aio.ServerInterceptor`` keeps gRPC's direct dispatch: with any
interceptor, ``grpc.aio`` runs an interceptor coroutine and a handler wrapper
on every call, health and reflection included, which cost more than the
checks themselves (``benchmarks/bench_service.py``). Health and reflection
stay open for probes.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Sequence

import grpc

from kvstore.config import Config
from kvstore.errors import KVStoreError
from kvstore.server.auth import Authenticator, Principal
from kvstore.error_codes import status_of
from kvstore.server.inflight import InflightLimiter

logger = logging.getLogger(__name__)


def authenticates_clients(config: Config) -> bool:
    """Whether a node with ``config`` authenticates its clients in any way: bearer tokens
    (``security.auth_tokens[_file]``) or client certificates (``security.tls_client_ca_file``, mutual TLS).

    Such a node must not offer anything unauthenticated to the network: its event stream stays local unless
    subscribers authenticate too (``kvstore.events.publisher.check_endpoint``).
    """
    security = config.security
    return bool(security.auth_tokens or security.auth_tokens_file or security.tls_client_ca_file)


class Ticket(NamedTuple):
    """An admitted call: who made it, and the connection it counts against.

    Attributes:
        principal: the caller's token and tenants; ``None`` when authentication is off.
        peer: ``context.peer()`` when the call holds an in-flight slot, else ``None``.
    """

    principal: Principal | None
    peer: str | None


OPEN_TICKET = Ticket(None, None)
"""The ticket of every call on a node with neither authentication nor an in-flight limit."""


class Admission:
    """Authenticates a call and holds its in-flight slot until :meth:`release`.

    Args:
        authenticator: checks the bearer token; ``None`` when authentication is off.
        inflight: the per-connection limit of concurrent calls; ``None`` for none.
    """

    def __init__(self, *, authenticator: Authenticator | None, inflight: InflightLimiter | None) -> None:
        self.authenticator = authenticator
        self.inflight = inflight

    @classmethod
    def from_config(cls, config: Config) -> Admission:
        """The admission of ``config.security`` (tokens) and ``config.limits.max_inflight_per_connection``.

        Raises:
            ConfigError: if the tokens file cannot be read or a tokens source is malformed.
        """
        return cls(
            authenticator=Authenticator.from_config(config.security),
            inflight=InflightLimiter(config.limits.max_inflight_per_connection),
        )

    @property
    def authenticates(self) -> bool:
        """Whether every call must carry a valid bearer token."""
        return self.authenticator is not None

    def admit(self, method: str, context: grpc.aio.ServicerContext) -> Ticket:
        """:meth:`admit_call` of a gRPC call (its metadata and peer from ``context``).

        Raises:
            UnauthenticatedError, ResourceExhaustedError: as :meth:`admit_call`.
        """
        if self.authenticator is None and self.inflight is None:
            return OPEN_TICKET
        return self.admit_call(method, context.invocation_metadata() or (), context.peer())

    def admit_call(self, method: str, metadata: Sequence[tuple[str, Any]], peer: str) -> Ticket:
        """Check one call's token, then take an in-flight slot of its connection (whatever transport carried it).

        Args:
            method: RPC name, e.g. ``Get`` (for the log line of a refusal).
            metadata: the call's metadata (its ``authorization`` entry).
            peer: the connection the call counts against.

        Returns:
            The call's ticket; pass it to :meth:`release` when the call ends.

        Raises:
            UnauthenticatedError: on a missing, malformed or unknown token.
            ResourceExhaustedError: if the connection already has
                ``max_inflight_per_connection`` calls in flight.
        """
        if self.authenticator is None and self.inflight is None:
            return OPEN_TICKET
        try:
            principal = None
            if self.authenticator is not None:
                principal = self.authenticator.authenticate(metadata)
            if self.inflight is not None:
                self.inflight.acquire(peer)
        except KVStoreError as exc:
            code, message = status_of(exc)
            logger.info("%s refused for %s: %s", method, peer, message,
                        extra={"fields": {"method": method, "code": code.name, "peer": peer}})
            raise
        return Ticket(principal, peer if self.inflight is not None else None)

    def release(self, ticket: Ticket) -> None:
        """Give back the in-flight slot of an admitted call."""
        if ticket.peer is not None and self.inflight is not None:
            self.inflight.release(ticket.peer)
