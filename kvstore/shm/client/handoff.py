"""The client's side of the handoff (``kvstore.shm.handoff``): redeem a grant for the session's descriptors.

A node under a flood of idle connections may have a full listen backlog for a
moment (``connect(2)`` on a Unix socket then fails with ``EAGAIN``), or may drop
a connection that had not yet sent its request: both leave the grant unused, so
the client connects again, pausing a little longer each time, until its deadline.
"""

from __future__ import annotations

import errno
import os
import socket
import time

from kvstore.shm.handoff import MAX_CHANNELS, OK, SIZES, HandoffRefused, pack_request
from kvstore.unix_sockets import sockaddr

RETRY_PAUSE_S = (0.001, 0.05)
"""First and longest pause between connection attempts while the node's socket is busy, seconds (doubling)."""

_BUSY = frozenset({errno.EAGAIN, errno.ECONNRESET, errno.EPIPE})
"""Errors of a connection attempt the node's load explains (a full backlog, a dropped idle connection)."""


def redeem_grant(address: str, grant: bytes, timeout_s: float,
                 channels: int = 0) -> tuple[tuple[int, int], list[int]]:
    """Redeem ``grant`` on the node's handoff socket: the segment sizes and the descriptors (the caller owns them).

    Args:
        address: the socket path (or ``@name``) the node offered.
        grant: the session's grant, ``kvstore.shm.handoff.GRANT_BYTES`` long.
        timeout_s: for the whole exchange, retries included, seconds.
        channels: control channels to ask for (0 to :data:`~kvstore.shm.handoff.MAX_CHANNELS`; 0: a version 1
            request).

    Returns:
        ``((get_bytes, put_bytes), [get_fd, put_fd, *channel_fds])``: as many channels as the node serves, up
        to ``channels`` (none from a node that serves none).

    Raises:
        OSError: if the socket cannot be reached (another host, another mount or network namespace), or it
            stayed busy until the deadline.
        HandoffRefused: if the node refused the grant or sent something else.
    """
    deadline = time.monotonic() + timeout_s
    pause = RETRY_PAUSE_S[0]
    while True:
        try:
            return _redeem_once(address, grant, max(1e-3, deadline - time.monotonic()), channels)
        except _Busy as busy:
            if time.monotonic() + pause >= deadline:
                raise busy.error from None
        time.sleep(pause)  # the node's socket is busy: connect again shortly
        pause = min(RETRY_PAUSE_S[1], pause * 2)


class _Busy(Exception):
    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _redeem_once(address: str, grant: bytes, timeout_s: float, channels: int) -> tuple[tuple[int, int], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(sockaddr(address))
            sock.sendall(pack_request(grant, channels))
        except OSError as exc:
            if exc.errno in _BUSY:
                raise _Busy(exc) from None
            raise
        try:
            data, fds, flags, _ = socket.recv_fds(sock, 4096, 2 + MAX_CHANNELS)
        except OSError as exc:
            if exc.errno in _BUSY:
                raise _Busy(exc) from None
            raise
        if not data and not fds:  # dropped before the node read the request: the grant is still good
            raise _Busy(ConnectionResetError(errno.ECONNRESET, "the node closed the handoff connection"))
        if flags & socket.MSG_CTRUNC or (data[:1] == bytes((OK,)) and (
                not 2 <= len(fds) <= 2 + channels or len(data) != 1 + SIZES.size)):
            for fd in fds:
                os.close(fd)
            raise HandoffRefused(f"malformed handoff reply ({len(data)} bytes, {len(fds)} descriptors)")
        if data[:1] != bytes((OK,)):
            for fd in fds:
                os.close(fd)
            reason = data[1:].decode(errors="replace") or "the connection closed"
            raise HandoffRefused(f"the node refused the grant: {reason}")
        return SIZES.unpack(data[1:]), list(fds)
