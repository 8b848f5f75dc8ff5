"""The node's bulk listener: connections that redeem grants and move their blocks, in threads of their own.

Each connection is served by one thread, in blocking I/O: the bytes move in
``sendmsg`` and ``recv_into`` system calls with the GIL released, and the
store's event loop (which owns the leases, the pool and the index) is not
held up by any of it. A Get's blocks are sent straight from the leased views
(one ``sendmsg`` of them all; the lease is given back on the loop once the
kernel has them). A Put's blocks are received straight into the pool ranges
its ``BulkPut`` staged (or, without the shared pool, into memory allocated
block by block as they arrive), each checked as soon as it is whole, while
it is in cache; once every block arrived and passed, the store's put runs on
the loop (:attr:`PutGrant.commit`) and its reply goes back (a ``BulkPutResponse``
whose ``stored`` is the ``PutResponse``).

A request is a grant to redeem, or a ``BulkGet`` or ``BulkPut`` itself with
the caller's token (``kvstore.bulk.frames``): that call runs on the loop
through the node's service as gRPC's would, and its grant is redeemed at once.

Bounds. At most ``bulk.max_connections`` connections at once (one more is
closed at once: its client uses gRPC); a connection waits at most
``bulk.idle_s`` for its next request; a transfer has ``bulk.min_transfer_s + bytes /
bulk.min_bytes_per_s`` to end, so a peer that announces more than it sends, or
reads slowly, holds its grant's lease or room, and its thread, for a bounded
time; a Put holds at most the room its grant reserved under the grant budget.
A transfer cut short (the peer gone, a reset, the deadline) stores nothing
and ends the connection; the node goes on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

import grpc

from kvstore.bulk.frames import (GET, GRANT_BYTES, MAGIC, MAX_TOKEN_BYTES, PUT, REDEEM, REPLY, REQUEST, TransferCut,
                                 recv_exactly_into, send_all, transfer_s)
from kvstore.bulk.node.grants import GetGrant, GrantTable, PutGrant
from kvstore.config import BulkConfig
from kvstore.status import status_of
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

BODY_BUDGET_BYTES = 64 << 20
"""Bytes of request bodies (and tokens) the node receives at once over every bulk connection; past it, refused."""
HANDSHAKE_S = 5.0
"""Longest a TLS handshake may take, seconds."""
COMMIT_POLL_S = 1.0
"""How often a thread waiting for a Put's store step checks whether the node is closing, seconds."""

_OK = grpc.StatusCode.OK.value[0]


class _End(Exception):
    """The connection ends (its reply, if any, was sent)."""


class BulkListener:
    """One node's bulk listener (see the module docstring).

    Args:
        config: the ``bulk`` settings.
        host: the bind address.
        grants: the node's grant table.
        loop: the store's event loop (Put commits run there).
        ssl_context: a server-side TLS context, or ``None`` for plain TCP.
        count: ``(method, code, start_s)`` counts one transfer in the node's metrics (called on the loop).
        dispatch: ``(kind, token, body, peer) -> coroutine of (code, reply or details)``: runs a ``BulkGet`` or
            ``BulkPut`` that came on a connection (``kvstore.bulk.node.operations.BulkOperations.dispatch``).
        max_request_bytes: the longest request body, bytes (``server.max_message_bytes``, as gRPC's).

    Attributes:
        port: the bound port (after :meth:`start`).
        connections: connections open now.
        refused_connections, cut: connections refused past ``max_connections``; transfers cut short.
        refused_bodies: requests refused because the budget of request bodies was spent.
    """

    def __init__(self, config: BulkConfig, host: str, grants: GrantTable, loop: asyncio.AbstractEventLoop,
                 ssl_context: ssl.SSLContext | None = None,
                 count: Callable[[str, str, float], None] | None = None,
                 dispatch: Callable[[int, bytes, bytes, str], Any] | None = None,
                 max_request_bytes: int = 4 << 20) -> None:
        self.config = config
        self.host = host
        self.grants = grants
        self._loop = loop
        self._ssl = ssl_context
        self._count = count
        self.dispatch = dispatch
        self.max_request_bytes = max_request_bytes
        self._body_bytes = 0
        self.refused_bodies = 0
        self.port = 0
        self._sock: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        self.connections = 0
        self.refused_connections = 0
        self.cut = 0

    def start(self) -> None:
        """Bind and listen, then accept in a thread of its own.

        Raises:
            OSError: if the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.config.port))
            sock.listen(min(self.config.max_connections, socket.SOMAXCONN))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept, name="kvstore-bulk-accept", daemon=True)
        self._accepter.start()

    def close(self) -> None:
        """Stop accepting, cut every connection, and wait (briefly) for their threads."""
        self._closing = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            sock.close()
        with self._lock:
            open_now = list(self._open.items())
        for conn, _ in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in open_now:
            thread.join(timeout=COMMIT_POLL_S * 2)
        if self._accepter is not None:
            self._accepter.join(timeout=COMMIT_POLL_S * 2)

    def counters(self) -> dict[str, int]:
        """Connections and grants, since start (``kvstore stats`` and the metrics show them as ``bulk_*``)."""
        grants = self.grants
        return {"connections": self.connections, "connections_refused": self.refused_connections,
                "transfers_cut": self.cut, "grants_issued": grants.issued, "grants_redeemed": grants.redeemed,
                "grants_expired": grants.expired, "grants_refused": grants.refused,
                "grants_outstanding": len(grants), "grant_held_bytes": grants.budget.held_bytes,
                "grants_over_budget": grants.budget.refused, "requests_refused": self.refused_bodies}

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        sock = self._sock
        while not self._closing and sock is not None:
            try:
                conn, peer = sock.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.01)  # EMFILE and the like: the listener stays; the client retries or uses gRPC
                continue
            with self._lock:
                full = len(self._open) >= self.config.max_connections
                if not full:
                    thread = threading.Thread(target=self._serve, args=(conn, peer), name="kvstore-bulk",
                                              daemon=True)
                    self._open[conn] = thread
                    self.connections += 1
            if full:
                self.refused_connections += 1
                conn.close()
                continue
            thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        sock: socket.socket = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn.settimeout(HANDSHAKE_S)
                sock = self._ssl.wrap_socket(conn, server_side=True)
            while not self._closing:
                if not self._request(sock, f"bulk:{peer[0]}:{peer[1]}"):
                    return
        except _End:
            return
        except _Cut as cut:  # a request's body that did not arrive in time
            logger.info("bulk request from %s not received: %s", peer, cut.cut)
        except TransferCut as cut:
            self.cut += 1
            logger.info("bulk transfer with %s cut short: %s", peer, cut)
        except (OSError, ssl.SSLError) as exc:
            logger.debug("bulk connection with %s ended: %s", peer, exc)
        except Exception:  # noqa: BLE001 - a defect ends this connection alone; the node goes on
            logger.exception("bulk connection with %s failed", peer)
        finally:
            with self._lock:
                self._open.pop(conn, None)
                self.connections -= 1
            try:
                sock.close()
            except OSError:
                pass

    def _request(self, sock: socket.socket, peer: str) -> bool:
        """Serve one request; ``False`` when the client closed the connection between requests."""
        head = bytearray(REQUEST.size)
        try:
            recv_exactly_into(sock, memoryview(head), time.monotonic() + self.config.idle_s)
        except TransferCut as cut:
            if cut.done_bytes == 0:
                return False  # closed, or idle past bulk.idle_s, between requests
            raise
        magic, kind, token_bytes, body_bytes = REQUEST.unpack(head)
        if magic != MAGIC or kind not in (REDEEM, GET, PUT):
            self._refuse(sock, grpc.StatusCode.INVALID_ARGUMENT, "not a kvstore bulk request")
        if kind == REDEEM and (token_bytes or body_bytes != GRANT_BYTES):
            self._refuse(sock, grpc.StatusCode.INVALID_ARGUMENT, f"a grant is {GRANT_BYTES} bytes and no token")
        if token_bytes > MAX_TOKEN_BYTES or body_bytes > self.max_request_bytes:
            self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED, f"a request of {token_bytes} token bytes and "
                         f"{body_bytes} body bytes is over {MAX_TOKEN_BYTES} and {self.max_request_bytes}")
        token, body = self._body(sock, token_bytes, body_bytes)
        start_s = time.perf_counter()
        method = "BulkGetTransfer" if kind == GET else "BulkPutTransfer" if kind == PUT else "BulkTransfer"
        reply_body = b""
        if kind == REDEEM:
            grant = self.grants.redeem(body)
            if grant is None:
                self._refuse(sock, grpc.StatusCode.PERMISSION_DENIED, "the grant is unknown, used or expired")
        else:  # the call itself, on the loop, through the node's service; then its grant, redeemed here at once
            code, reply = self._call(kind, token, body, peer)
            if code is not grpc.StatusCode.OK:
                self._counted(method, code.name, start_s)
                self._refuse(sock, code, reply)
            grant = self.grants.redeem(reply.grant) if reply.grant else None
            reply.ClearField("grant")
            reply_body = reply.SerializeToString()
            if grant is None:  # nothing to move: an empty prefix, or no room (the client uses Get or Put)
                send_all(sock, [memoryview(REPLY.pack(MAGIC, _OK, len(reply_body), 0) + reply_body)],
                         time.monotonic() + self._transfer_s(0))
                if kind == PUT and reply.no_room:
                    raise _End()  # its blocks are on their way: the connection is out of step
                return True
        method = "BulkGetTransfer" if isinstance(grant, GetGrant) else "BulkPutTransfer"
        code_name = "CANCELLED"
        try:
            if isinstance(grant, GetGrant):
                self._send_get(sock, grant, reply_body)
            else:
                assert isinstance(grant, PutGrant)
                self._receive_put(sock, grant)
            code_name = "OK"
        except _Failed as failed:
            code_name = failed.code.name
            self._refuse(sock, failed.code, failed.message)
        finally:
            self.grants.finish(grant)
            self._counted(method, code_name, start_s)
        return True

    def _body(self, sock: socket.socket, token_bytes: int, body_bytes: int) -> tuple[bytes, bytes]:
        """A request's token and body, read as they arrive under the node's budget of bodies and a time bound.

        Raises:
            _End: (after its reply) if the budget has no room, or they do not arrive in time.
        """
        nbytes = token_bytes + body_bytes
        with self._lock:
            if self._body_bytes + nbytes > BODY_BUDGET_BYTES:
                full = True
            else:
                full = False
                self._body_bytes += nbytes
        if full:
            self.refused_bodies += 1
            self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the node is receiving {BODY_BUDGET_BYTES} bytes of bulk requests at once; send again")
        try:
            data = bytearray(nbytes)
            try:
                recv_exactly_into(sock, memoryview(data), time.monotonic() + self.config.min_transfer_s)
            except TransferCut as cut:
                raise _Cut(cut) from None
        finally:
            with self._lock:
                self._body_bytes -= nbytes
        return bytes(data[:token_bytes]), bytes(data[token_bytes:])

    def _call(self, kind: int, token: bytes, body: bytes, peer: str) -> tuple[grpc.StatusCode, Any]:
        """Run a ``BulkGet`` or ``BulkPut`` on the store's loop: ``(OK, reply)`` or ``(code, details)``."""
        assert self.dispatch is not None, "a listener serving calls needs dispatch"
        future = asyncio.run_coroutine_threadsafe(self.dispatch(kind, token, body, peer), self._loop)
        while True:
            try:
                return future.result(timeout=COMMIT_POLL_S)  # type: ignore[no-any-return]
            except TimeoutError:
                if self._closing:
                    future.cancel()
                    raise _End() from None

    def _send_get(self, sock: socket.socket, grant: GetGrant, body: bytes) -> None:
        """Send a leased prefix: the reply head, ``body``, and every block in one ``sendmsg`` (no copy of them)."""
        deadline = time.monotonic() + self._transfer_s(grant.nbytes)
        buffers = [memoryview(REPLY.pack(MAGIC, _OK, len(body), grant.nbytes) + body)]
        buffers.extend(memoryview(block).cast("B") for block in grant.blocks)
        send_all(sock, buffers, deadline)

    def _receive_put(self, sock: socket.socket, grant: PutGrant) -> None:
        """Receive a Put's blocks straight into their room, check each, store them, reply.

        Raises:
            TransferCut: if the blocks do not all arrive in time (nothing is stored).
            _Failed: if a block fails its check, or the store's put fails (nothing is stored).
        """
        deadline = time.monotonic() + self._transfer_s(grant.nbytes)
        blocks: list[Any] = []
        for position, nbytes in enumerate(grant.sizes):
            if grant.targets is not None:
                target, block = memoryview(grant.targets[position]).cast("B"), grant.blocks[position]  # type: ignore[index]
            else:  # the node's own memory, taken as the blocks arrive (never all at once from what was announced)
                owned = bytearray(nbytes)
                target, block = memoryview(owned), memoryview(owned).toreadonly()
            recv_exactly_into(sock, target, deadline)
            try:
                grant.check(position, block)
            except Exception as exc:  # noqa: BLE001 - a bad block ends the Put with its status
                raise _Failed.of(exc) from None
            blocks.append(block)
        future = asyncio.run_coroutine_threadsafe(grant.commit(blocks), self._loop)
        while True:
            try:
                reply = future.result(timeout=COMMIT_POLL_S)
                break
            except TimeoutError:
                if self._closing:
                    future.cancel()
                    raise _End() from None
            except Exception as exc:  # noqa: BLE001 - the store's refusal (quota, full) is the Put's status
                raise _Failed.of(exc) from None
        body = pb.BulkPutResponse(stored=reply).SerializeToString()
        send_all(sock, [memoryview(REPLY.pack(MAGIC, _OK, len(body), 0) + body)],
                 time.monotonic() + self._transfer_s(0))

    def _transfer_s(self, nbytes: int) -> float:
        return transfer_s(nbytes, self.config.min_bytes_per_s, self.config.min_transfer_s)

    def _refuse(self, sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        """Send a status other than OK, then end the connection.

        Raises:
            _End: always.
        """
        body = message.encode()[:4096]
        try:
            send_all(sock, [memoryview(REPLY.pack(MAGIC, code.value[0], len(body), 0) + body)],
                     time.monotonic() + self._transfer_s(0))
        except TransferCut:
            pass
        raise _End()

    def _counted(self, method: str, code: str, start_s: float) -> None:
        if self._count is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._count, method, code, start_s)
        except RuntimeError:
            pass


class _Cut(Exception):
    """A request's token and body did not arrive whole in time."""

    def __init__(self, cut: TransferCut) -> None:
        super().__init__(str(cut))
        self.cut = cut


class _Failed(Exception):
    """A transfer's status other than OK, to send before the connection ends."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, exc: BaseException) -> _Failed:
        """The status of a raised error (``kvstore.status.status_of``)."""
        code, message = status_of(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("bulk Put failed", exc_info=exc)
        return cls(code, message)
