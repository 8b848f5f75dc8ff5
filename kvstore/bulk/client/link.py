"""The client's side of one node's bulk path: whether the node offers it, and a pool of connections to it.

A :class:`BulkLink` per node asks the node once for its ``Capabilities``
(on a gRPC channel of its own, with the client's credentials and token): a
node that offers a bulk listener names its port (and host, or the host the
client reached gRPC at). Connections are then opened as calls need them and
kept for the next call (a few per node, idle ones reused last in, first out,
for up to :data:`MAX_IDLE_S`);
one that failed, or whose transfer was cut, is closed instead. A node that
does not offer the path, or cannot be reached on it, leaves the link off
(logged once), and its calls use Get and Put, with no error; a link that
failed to connect tries again after a pause that doubles up to a minute.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import threading
import time
from typing import Any, NamedTuple, Sequence

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

CAPABILITIES_TIMEOUT_S = 5.0
"""Longest the ``Capabilities`` call of a link may take, seconds."""
CONNECT_TIMEOUT_S = 2.0
"""Longest a connection to the bulk listener may take to open (and its TLS handshake), seconds."""
RETRY_S = (1.0, 60.0)
"""First and longest pause before a link that failed tries again, seconds (doubling)."""
MAX_IDLE_CONNECTIONS = 8
"""Idle connections kept per node for the next calls."""
MAX_IDLE_S = 20.0
"""An idle connection older than this is closed, not reused, seconds: well before the node closes it
(``bulk.idle_s``, 60 s by default), so a call never finds it closed."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer asked of each connection's socket, bytes (fewer wake-ups per transfer)."""


class Endpoint(NamedTuple):
    """Where a node's bulk listener is: the host and port to connect to, and whether it speaks TLS."""

    host: str
    port: int
    tls: bool


def target_host(target: str) -> str | None:
    """The host part of a gRPC target (``host:port``, ``[v6]:port``, ``dns:///host:port``); ``None`` for a Unix one."""
    if target.startswith("unix:") or target.startswith("unix-abstract:"):
        return None
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    if target.startswith("["):
        return target[1:target.index("]")] if "]" in target else None
    host, _, port = target.rpartition(":")
    return host if host and port.isdigit() else target


class BulkLink:
    """One node's bulk path as this client sees it: off, or an :class:`Endpoint` and a pool of connections.

    Thread-safe; a forked child starts afresh (it never uses its parent's connections).

    Args:
        target: the node's gRPC target.
        credentials: TLS channel credentials, as the client's (for ``Capabilities``); ``None`` for plaintext.
        metadata: call metadata (the bearer token), as the client's.
        options: gRPC channel options, as the client's.
        ssl_context: the client's TLS context for a node whose listener speaks TLS; ``None``: such a node's
            bulk path stays off here (its calls use Get and Put).

    Attributes:
        reason: why the link is off, ``""`` while it is on or not tried.
    """

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str | bytes]] = (), options: Sequence[tuple[str, Any]] = (),
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.target = target
        self._credentials = credentials
        self._metadata = tuple(metadata)
        self._options = list(options)
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._endpoint: Endpoint | None = None
        self._idle: list[tuple[socket.socket, float]] = []  # idle connections and when each was given back
        self._retry_at = 0.0
        self._retry_s = RETRY_S[0]
        self._pid = os.getpid()
        self._closed = False
        self.reason = ""

    def current(self) -> Endpoint | None:
        """The node's bulk endpoint if the link is on now (no I/O)."""
        if self._pid != os.getpid() or self._closed:
            return None
        return self._endpoint

    def settled(self) -> bool:
        """Whether :meth:`ensure` would answer without I/O (on, or off until a later retry)."""
        return self.current() is not None or self._closed or time.monotonic() < self._retry_at

    def ensure(self, timeout_s: float = CAPABILITIES_TIMEOUT_S) -> Endpoint | None:
        """The node's bulk endpoint, asking the node first if it is time to; ``None``: use Get and Put (blocking).

        Args:
            timeout_s: the longest the asking may take (at most :data:`CAPABILITIES_TIMEOUT_S`), seconds.
        """
        endpoint = self.current()
        if endpoint is not None:
            return endpoint
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._endpoint, self._idle, self._retry_at = os.getpid(), None, [], 0.0
            if self._endpoint is not None or self._closed or time.monotonic() < self._retry_at:
                return self.current()
            try:
                self._endpoint = self._ask(min(CAPABILITIES_TIMEOUT_S, timeout_s))
            except _Off as off:
                self._off(str(off), permanent=off.permanent)
                return None
            except (grpc.RpcError, OSError, TimeoutError) as exc:
                self._off(f"Capabilities failed: {exc}", permanent=False)
                return None
            if self.reason:
                logger.info("kvstore node %s: bulk path on again (%s:%d)", self.target, *self._endpoint[:2])
            self.reason = ""
            self._retry_s = RETRY_S[0]
            return self._endpoint

    def _ask(self, timeout_s: float) -> Endpoint:
        if self._credentials is not None:
            channel = grpc.secure_channel(self.target, self._credentials, options=self._options)
        else:
            channel = grpc.insecure_channel(self.target, options=self._options)
        try:
            try:
                reply = pb_grpc.KVStoreStub(channel).Capabilities(pb.CapabilitiesRequest(), timeout=max(0.01, timeout_s),
                                                                  metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise _Off("the node predates the bulk path", permanent=True) from None
                raise
        finally:
            channel.close()
        if not reply.HasField("bulk") or not reply.bulk.port:
            raise _Off("the node offers none", permanent=True)
        offer = reply.bulk
        if offer.tls and self._ssl is None:
            raise _Off("the node's bulk listener speaks TLS and this client has no bulk_ssl_context", permanent=True)
        host = offer.host if offer.host and offer.host not in ("0.0.0.0", "::", "*") else target_host(self.target)
        if not host:
            raise _Off("the node was reached over a Unix socket and names no bulk host", permanent=True)
        return Endpoint(host, int(offer.port), bool(offer.tls))

    def _off(self, reason: str, *, permanent: bool) -> None:
        if reason != self.reason:
            logger.info("kvstore node %s: no bulk path (%s); blocks go over gRPC", self.target, reason)
        self.reason = reason
        self._endpoint = None
        self._retry_at = math.inf if permanent else time.monotonic() + self._retry_s
        self._retry_s = min(RETRY_S[1], self._retry_s * 2)

    def failed(self, reason: str) -> None:
        """A connection to the node's listener could not be opened: off until a later retry (its calls use gRPC)."""
        with self._lock:
            self._off(reason, permanent=False)
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            _close(sock)

    # ------------------------------------------------------------------ connections

    def connection(self, endpoint: Endpoint, timeout_s: float) -> tuple[socket.socket, bool]:
        """A connection to ``endpoint``: an idle one, else a new one; and whether it is new.

        Raises:
            OSError: if a new connection cannot be opened within ``timeout_s`` (at most
                :data:`CONNECT_TIMEOUT_S`), or its TLS handshake fails.
        """
        stale: list[socket.socket] = []
        with self._lock:
            now = time.monotonic()
            while self._pid == os.getpid() and self._idle:
                sock, since = self._idle.pop()
                if now - since < MAX_IDLE_S:
                    for old in stale:
                        _close(old)
                    return sock, False
                stale.append(sock)
        for old in stale:
            _close(old)
        sock = socket.create_connection((endpoint.host, endpoint.port),
                                        timeout=max(0.01, min(CONNECT_TIMEOUT_S, timeout_s)))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            if endpoint.tls:
                assert self._ssl is not None
                sock = self._ssl.wrap_socket(sock, server_hostname=endpoint.host)
        except BaseException:
            _close(sock)
            raise
        return sock, True

    def give_back(self, sock: socket.socket) -> None:
        """Keep a connection whose last transfer ended cleanly, for the next call (or close it past the pool)."""
        with self._lock:
            if not self._closed and self._pid == os.getpid() and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append((sock, time.monotonic()))
                return
        _close(sock)

    def close(self) -> None:
        """Close the idle connections; the link is off from now on. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            _close(sock)  # in a forked child, its copy only: no shutdown, the parent's connection goes on


class _Off(Exception):
    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.permanent = permanent


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
