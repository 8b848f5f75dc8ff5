"""gRPC channels of a client: one :class:`TargetChannel` per node, its options, and the client's node targets."""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.wire import GET_METHOD, PUT_METHOD, channel_options, identity, sync_client_channel_options
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
RECONNECT_BACKOFF_MS = (100, 2000)
"""First and largest pause between reconnection attempts of a channel, milliseconds."""
CONNECT_TIMEOUT_MS = 1000
"""Shortest time one connection attempt may take (gRPC's ``min_reconnect_backoff_ms``), milliseconds."""
FALSE_WORDS = ("0", "false", "no", "off")
"""Values of an environment switch (``GRPC_ENABLE_FORK_SUPPORT``, ``KVSTORE_SHARED_MEMORY``) that turn it off."""


class TargetChannel:
    """The gRPC channel to one target and its stubs, reopened lazily in a forked child.

    One instance per server address; a client of several nodes keeps one each.

    Args:
        target: ``host:port`` (any gRPC target string, e.g. ``unix:/path``).
        aio: open a ``grpc.aio`` channel (for :class:`AsyncKVStoreClient`).
        max_message_bytes: largest message sent or received, bytes (match the server's).
        credentials: channel credentials for TLS; ``None`` for plaintext.
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        aio: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.aio = aio
        self.max_message_bytes = max_message_bytes
        self._credentials = credentials
        self._options = [
            *(channel_options(max_message_bytes) if aio else sync_client_channel_options(max_message_bytes)),
            ("grpc.use_local_subchannel_pool", 1),  # a child's channel must not reuse the parent's connections
            # reconnect soon after a node restarts (gRPC's default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
            *options,
        ]
        self._pid = -1
        self._channel: Any = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._get: Any = None
        self._put: Any = None
        self._orphans: list[Any] = []  # parents' channels, kept alive and untouched in a forked child
        self._closed = False

    def _open(self) -> None:
        pid = os.getpid()
        if self._channel is not None:
            fork_support = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
            if fork_support is not None and fork_support.strip().lower() in FALSE_WORDS:
                raise UnavailableError(
                    f"this kvstore client was opened in process {self._pid} and cannot be used in forked "
                    f"child {pid} because GRPC_ENABLE_FORK_SUPPORT is off; open a new client in the child"
                )
            logger.debug("process %s forked from %s: opening a fresh channel to %s", pid, self._pid, self.target)
            self._orphans.append(self._channel)
        grpc_mod: Any = grpc.aio if self.aio else grpc
        if self._credentials is not None:
            channel = grpc_mod.secure_channel(self.target, self._credentials, options=self._options)
        else:
            channel = grpc_mod.insecure_channel(self.target, options=self._options)
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        # the data path: block bytes are (de)serialized by kvstore.wire, not copied through protobuf
        self._get = channel.unary_stream(GET_METHOD, request_serializer=identity, response_deserializer=identity)
        self._put = channel.stream_unary(PUT_METHOD, request_serializer=identity,
                                         response_deserializer=pb.PutResponse.FromString)
        self._pid = pid

    def _check(self) -> None:
        if self._closed:
            raise UnavailableError(f"the client of {self.target} is closed")
        if self._pid != os.getpid():
            self._open()

    @property
    def stub(self) -> pb_grpc.KVStoreStub:
        """The ``kvstore.v1.KVStore`` stub of this process's channel.

        Raises:
            UnavailableError: if the client is closed, or used in a forked child
                with gRPC fork support turned off.
        """
        self._check()
        assert self._stub is not None
        return self._stub

    @property
    def get_call(self) -> Any:
        """The Get multicallable of the data path: serialized ``GetRequest`` in, serialized ``BlockChunk`` s out."""
        self._check()
        return self._get

    @property
    def put_call(self) -> Any:
        """The Put multicallable of the data path: serialized ``PutRequest`` s in, ``PutResponse`` out."""
        self._check()
        return self._put

    @property
    def health_stub(self) -> health_pb2_grpc.HealthStub:
        """The ``grpc.health.v1.Health`` stub of this process's channel (same errors as :attr:`stub`)."""
        self._check()
        assert self._health is not None
        return self._health

    def close(self) -> None:
        """Close a synchronous channel opened by this process; idempotent."""
        self._closed = True
        if self._channel is not None and self._pid == os.getpid() and not self.aio:
            self._channel.close()
        self._channel = None

    async def aclose(self) -> None:
        """Close an asyncio channel opened by this process; idempotent."""
        self._closed = True
        if self._channel is not None and self._pid == os.getpid():
            await self._channel.close()
        self._channel = None


def resolve_targets(target: str | Sequence[str] | None, targets: Sequence[str] | None) -> tuple[str, ...]:
    """The node targets of a client from its ``target`` and ``targets`` arguments, duplicates dropped.

    Args:
        target: one ``host:port``, or a sequence of them.
        targets: a sequence of ``host:port`` (give this or ``target``, not both).

    Returns:
        The targets in the order given, each once (a node listed twice is one node).

    Raises:
        InvalidArgumentError: if both or neither are given, or no target, or an empty one.
    """
    if (target is None) == (targets is None):
        raise InvalidArgumentError("give either target or targets")
    given = target if target is not None else targets
    listed = [given] if isinstance(given, str) else list(given or ())
    if not listed or not all(isinstance(t, str) and t for t in listed):
        raise InvalidArgumentError(f"targets must be non-empty host:port strings, got {given!r}")
    return tuple(dict.fromkeys(listed))
