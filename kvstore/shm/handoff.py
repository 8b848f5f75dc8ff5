"""The handoff socket: where a client redeems the grant of its session for the session's two file descriptors.

gRPC cannot carry file descriptors, so the node listens on a Unix socket of its
own for this one step (``SCM_RIGHTS``, ``unix(7)``). The exchange, one per
connection, all integers little-endian::

    client -> node   b"KVSH" | version (1 byte, 1) | grant (32 bytes)
    node -> client   0 (1 byte) | get segment bytes (u64) | put segment bytes (u64)
                     with two descriptors: the get segment, read-only; the put segment, read-write
                 or  1 (1 byte) | reason (UTF-8), and no descriptor

and the node closes the connection. Version 2 asks for control channels too
(``kvstore.shm.frames``)::

    client -> node   b"KVSH" | 2 | grant (32 bytes) | channels wanted (1 byte, at most 16)
    node -> client   as version 1, with one more descriptor per channel the node serves (0 to that many)

A grant is random (256 bits), sent only on
the authenticated ``Attach`` stream that opened the session, valid once and
for ``grant_s`` seconds, so the socket needs no access control of its own; it
is made ``0660`` all the same. A connection that sends nothing is closed after
:data:`HANDOFF_TIMEOUT_S`, and at most :data:`MAX_CONNECTIONS` are served at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from typing import Callable

from kvstore.shm.segment import SegmentError
from kvstore.unix_sockets import ABSTRACT_PREFIX, SOCKET_MODE, claim_socket_path, remove_socket_path, sockaddr

logger = logging.getLogger(__name__)

MAGIC = b"KVSH"
VERSION = 1
VERSION_CHANNELS = 2
GRANT_BYTES = 32
REQUEST_BYTES = len(MAGIC) + 1 + GRANT_BYTES
MAX_CHANNELS = 16
NOT_A_HANDOFF = "not a kvstore handoff request"
"""The refusal of a request of a version the node does not know (before any grant is looked at)."""
_SIZES = struct.Struct("<QQ")
OK, REFUSED = 0, 1
HANDOFF_TIMEOUT_S = 5.0
"""How long the node waits for a connection's request, seconds."""
MAX_CONNECTIONS = 64
"""Handoff connections served at once; more wait in the listen backlog."""

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
    """

    def __init__(self, address: str, redeem: Redeem) -> None:
        self.address = address
        self._redeem = redeem
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

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
            sock.listen(MAX_CONNECTIONS)
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
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except BaseException:
                self._slots.release()
                raise
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            request = await asyncio.wait_for(_recv_exactly(loop, conn, REQUEST_BYTES), HANDOFF_TIMEOUT_S)
            if request is None or request[:len(MAGIC)] != MAGIC or request[len(MAGIC)] not in (VERSION,
                                                                                              VERSION_CHANNELS):
                await _send_refusal(loop, conn, NOT_A_HANDOFF)
                return
            channels = 0
            if request[len(MAGIC)] == VERSION_CHANNELS:
                wanted = await asyncio.wait_for(_recv_exactly(loop, conn, 1), HANDOFF_TIMEOUT_S)
                if wanted is None or wanted[0] > MAX_CHANNELS:
                    await _send_refusal(loop, conn, f"at most {MAX_CHANNELS} control channels")
                    return
                channels = wanted[0]
            grant = request[len(MAGIC) + 1:]
            granted = self._redeem(grant, channels) if channels else self._redeem(grant)  # type: ignore[call-arg]
            if granted is None:
                await _send_refusal(loop, conn, "unknown, used or lapsed grant")
                return
            sizes, fds = granted
            try:
                socket.send_fds(conn, [bytes((OK,)) + _SIZES.pack(*sizes)], fds)
            finally:
                for fd in fds:
                    os.close(fd)
        except (asyncio.TimeoutError, OSError, SegmentError) as exc:
            logger.debug("handoff connection ended: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    async def close(self) -> None:
        """Stop listening, end the connections being served, and remove the socket file."""
        tasks = [t for t in (self._task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            remove_socket_path(self.address, self._inode)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, nbytes: int) -> bytes | None:
    data = b""
    while len(data) < nbytes:
        chunk = await loop.sock_recv(conn, nbytes - len(data))
        if not chunk:
            return None
        data += chunk
    return data


async def _send_refusal(loop: asyncio.AbstractEventLoop, conn: socket.socket, reason: str) -> None:
    await loop.sock_sendall(conn, bytes((REFUSED,)) + reason.encode())


class HandoffRefused(SegmentError):
    """The node refused a grant (unknown, used or lapsed), or the reply was not a handoff."""


def redeem_grant(address: str, grant: bytes, timeout_s: float,
                 channels: int = 0) -> tuple[tuple[int, int], list[int]]:
    """Redeem ``grant`` on the node's handoff socket: the segment sizes and the descriptors (the caller owns them).

    Args:
        address: the socket path (or ``@name``) the node offered.
        grant: the session's grant, :data:`GRANT_BYTES` long.
        timeout_s: for the whole exchange, seconds.
        channels: control channels to ask for (0 to :data:`MAX_CHANNELS`; 0: a version 1 request).

    Returns:
        ``((get_bytes, put_bytes), [get_fd, put_fd, *channel_fds])``: as many channels as the node serves, up
        to ``channels`` (none from a node that serves none).

    Raises:
        OSError: if the socket cannot be reached (another host, another mount or network namespace).
        HandoffRefused: if the node refused the grant or sent something else.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(sockaddr(address))
        if channels:
            sock.sendall(MAGIC + bytes((VERSION_CHANNELS,)) + grant + bytes((min(channels, MAX_CHANNELS),)))
        else:
            sock.sendall(MAGIC + bytes((VERSION,)) + grant)
        data, fds, flags, _ = socket.recv_fds(sock, 4096, 2 + MAX_CHANNELS)
        if flags & socket.MSG_CTRUNC or (data[:1] == bytes((OK,)) and (
                not 2 <= len(fds) <= 2 + channels or len(data) != 1 + _SIZES.size)):
            for fd in fds:
                os.close(fd)
            raise HandoffRefused(f"malformed handoff reply ({len(data)} bytes, {len(fds)} descriptors)")
        if data[:1] != bytes((OK,)):
            for fd in fds:
                os.close(fd)
            reason = data[1:].decode(errors="replace") or "the connection closed"
            raise HandoffRefused(f"the node refused the grant: {reason}")
        return _SIZES.unpack(data[1:]), list(fds)
