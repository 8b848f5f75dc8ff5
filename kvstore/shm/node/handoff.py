"""The node's side of the handoff (``kvstore.shm.handoff``): the Unix socket where grants are redeemed.

Any local process that can reach the socket can connect, token or not, so a
connection costs the node next to nothing until it has sent a well-formed
request: the node accepts every connection at once (its listen backlog never
fills), reads at most one request of a known, small length from it, and keeps
at most :data:`MAX_PENDING` connections waiting for their request. A new
connection beyond that closes the one that has waited longest, and a
connection silent for :data:`REQUEST_TIMEOUT_S` is closed. An honest client
sends its request the moment it connects, so a flood of idle connections
delays it by a few loop turns at most; one that was closed before it was read
connects again (``kvstore.shm.client.handoff``): its grant is still good.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections import OrderedDict
from typing import Callable

from kvstore.shm.handoff import (MAGIC, MAX_CHANNELS, NOT_A_HANDOFF, REQUEST_BYTES, VERSION, VERSION_CHANNELS,
                                 pack_granted, pack_refusal)
from kvstore.shm.segment import SegmentError
from kvstore.unix_sockets import ABSTRACT_PREFIX, SOCKET_MODE, claim_socket_path, remove_socket_path, sockaddr

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1.0
"""How long a connection may take to send its request, seconds (an honest client sends it at once)."""
MAX_PENDING = 128
"""Connections that have not sent their request yet, at most; a new one closes the oldest."""
BACKLOG = 512
"""The listen backlog: connections the kernel queues until the node accepts them (it accepts at once)."""

Redeem = Callable[..., "tuple[tuple[int, int], list[int]] | None"]
"""``(grant[, channels wanted]) -> ((get_bytes, put_bytes), fds)``, or ``None`` to refuse; the handoff server closes
``fds`` once sent (the two segments', then one per control channel). The second argument is passed only when
a version 2 request asks for channels."""


class HandoffServer:
    """The node's handoff socket, served on the running event loop.

    Args:
        address: a socket path, or ``@name`` for an abstract socket.
        redeem: turns a grant into the segment sizes and descriptors to send (see :data:`Redeem`).

    Attributes:
        address: as given.
        dropped: connections closed before they sent a request (idle too long, or pushed out by newer ones).
    """

    def __init__(self, address: str, redeem: Redeem) -> None:
        self.address = address
        self._redeem = redeem
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: OrderedDict[asyncio.Task[None], None] = OrderedDict()  # waiting for their request
        self._serving: set[asyncio.Task[None]] = set()
        self.dropped = 0

    async def start(self) -> None:
        """Bind and listen (a stale socket file is replaced; a live one is an error).

        Raises:
            OSError: if the address is in use or cannot be bound.
        """
        claim_socket_path(self.address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(sockaddr(self.address))
            if not self.address.startswith(ABSTRACT_PREFIX):
                os.chmod(self.address, SOCKET_MODE)
                self._inode = os.lstat(self.address).st_ino
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept(), name="kvstore-shm-handoff")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            while len(self._pending) >= MAX_PENDING:  # the longest-waiting silent connection makes room
                oldest, _ = self._pending.popitem(last=False)
                oldest.cancel()
                self.dropped += 1
            task = loop.create_task(self._serve(conn))
            self._pending[task] = None
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._pending.pop(task, None)
        self._serving.discard(task)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        try:
            conn.setblocking(False)
            request = await asyncio.wait_for(_read_request(loop, conn), REQUEST_TIMEOUT_S)
            if task is not None:  # read whole: from now on this connection is served, never pushed out
                self._pending.pop(task, None)
                self._serving.add(task)
            if request is None:
                await loop.sock_sendall(conn, pack_refusal(NOT_A_HANDOFF))
                return
            grant, channels = request
            if channels > MAX_CHANNELS:
                await loop.sock_sendall(conn, pack_refusal(f"at most {MAX_CHANNELS} control channels"))
                return
            granted = self._redeem(grant, channels) if channels else self._redeem(grant)
            if granted is None:
                await loop.sock_sendall(conn, pack_refusal("unknown, used or lapsed grant"))
                return
            sizes, fds = granted
            try:
                socket.send_fds(conn, [pack_granted(sizes)], fds)
            finally:
                for fd in fds:
                    os.close(fd)
        except asyncio.TimeoutError:
            self.dropped += 1
            logger.debug("handoff connection closed: no request within %.1f s", REQUEST_TIMEOUT_S)
        except (OSError, SegmentError) as exc:
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
                logger.warning("a handoff failed: the node is out of file descriptors (%s); raise RLIMIT_NOFILE or "
                               "lower shared_memory.max_sessions", exc)
            else:
                logger.debug("handoff connection ended: %s", exc)
        finally:
            conn.close()

    async def close(self) -> None:
        """Stop listening, end the connections being served, and remove the socket file."""
        tasks = [t for t in (self._task, *self._pending, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            remove_socket_path(self.address, self._inode)


async def _read_request(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> tuple[bytes, int] | None:
    """A request's grant and channels wanted; ``None`` for bytes that are not a request of a known version.

    Reads at most ``REQUEST_BYTES + 1`` bytes, whatever the peer sends.

    Raises:
        ConnectionError: if the peer closes before a whole request.
    """
    head = await _recv_exactly(loop, conn, REQUEST_BYTES)
    if head[:len(MAGIC)] != MAGIC or head[len(MAGIC)] not in (VERSION, VERSION_CHANNELS):
        return None
    grant = head[len(MAGIC) + 1:]
    if head[len(MAGIC)] == VERSION:
        return grant, 0
    return grant, (await _recv_exactly(loop, conn, 1))[0]


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = await loop.sock_recv(conn, nbytes - len(data))
        if not chunk:
            raise ConnectionError("the handoff connection closed before a whole request")
        data += chunk
    return data
