"""The handoff protocol: how a client redeems the grant of its session for the session's file descriptors.

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

A grant is random (256 bits), sent only on the authenticated ``Attach`` stream
that opened the session, valid once and for ``grant_s`` seconds, so the socket
needs no access control of its own; it is made ``0660`` all the same. The
node's side is :mod:`kvstore.shm.node.handoff`, the client's
:mod:`kvstore.shm.client.handoff`; this module is what both must agree on.
"""

from __future__ import annotations

import struct

from kvstore.shm.segment import SegmentError

MAGIC = b"KVSH"
VERSION = 1
VERSION_CHANNELS = 2
GRANT_BYTES = 32
REQUEST_BYTES = len(MAGIC) + 1 + GRANT_BYTES
"""A version 1 request's length; version 2 adds one byte (the channels wanted)."""
MAX_CHANNELS = 16
NOT_A_HANDOFF = "not a kvstore handoff request"
"""The refusal of a request of a version the node does not know (before any grant is looked at)."""
SIZES = struct.Struct("<QQ")
"""The segment sizes of a successful reply: get segment bytes, put segment bytes."""
OK, REFUSED = 0, 1


class HandoffRefused(SegmentError):
    """The node refused a grant (unknown, used or lapsed), or the reply was not a handoff."""


def pack_request(grant: bytes, channels: int) -> bytes:
    """A request for ``grant``'s descriptors: version 2 with ``channels`` control channels, version 1 with none."""
    if channels:
        return MAGIC + bytes((VERSION_CHANNELS,)) + grant + bytes((min(channels, MAX_CHANNELS),))
    return MAGIC + bytes((VERSION,)) + grant


def pack_refusal(reason: str) -> bytes:
    """A refusal reply naming ``reason``."""
    return bytes((REFUSED,)) + reason.encode()


def pack_granted(sizes: tuple[int, int]) -> bytes:
    """The bytes of a successful reply (its descriptors ride with them)."""
    return bytes((OK,)) + SIZES.pack(*sizes)
