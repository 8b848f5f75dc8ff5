"""The node's bulk listener: connections that carry ``BulkGet`` and ``BulkPut`` calls (or redeem grants) and their bytes.

A plain TCP connection is served on the store's event loop, so a call that
came on it runs at once, with no hand-off between threads: a small transfer
(under :data:`INLINE_BYTES`) moves there too, one ``sendmsg`` of the leased
blocks or ``recv_into`` per block; a larger one moves in a worker thread in
blocking I/O (the bytes in ``sendmsg`` and ``recv_into`` system calls with the
GIL released), so the loop is not held up by it. A TLS connection is served in
a thread of its own (Python's TLS has no non-blocking ``recv_into`` on the
loop), whose calls run on the store's loop. Either way a Get's blocks are sent
straight from the leased views (the lease is given back once the kernel has
them), and a Put's blocks are received straight into the pool ranges its
``BulkPut`` staged (or, without the shared pool, into memory allocated block
by block as they arrive), each checked as soon as it is whole, while it is in
cache; once every block arrived and passed, the store's put runs on the loop
(:attr:`PutGrant.commit`) and its reply goes back (a ``BulkPutResponse``
whose ``stored`` is the ``PutResponse``).

Bounds. At most ``bulk.max_connections`` connections at once (one more is
closed at once: its client uses gRPC); a connection waits at most
``bulk.idle_s`` for its next request; a request's token and body are read as
they arrive, under a node-wide budget (:data:`BODY_BUDGET_BYTES`) and within
``bulk.min_transfer_s``; a transfer has ``bulk.min_transfer_s + bytes /
bulk.min_bytes_per_s`` to end, so a peer that announces more than it sends, or
reads slowly, holds its grant's lease or room for a bounded time; a Put holds
at most the room its grant reserved under the grant budget. A transfer cut
short (the peer gone, a reset, the deadline) stores nothing and ends the
connection; the node goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable, Coroutine

import grpc

from kvstore.bulk.frames import (GET, GRANT_BYTES, MAGIC, MAX_TOKEN_BYTES, PUT, REDEEM, REPLY, REQUEST, TransferCut,
                                 recv_exactly_into, send_all, transfer_s)
from kvstore.bulk.node.grants import GetGrant, Grant, GrantTable, PutGrant
from kvstore.config import BulkConfig
from kvstore.error_codes import status_of
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

INLINE_BYTES = 4 << 20
"""A transfer under this many bytes moves on the loop; a larger one in a worker thread, bytes."""
BODY_BUDGET_BYTES = 64 << 20
"""Bytes of request bodies (and tokens) the node receives at once over every bulk connection; past it, refused."""
HANDSHAKE_S = 5.0
"""Longest a TLS handshake may take, seconds."""

_OK = grpc.StatusCode.OK.value[0]

Dispatch = Callable[[int, bytes, bytes, str], Coroutine[Any, Any, tuple[grpc.StatusCode, Any, "Grant | None"]]]
"""``(kind, token, body, peer) -> (code, reply or details, grant)``: a call that came on a connection, run on the
loop, with what it granted to transfer now."""


class _Refusal(Exception):
    """The connection ends with this status (other than OK), sent first."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, exc: BaseException) -> _Refusal:
        """The status of a raised error (``kvstore.error_codes.status_of``)."""
        code, message = status_of(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("bulk Put failed", exc_info=exc)
        return cls(code, message)

    def frame(self) -> bytes:
        """The reply that carries it."""
        body = self.message.encode()[:4096]
        return REPLY.pack(MAGIC, self.code.value[0], len(body), 0) + body


class _Close(Exception):
    """The connection ends now (its reply, if any, was sent)."""


class BulkListener:
    """One node's bulk listener (see the module docstring).

    Args:
        config: the ``bulk`` settings.
        host: the bind address.
        grants: the node's grant table.
        loop: the store's event loop.
        ssl_context: a server-side TLS context, or ``None`` for plain TCP.
        count: ``(method, code, start_s)`` counts one transfer in the node's metrics (called on the loop).
        dispatch: runs a ``BulkGet`` or ``BulkPut`` that came on a connection (see :data:`Dispatch`;
            ``kvstore.bulk.node.operations.BulkOperations.dispatch``).
        max_request_bytes: the longest request body, bytes (``server.max_message_bytes``, as gRPC's).

    Attributes:
        port: the bound port (after :meth:`start`).
        connections: connections open now.
        refused_connections, cut: connections refused past ``max_connections``; transfers cut short.
        refused_bodies: requests refused because the budget of request bodies was spent.
    """

    def __init__(self, config: BulkConfig, host: str, grants: GrantTable, loop: asyncio.AbstractEventLoop,
                 ssl_context: ssl.SSLContext | None = None,
                 count: Callable[[str, str, float], None] | None = None, dispatch: Dispatch | None = None,
                 max_request_bytes: int = 4 << 20) -> None:
        self.config = config
        self.host = host
        self.grants = grants
        self._loop = loop
        self._ssl = ssl_context
        self._count = count
        self.dispatch = dispatch
        self.max_request_bytes = max_request_bytes
        self.port = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._threads: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        self._body_bytes = 0
        self.connections = 0
        self.refused_connections = 0
        self.cut = 0
        self.refused_bodies = 0

    def start(self) -> None:
        """Bind and listen, then accept on the loop (call it on the loop).

        Raises:
            OSError: if the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.config.port))
            sock.listen(min(self.config.max_connections, socket.SOMAXCONN))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accepting = self._loop.create_task(self._accept(sock), name="kvstore-bulk-accept")

    async def close(self) -> None:
        """Stop accepting, cut every connection, and wait (briefly) for them to end (on the loop)."""
        self._closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._lock:
            threads = list(self._threads.items())
        for conn, _ in threads:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in threads:
            await asyncio.to_thread(thread.join, 2.0)

    def counters(self) -> dict[str, int]:
        """Connections and grants, since start (the metrics show them as ``kvstore_bulk_*``)."""
        grants = self.grants
        return {"connections": self.connections, "connections_refused": self.refused_connections,
                "transfers_cut": self.cut, "grants_issued": grants.issued, "grants_redeemed": grants.redeemed,
                "grants_expired": grants.expired, "grants_refused": grants.refused,
                "grants_outstanding": len(grants), "grant_held_bytes": grants.budget.held_bytes,
                "grants_over_budget": grants.budget.refused, "requests_refused": self.refused_bodies}

    # ------------------------------------------------------------------ connections

    async def _accept(self, sock: socket.socket) -> None:
        loop = self._loop
        while not self._closing:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError:  # EMFILE and the like: the listener stays; the client retries or uses gRPC
                await asyncio.sleep(0.01)
                continue
            with self._lock:
                full = self.connections >= self.config.max_connections
                if not full:
                    self.connections += 1
            if full:
                self.refused_connections += 1
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = f"bulk:{peer[0]}:{peer[1]}"
            if self._ssl is None:
                conn.setblocking(False)
                task = loop.create_task(self._serve(_LoopConnection(self, conn), name), name="kvstore-bulk")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                continue
            thread = threading.Thread(target=self._serve_tls, args=(conn, name), name="kvstore-bulk-tls", daemon=True)
            with self._lock:
                self._threads[conn] = thread
            thread.start()

    def _serve_tls(self, conn: socket.socket, name: str) -> None:
        """Serve one TLS connection in this thread, on a loop of its own (its calls run on the store's loop)."""
        try:
            conn.settimeout(HANDSHAKE_S)
            assert self._ssl is not None
            sock = self._ssl.wrap_socket(conn, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            logger.info("bulk TLS handshake with %s failed: %s", name, exc)
            with self._lock:
                self._threads.pop(conn, None)
                self.connections -= 1
            conn.close()
            return
        try:
            asyncio.run(self._serve(_ThreadConnection(self, sock), name))
        finally:
            with self._lock:
                self._threads.pop(conn, None)

    async def _serve(self, conn: _Connection, name: str) -> None:
        """Serve one connection's requests until it ends (see the module docstring)."""
        try:
            while not self._closing:
                if not await self._request(conn, name):
                    return
        except _Refusal as refusal:
            with contextlib.suppress(TransferCut):
                await conn.send([memoryview(refusal.frame())], time.monotonic() + self._transfer_s(0))
        except _Close:
            pass
        except TransferCut as cut:
            self.cut += 1
            logger.info("bulk transfer with %s cut short: %s", name, cut)
        except (OSError, ssl.SSLError) as exc:
            logger.debug("bulk connection with %s ended: %s", name, exc)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        except Exception:  # noqa: BLE001 - a defect ends this connection alone; the node goes on
            logger.exception("bulk connection with %s failed", name)
        finally:
            with self._lock:
                self.connections -= 1
            conn.close()

    async def _request(self, conn: _Connection, name: str) -> bool:
        """Serve one request; ``False`` when the client closed the connection between requests."""
        head = bytearray(REQUEST.size)
        try:
            await conn.recv_into(memoryview(head), time.monotonic() + self.config.idle_s)
        except TransferCut as cut:
            if cut.done_bytes == 0:
                return False  # closed, or idle past bulk.idle_s, between requests
            raise
        magic, kind, token_bytes, body_bytes = REQUEST.unpack(head)
        if magic != MAGIC or kind not in (REDEEM, GET, PUT):
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "not a kvstore bulk request")
        if kind == REDEEM and (token_bytes or body_bytes != GRANT_BYTES):
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"a grant is {GRANT_BYTES} bytes and no token")
        if token_bytes > MAX_TOKEN_BYTES or body_bytes > self.max_request_bytes:
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a request of {token_bytes} token bytes and "
                           f"{body_bytes} body bytes is over {MAX_TOKEN_BYTES} and {self.max_request_bytes}")
        token, body = await self._body(conn, token_bytes, body_bytes)
        start_s = time.perf_counter()
        reply_body = b""
        if kind == REDEEM:
            grant = self.grants.redeem(body)
            if grant is None:
                raise _Refusal(grpc.StatusCode.PERMISSION_DENIED, "the grant is unknown, used or expired")
        else:  # the call itself, on the store's loop, through the node's service; then its grant, redeemed at once
            assert self.dispatch is not None, "a listener serving calls needs dispatch"
            code, reply, grant = await conn.on_store(self.dispatch(kind, token, body, name))
            if code is not grpc.StatusCode.OK:
                raise _Refusal(code, reply)
            reply_body = reply.SerializeToString()
            if grant is None:  # nothing to move: an empty prefix, or no room (the client uses Get or Put)
                await conn.send([memoryview(REPLY.pack(MAGIC, _OK, len(reply_body), 0) + reply_body)],
                                time.monotonic() + self._transfer_s(0))
                if kind == PUT and reply.no_room:
                    raise _Close()  # its blocks are on their way: the connection is out of step
                return True
        method = "BulkGetTransfer" if isinstance(grant, GetGrant) else "BulkPutTransfer"
        code_name = "CANCELLED"
        try:
            if isinstance(grant, GetGrant):
                await self._send_get(conn, grant, reply_body)
            else:
                assert isinstance(grant, PutGrant)
                await self._receive_put(conn, grant)
            code_name = "OK"
        except _Refusal as refusal:
            code_name = refusal.code.name
            raise
        finally:
            conn.finish(grant)
            conn.count(method, code_name, start_s)
        return True

    async def _body(self, conn: _Connection, token_bytes: int, body_bytes: int) -> tuple[bytes, bytes]:
        """A request's token and body, read as they arrive under the node's budget of bodies and a time bound.

        Raises:
            _Refusal: if the budget has no room.
            _Close: if they do not arrive in time.
        """
        nbytes = token_bytes + body_bytes
        if not nbytes:
            return b"", b""
        with self._lock:
            full = self._body_bytes + nbytes > BODY_BUDGET_BYTES
            if not full:
                self._body_bytes += nbytes
        if full:
            self.refused_bodies += 1
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the node is receiving {BODY_BUDGET_BYTES} bytes of bulk requests at once; send again")
        try:
            data = bytearray(nbytes)
            try:
                await conn.recv_into(memoryview(data), time.monotonic() + self.config.min_transfer_s)
            except TransferCut as cut:
                logger.info("bulk request not received: %s", cut)
                raise _Close() from None
        finally:
            with self._lock:
                self._body_bytes -= nbytes
        return bytes(data[:token_bytes]), bytes(data[token_bytes:])

    async def _send_get(self, conn: _Connection, grant: GetGrant, body: bytes) -> None:
        """Send a leased prefix: the reply head, ``body``, and every block (one ``sendmsg``, no copy of them)."""
        buffers = [memoryview(REPLY.pack(MAGIC, _OK, len(body), grant.nbytes) + body)]
        buffers.extend(memoryview(block).cast("B") for block in grant.blocks)
        await conn.send(buffers, time.monotonic() + self._transfer_s(grant.nbytes))

    async def _receive_put(self, conn: _Connection, grant: PutGrant) -> None:
        """Receive a Put's blocks straight into their room, check each, store them, reply.

        Raises:
            TransferCut: if the blocks do not all arrive in time (nothing is stored).
            _Refusal: if a block fails its check, or the store's put fails (nothing is stored).
        """
        deadline = time.monotonic() + self._transfer_s(grant.nbytes)
        if grant.nbytes >= INLINE_BYTES:
            blocks = await conn.blocking(_receive_blocks, grant, deadline)
        else:
            blocks = []
            for position in range(len(grant.sizes)):
                target, block = _landing(grant, position)
                await conn.recv_into(target, deadline)
                _check(grant, position, block)
                blocks.append(block)
        try:
            reply = await conn.on_store(grant.commit(blocks))
        except Exception as exc:  # noqa: BLE001 - the store's refusal (quota, full) is the Put's status
            raise _Refusal.of(exc) from None
        body = pb.BulkPutResponse(stored=reply).SerializeToString()
        await conn.send([memoryview(REPLY.pack(MAGIC, _OK, len(body), 0) + body)],
                        time.monotonic() + self._transfer_s(0))

    def _transfer_s(self, nbytes: int) -> float:
        return transfer_s(nbytes, self.config.min_bytes_per_s, self.config.min_transfer_s)


class _Connection:
    """One connection's I/O, as the request handling needs it (:class:`_LoopConnection`, :class:`_ThreadConnection`)."""

    def __init__(self, listener: BulkListener, sock: socket.socket) -> None:
        self.listener = listener
        self.sock = sock

    async def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` by ``deadline`` (:class:`TransferCut` if not)."""
        raise NotImplementedError

    async def send(self, buffers: list[memoryview], deadline: float) -> None:
        """Send every buffer by ``deadline`` (:class:`TransferCut` if not)."""
        raise NotImplementedError

    async def blocking(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(sock, *args)`` in blocking I/O, off the store's loop."""
        raise NotImplementedError

    async def on_store(self, call: Coroutine[Any, Any, Any]) -> Any:
        """``call`` run on the store's loop; its result."""
        raise NotImplementedError

    def finish(self, grant: Grant) -> None:
        """Give back what a redeemed grant holds, on the store's loop."""
        raise NotImplementedError

    def count(self, method: str, code: str, start_s: float) -> None:
        """Count one transfer in the node's metrics, on the store's loop."""
        raise NotImplementedError

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _LoopConnection(_Connection):
    """A plain TCP connection served on the store's loop; transfers of :data:`INLINE_BYTES` or more in a thread."""

    async def recv_into(self, view: memoryview, deadline: float) -> None:
        loop, got, nbytes = self.listener._loop, 0, view.nbytes
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                while got < nbytes:
                    n = await loop.sock_recv_into(self.sock, view[got:] if got else view)
                    if n == 0:
                        raise TransferCut(f"the peer closed the connection after {got} of {nbytes} bytes", got)
                    got += n
        except TimeoutError:
            raise TransferCut(f"{got} of {nbytes} bytes arrived in time", got) from None
        except OSError as exc:
            raise TransferCut(f"the connection failed after {got} of {nbytes} bytes: {exc}", got) from None

    async def send(self, buffers: list[memoryview], deadline: float) -> None:
        if sum(b.nbytes for b in buffers) >= INLINE_BYTES:
            await self.blocking(send_all, buffers, deadline)
            return
        loop = self.listener._loop
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                for buffer in buffers:
                    await loop.sock_sendall(self.sock, buffer)
        except TimeoutError:
            raise TransferCut("the reply was not sent before the deadline", 0) from None
        except OSError as exc:
            raise TransferCut(f"the connection failed while sending: {exc}", 0) from None

    async def blocking(self, work: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(work, self.sock, *args)
        finally:
            self.sock.setblocking(False)  # the loop's again

    async def on_store(self, call: Coroutine[Any, Any, Any]) -> Any:
        return await call

    def finish(self, grant: Grant) -> None:
        grant.finish()

    def count(self, method: str, code: str, start_s: float) -> None:
        if self.listener._count is not None:
            self.listener._count(method, code, start_s)


class _ThreadConnection(_Connection):
    """A TLS connection served in a thread of its own, on a loop of its own, in blocking I/O."""

    async def recv_into(self, view: memoryview, deadline: float) -> None:
        recv_exactly_into(self.sock, view, deadline)

    async def send(self, buffers: list[memoryview], deadline: float) -> None:
        send_all(self.sock, buffers, deadline)

    async def blocking(self, work: Callable[..., Any], *args: Any) -> Any:
        return work(self.sock, *args)

    async def on_store(self, call: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self.listener._loop))

    def finish(self, grant: Grant) -> None:
        self.listener.grants.finish(grant)

    def count(self, method: str, code: str, start_s: float) -> None:
        listener = self.listener
        if listener._count is not None and not listener._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                listener._loop.call_soon_threadsafe(listener._count, method, code, start_s)


def _landing(grant: PutGrant, position: int) -> tuple[memoryview, Any]:
    """Where block ``position`` of a Put is received (writable) and what the store is given (read-only): a staged
    range of the pool, or memory of the node's own taken now (never all at once from what was announced)."""
    targets, blocks = grant.targets, grant.blocks
    if targets is not None and blocks is not None:  # staged: the two are set together (``PutGrant``)
        return memoryview(targets[position]).cast("B"), blocks[position]
    owned = bytearray(grant.sizes[position])
    return memoryview(owned), memoryview(owned).toreadonly()


def _check(grant: PutGrant, position: int, block: Any) -> None:
    try:
        grant.check(position, block)
    except Exception as exc:  # noqa: BLE001 - a bad block ends the Put with its status
        raise _Refusal.of(exc) from None


def _receive_blocks(sock: socket.socket, grant: PutGrant, deadline: float) -> list[Any]:
    """Receive and check a Put's blocks in blocking I/O (a worker thread, or a TLS connection's)."""
    blocks = []
    for position in range(len(grant.sizes)):
        target, block = _landing(grant, position)
        recv_exactly_into(sock, target, deadline)
        _check(grant, position, block)
        blocks.append(block)
    return blocks
