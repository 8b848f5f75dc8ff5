"""Who may read which part of a node's KV events: on a node with bearer tokens, subscribers authenticate with
their token (ZMQ's PLAIN mechanism, checked by the node's ZAP handler) and each reads only the stream of the
tenants its token covers; a token that covers every tenant (``"*"``: an operator's, a router's) reads them all
(``docs/events.md``, "Trust model").

The node publishes one **stream** per distinct set of tenants its tokens cover,
and one of every event. An event of a namespace belongs to the tenant
(``cache_salt``) that namespace was used under on this node
(``kvstore.server.tenants``); the node's own events (its start, an overflow)
belong to every stream. Each stream has its own topic (``<events.topic>@<id>``,
so a subscriber of the prefix ``<events.topic>`` receives it), its own sequence
numbers (from 0, without gaps) and its own replay buffer: vLLM's framing,
unchanged, on each.

A subscription is routed by the node, not by the subscriber: the publishing
socket is an XPUB in ``XPUB_MANUAL`` mode, so a subscriber's request to
subscribe reaches the node with the identity its handshake established
(``User-Id``), and the node subscribes that connection to its own stream's
topic and nothing else, whatever prefix it asked for. A connection that did not
authenticate never gets past the handshake.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import zmq

from kvstore.events.log import EVERY_STREAM

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler to authenticate a handshake (RFC 27, ZAP)."""
ZAP_DOMAIN = b"kvstore-events"
"""The ZAP domain of the node's event sockets."""
PLAIN_USERNAME = b"kvstore"
"""The PLAIN user name a subscriber sends (any is accepted: the token, sent as the password, is what counts)."""

MAX_TENANTS = EVERY_STREAM - 1
"""Tenants the tokens may name, at most (routes are two bytes)."""


class Covering(Protocol):
    """What a token covers (``kvstore.server.auth.Principal``): its tenants, or every tenant."""

    @property
    def tenants(self) -> frozenset[str]:
        """``cache_salt`` values the token may use."""

    @property
    def all_tenants(self) -> bool:
        """Whether it covers every tenant."""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream of an authenticating node.

    Attributes:
        name: the stream's identity in the handshake (``User-Id``): ``all``, or 16 hex digits.
        topic: the first frame of its batches, ``<events.topic>@<name>``.
        tenants: the routes (tenant numbers) whose events it carries; ``None``: every event.
    """

    name: str
    topic: bytes
    tenants: frozenset[int] | None


class EventAccess:
    """The streams of a node with bearer tokens, and which token reads which (module docstring).

    Args:
        principals: what each configured token covers (``kvstore.server.auth.Authenticator.principals``).
        authenticate: token -> what it covers, ``None`` for an unknown token (constant time in the token:
            ``Authenticator.principal_of``).
        topic: ``events.topic``, the prefix of every stream's topic.

    Attributes:
        tenant_routes: each tenant the tokens name -> its route (1, 2, ...), for ``kvstore.server.tenants``.
        streams: the full stream first, then one per distinct set of tenants a token covers.

    Raises:
        ValueError: if the tokens name more than :data:`MAX_TENANTS` tenants.
    """

    def __init__(self, principals: Sequence[Covering], authenticate: Callable[[str], Covering | None],
                 topic: str) -> None:
        names = sorted({t for p in principals if not p.all_tenants for t in p.tenants})
        if len(names) > MAX_TENANTS:
            raise ValueError(f"the tokens name {len(names)} tenants; the event streams route at most {MAX_TENANTS}")
        self.tenant_routes: dict[str, int] = {name: i + 1 for i, name in enumerate(names)}
        self._authenticate = authenticate
        self.streams: list[StreamSpec] = [StreamSpec("all", f"{topic}@all".encode(), None)]
        self._stream_of_set: dict[frozenset[str], int] = {}
        for principal in principals:
            if principal.all_tenants or principal.tenants in self._stream_of_set:
                continue
            name = stream_name(principal.tenants)
            self._stream_of_set[principal.tenants] = len(self.streams)
            self.streams.append(StreamSpec(name, f"{topic}@{name}".encode(),
                                           frozenset(self.tenant_routes[t] for t in principal.tenants)))
        self._stream_of_name = {spec.name: i for i, spec in enumerate(self.streams)}

    def stream_of_token(self, token: str) -> int | None:
        """The stream a subscriber with ``token`` reads (0: every event), ``None`` for an unknown token."""
        principal = self._authenticate(token)
        if principal is None:
            return None
        return 0 if principal.all_tenants else self._stream_of_set.get(principal.tenants)

    def stream_of_name(self, name: str) -> int | None:
        """The stream of a handshake's ``User-Id``, ``None`` for none."""
        return self._stream_of_name.get(name)

    def answer(self, zap: zmq.Socket) -> None:
        """Answer one ZAP request waiting on ``zap`` (a REP socket bound at :data:`ZAP_ENDPOINT`).

        A PLAIN handshake whose password is a configured token is accepted, its ``User-Id`` the name of the
        token's stream; anything else is refused (400), and the connection closes before any message.
        """
        frames = zap.recv_multipart()
        if len(frames) < 6:  # not from libzmq: answer something so the REP socket can go on
            zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism, *credentials = frames
        stream = None
        if version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"PLAIN" and len(credentials) == 2:
            stream = self.stream_of_token(credentials[1].decode("utf-8", "surrogateescape"))
        if stream is None:
            logger.info("events: refused a subscriber from %s (no valid token)", address.decode(errors="replace"))
            zap.send_multipart([b"1.0", request_id, b"400", b"a valid bearer token is required", b"", b""])
            return
        zap.send_multipart([b"1.0", request_id, b"200", b"OK", self.streams[stream].name.encode(), b""])


def stream_name(tenants: Iterable[str]) -> str:
    """The name of the stream of a set of tenants: 16 hex digits of the SHA-256 of their sorted names
    (names are not shown; no name is a prefix of another, so no topic is a prefix of another)."""
    digest = hashlib.sha256("\0".join(sorted(tenants)).encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:16]


def authenticate_server(sock: zmq.Socket) -> None:
    """Make ``sock`` (before it binds) require a PLAIN handshake that the context's ZAP handler accepts."""
    sock.plain_server = True
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler, no connection (never accept all by default)


def authenticate_client(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` (before it connects) authenticate to an event socket with the bearer ``token``."""
    sock.plain_username = PLAIN_USERNAME
    sock.plain_password = token.encode("utf-8")
