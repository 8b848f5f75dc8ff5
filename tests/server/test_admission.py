"""Admission of a call as pure logic: the bearer token, then the in-flight slot of its connection.

The context is gRPC's, so a small stand-in with ``peer()`` and ``invocation_metadata()`` is enough here;
``tests/security`` covers the same checks through real servers.
"""

from __future__ import annotations

from typing import Sequence

import pytest

from kvstore.errors import ResourceExhaustedError
from kvstore.security import bearer_metadata
from kvstore.server.admission import OPEN_TICKET, Admission, Ticket
from kvstore.server.auth import Authenticator, Principal
from kvstore.error_codes import UnauthenticatedError
from kvstore.server.inflight import InflightLimiter
from tests.support.security import TOKEN_A, TOKEN_ADMIN, TOKEN_B, auth_config
from tests.support.server import make_config


class Context:
    """What admission reads of a ``grpc.aio.ServicerContext``: the peer and the metadata."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:50000", metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._peer = peer
        self._metadata = tuple(metadata)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_a_node_without_auth_or_limit_admits_every_call_with_the_open_ticket() -> None:
    admission = Admission(authenticator=None, inflight=None)
    assert not admission.authenticates
    tickets = [admission.admit("Get", Context()) for _ in range(1000)]
    assert all(t is OPEN_TICKET for t in tickets)
    assert OPEN_TICKET == Ticket(None, None)
    for ticket in tickets:
        admission.release(ticket)


def test_from_config_always_limits_calls_per_connection() -> None:
    admission = Admission.from_config(make_config(**{"limits.max_inflight_per_connection": 3}))
    assert not admission.authenticates
    assert admission.inflight is not None and admission.inflight.max_per_connection == 3
    ticket = admission.admit("Lookup", Context("ipv4:10.0.0.7:1"))
    assert ticket == Ticket(None, "ipv4:10.0.0.7:1")
    admission.release(ticket)
    assert admission.inflight.snapshot() == {}


def test_the_inflight_limit_refuses_one_call_too_many_and_admits_again_after_a_release() -> None:
    admission = Admission.from_config(make_config(**{"limits.max_inflight_per_connection": 2}))
    context = Context("ipv4:10.0.0.7:1")
    held = [admission.admit("Get", context), admission.admit("Put", context)]
    with pytest.raises(ResourceExhaustedError, match="max_inflight_per_connection=2"):
        admission.admit("Lookup", context)
    other = admission.admit("Lookup", Context("ipv4:10.0.0.7:2"))  # another connection has its own slots
    admission.release(held.pop())
    held.append(admission.admit("Lookup", context))
    with pytest.raises(ResourceExhaustedError):
        admission.admit("Lookup", context)
    for ticket in [*held, other]:
        admission.release(ticket)
    assert admission.inflight.snapshot() == {} and admission.inflight.num_connections == 0


def test_a_refused_call_holds_no_slot() -> None:
    admission = Admission.from_config(make_config(**{"limits.max_inflight_per_connection": 1}))
    context = Context()
    ticket = admission.admit("Get", context)
    for _ in range(3):
        with pytest.raises(ResourceExhaustedError):
            admission.admit("Get", context)
    admission.release(ticket)
    assert admission.inflight.snapshot() == {}
    admission.release(admission.admit("Get", context))


def test_with_tokens_a_call_without_a_valid_token_is_unauthenticated() -> None:
    admission = Admission.from_config(auth_config(**{"limits.max_inflight_per_connection": 1}))
    assert admission.authenticates
    for metadata in ([], bearer_metadata("not-a-configured-token"), [("authorization", TOKEN_A)],
                     [*bearer_metadata(TOKEN_A), *bearer_metadata(TOKEN_B)]):
        with pytest.raises(UnauthenticatedError):
            admission.admit("Get", Context(metadata=metadata))
    assert admission.inflight.snapshot() == {}  # refused before it took a slot
    ticket = admission.admit("Get", Context(metadata=bearer_metadata(TOKEN_A)))
    assert ticket.principal == Principal("security.auth_tokens#0", frozenset({"tenant-a"}))
    assert ticket.peer == Context().peer()
    with pytest.raises(UnauthenticatedError):  # the token is checked before the (full) in-flight limit
        admission.admit("Get", Context())
    with pytest.raises(ResourceExhaustedError):
        admission.admit("Get", Context(metadata=bearer_metadata(TOKEN_ADMIN)))
    admission.release(ticket)
    assert admission.admit("Get", Context(metadata=bearer_metadata(TOKEN_B))).principal.covers("tenant-b")


def test_auth_without_a_limit_gives_tickets_without_a_peer() -> None:
    authenticator = Authenticator.from_config(auth_config().security)
    admission = Admission(authenticator=authenticator, inflight=None)
    ticket = admission.admit("Stats", Context(metadata=bearer_metadata(TOKEN_ADMIN)))
    assert ticket.peer is None and ticket.principal is not None and ticket.principal.all_tenants
    admission.release(ticket)
    with pytest.raises(UnauthenticatedError):
        admission.admit("Stats", Context())


def test_a_limit_without_auth_gives_tickets_without_a_principal() -> None:
    admission = Admission(authenticator=None, inflight=InflightLimiter(1))
    ticket = admission.admit("Get", Context("ipv6:[::1]:5"))
    assert ticket == Ticket(None, "ipv6:[::1]:5")
    admission.release(ticket)
    admission.release(OPEN_TICKET)  # a ticket without a slot gives nothing back
    assert admission.inflight.snapshot() == {}
