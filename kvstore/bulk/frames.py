"""The bulk connection's wire format, shared by the node's and the client's halves (``docs/scaleout.md``).

A client sends a request, :data:`REQUEST`: the magic and a grant (what a
``BulkGet`` or ``BulkPut`` call returned). A Put's blocks follow it at once,
in the order and at the sizes its ``BulkPut`` named. The node answers with a
reply head, :data:`REPLY`: the magic, a status code (gRPC's numbers), the
length of a body (a status's details in UTF-8, or a Put's serialized
``PutResponse``) and the length of the data that follow the body (a Get's
blocks, one after another, as its ``BulkGetResponse`` sized them). After a
reply whose code is not 0 the node closes the connection; after one that is,
the connection takes the next request. Integers are little-endian.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

MAGIC = b"KVB1"
"""The first bytes of every request and reply (the format's version)."""

GRANT_BYTES = 32
"""Length of a grant: random bytes from the OS CSPRNG (``secrets.token_bytes``)."""

REQUEST = struct.Struct("<4s32s")
"""A request: the magic, then the grant."""

REPLY = struct.Struct("<4sIIQ")
"""A reply head: the magic, the status code, the body's length, the data's length (bytes)."""

MAX_BODY_BYTES = 64 << 10
"""The longest reply body a client reads, bytes (a status's details, or a ``PutResponse``)."""

IOV_MAX = 1024
"""The most buffers one ``sendmsg`` takes (Linux's ``IOV_MAX``)."""

TRANSFER_BASE_S = 5.0
"""Every transfer may take this long plus its bytes at the slowest rate allowed (``bulk.min_bytes_per_s``), s
(the default of ``bulk.min_transfer_s``)."""


class TransferCut(Exception):
    """A transfer ended before its last byte: the peer closed the connection, reset it, or ran out of time.

    Attributes:
        done_bytes: the bytes that did move before it ended.
    """

    def __init__(self, message: str, done_bytes: int) -> None:
        super().__init__(message)
        self.done_bytes = done_bytes


def transfer_s(nbytes: int, min_bytes_per_s: int, base_s: float = TRANSFER_BASE_S) -> float:
    """The time a transfer of ``nbytes`` may take: ``base_s`` plus ``nbytes`` at ``min_bytes_per_s``, seconds."""
    return base_s + nbytes / min_bytes_per_s


def recv_exactly_into(sock: socket.socket, view: memoryview, deadline: float) -> int:
    """Fill ``view`` from ``sock`` (one ``recv_into`` per arrival, straight into it) by ``deadline``.

    Args:
        sock: a blocking socket (a timeout is set on it for each call).
        view: a writable, byte-addressable buffer.
        deadline: ``time.monotonic()`` by which it must be full.

    Returns:
        ``view.nbytes``.

    Raises:
        TransferCut: if the peer closes first (``done_bytes``: what arrived), resets the connection, or the deadline
            passes.
    """
    nbytes = view.nbytes
    got = 0
    while got < nbytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferCut(f"{got} of {nbytes} bytes arrived in time", got)
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:] if got else view)
        except (socket.timeout, TimeoutError):
            raise TransferCut(f"{got} of {nbytes} bytes arrived in time", got) from None
        except OSError as exc:
            raise TransferCut(f"the connection failed after {got} of {nbytes} bytes: {exc}", got) from None
        if n == 0:
            raise TransferCut(f"the peer closed the connection after {got} of {nbytes} bytes", got)
        got += n
    return nbytes


def send_all(sock: socket.socket, buffers: list[memoryview], deadline: float) -> int:
    """Send every buffer, in order, with ``sendmsg`` (no copy of them here), by ``deadline``.

    Args:
        sock: a blocking socket (a timeout is set on it for each call).
        buffers: byte-addressable ``memoryview`` s (``cast("B")``); the list is consumed.
        deadline: ``time.monotonic()`` by which the last byte must be sent.

    Returns:
        The bytes sent.

    Raises:
        TransferCut: if the peer resets the connection or the deadline passes first.
    """
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg through TLS: each buffer is encrypted from where it lies
        return _send_each(sock, buffers, deadline)
    sent_total = 0
    index = 0
    while index < len(buffers):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferCut(f"{sent_total} bytes sent before the deadline", sent_total)
        sock.settimeout(remaining)
        try:
            sent = sock.sendmsg(buffers[index:index + IOV_MAX])
        except (socket.timeout, TimeoutError):
            raise TransferCut(f"{sent_total} bytes sent before the deadline", sent_total) from None
        except OSError as exc:
            raise TransferCut(f"the connection failed after {sent_total} bytes: {exc}", sent_total) from None
        sent_total += sent
        while sent and index < len(buffers):
            first = buffers[index]
            if sent >= first.nbytes:
                sent -= first.nbytes
                index += 1
            else:
                buffers[index] = first[sent:]
                sent = 0
    return sent_total


def _send_each(sock: ssl.SSLSocket, buffers: list[memoryview], deadline: float) -> int:
    sent_total = 0
    for buffer in buffers:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferCut(f"{sent_total} bytes sent before the deadline", sent_total)
        sock.settimeout(remaining)  # sendall's timeout bounds the whole call
        try:
            sock.sendall(buffer)
        except (socket.timeout, TimeoutError):
            raise TransferCut(f"{sent_total} bytes sent before the deadline", sent_total) from None
        except OSError as exc:
            raise TransferCut(f"the connection failed after {sent_total} bytes: {exc}", sent_total) from None
        sent_total += buffer.nbytes
    return sent_total
