"""Where a node publishes its KV events, asked of the node itself (``Capabilities``), for clients such as the
vLLM connector: a user turns on the engine's events and the connector finds the node's stream (``docs/events.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


@dataclass(frozen=True, slots=True)
class EventStream:
    """One node's event stream, as a subscriber connects to it.

    Attributes:
        endpoint: the PUB address, e.g. ``tcp://kv-0:5557``.
        replay_endpoint: the replay ROUTER's address, ``None`` when the node serves no replays.
        topic: the node's ``events.topic`` (with tokens: the prefix of every stream's topic).
        token: the bearer token to subscribe with, for a node whose stream is authenticated
            (``kvstore.events.access``); ``None`` for one whose stream is not.
    """

    endpoint: str
    replay_endpoint: str | None
    topic: str
    token: str | None = field(default=None, repr=False)


def reachable_address(bound: str, target: str) -> str:
    """A node's bound ZMQ address as a client that reached the node at ``target`` connects to it.

    A wildcard host (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) becomes the host of
    ``target`` (``host:port``; a Unix-socket target, ``unix:...``, means this host:
    ``127.0.0.1``); any other address is returned unchanged.
    """
    if not bound.startswith("tcp://"):
        return bound
    host, _, port = bound[len("tcp://"):].rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return bound
    if target.startswith("unix"):
        node_host = "127.0.0.1"
    else:
        node_host = target.rpartition(":")[0] if ":" in target else target
        node_host = node_host or "127.0.0.1"
    return f"tcp://{node_host}:{port}"


def discover_events(target: str, *, credentials: grpc.ChannelCredentials | None = None,
                    metadata: Sequence[tuple[str, str]] = (), timeout_s: float = 5.0,
                    token: str | None = None) -> EventStream | None:
    """Ask the node at ``target`` (``host:port``) where it publishes its events (its ``Capabilities``).

    Args:
        target: the node's gRPC address, as the client reaches it.
        credentials: TLS channel credentials, ``None`` for plaintext.
        metadata: call metadata (the bearer token's, ``kvstore.security.bearer_metadata``).
        timeout_s: the call's deadline, seconds.
        token: the bearer token (sent as ``metadata`` when that is empty); a node whose stream is
            authenticated is subscribed to with it.

    Returns:
        The stream, with addresses the client can connect to; ``None`` when the node publishes no events, or
        predates ``Capabilities`` (UNIMPLEMENTED).

    Raises:
        grpc.RpcError: when the call fails otherwise (the node is down: ask again later).
        EventStreamError: if the node's stream is authenticated and no ``token`` was given.
    """
    if token is not None and not metadata:
        from kvstore.security import bearer_metadata

        metadata = bearer_metadata(token)
    channel = grpc.secure_channel(target, credentials) if credentials is not None else grpc.insecure_channel(target)
    try:
        try:
            reply = pb_grpc.KVStoreStub(channel).Capabilities(pb.CapabilitiesRequest(), timeout=timeout_s,
                                                              metadata=tuple(metadata))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
    finally:
        channel.close()
    if not reply.HasField("events") or not reply.events.endpoint:
        return None
    offer = reply.events
    if offer.authenticated and token is None:
        from kvstore.events.subscriber import EventStreamError

        raise EventStreamError(f"the node at {target} sends its events only to subscribers with a bearer token: "
                               "pass token=")
    replay = reachable_address(offer.replay_endpoint, target) if offer.replay_endpoint else None
    return EventStream(reachable_address(offer.endpoint, target), replay, offer.topic,
                       token if offer.authenticated else None)
