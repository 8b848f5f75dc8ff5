"""The bulk connection's wire format, shared by the node's and the client's halves (``docs/scaleout.md``).

A client sends a request: its head, :data:`REQUEST` (the magic, its kind, the
lengths of a token and a body), then the token and the body. Three kinds:

* :data:`REDEEM`: the body is a grant (what a ``BulkGet`` or ``BulkPut`` call
  on gRPC returned), no token;
* :data:`GET` and :data:`PUT`: the call itself, on this connection: the body is
  a serialized ``BulkGetRequest`` or ``BulkPutRequest`` and the token the
  caller's ``authorization`` value (``Bearer ...``; empty without one). The
  node admits and checks it as it would the gRPC call (the node's service, its
  scope and checks), then serves the grant that call would have returned, at
  once: one round trip instead of two.

A Put's blocks follow its request at once, in the order and at the sizes its
``BulkPutRequest`` named. The node answers with a reply head, :data:`REPLY`:
the magic, a status code (gRPC's numbers), the length of a body and the length
of the data that follow the body. A Get's body is its ``BulkGetResponse``
(its blocks' sizes; no grant) and its data the blocks, one after another; a
Put's body is its ``PutResponse``; a refusal's body is its details in UTF-8.
A call the node's grant budget has no room for is answered OK with a
``no_room`` body and no data. After a reply whose code is not 0, or a Put that
was not received, the node closes the connection; otherwise the connection
takes the next request. Integers are little-endian.
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

REQUEST = struct.Struct("<4sBxHI")
"""A request's head: the magic, the kind, a zero byte, the token's length and the body's length (bytes)."""

REDEEM, GET, PUT = 1, 2, 3
"""The kinds of request: redeem a grant; a ``BulkGet``; a ``BulkPut``."""

MAX_TOKEN_BYTES = 4096
"""The longest token a request may carry, bytes."""

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
