"""The framing of a session's control channels: typed, length-prefixed, size-limited frames (no pickle).

A same-host session's control exchange (Lookup, GetShared, PutShared) runs on
Unix socket pairs the node handed over with the session's segments
(``kvstore.shm.handoff``, version 2), instead of a unary gRPC call each. One
call at a time per channel, a request then its reply, all integers
little-endian::

    request  body bytes (u32) | kind (u8) | 0 (u8) | 0 (u16) | deadline (f64) | body
    reply    body bytes (u32) | code (u8) | 0 (u8) | 0 (u16)                  | body

``kind`` is one of :data:`KINDS`; its body is the serialized protobuf request
of the gRPC method of that name (the same message, the same checks). A reply
may carry up to :data:`MAX_REPLY_DESCRIPTORS` file descriptors (``SCM_RIGHTS``,
sent with its head): a GetShared reply's new slabs, in the order its
``new_slabs`` names them. The
``deadline`` is ``CLOCK_MONOTONIC`` seconds (``time.monotonic()``, one clock for
every process of a host), ``0`` for none. ``code`` is a gRPC status code's
number: ``0`` (OK) with the serialized reply, any other with the status's
details in UTF-8. A request over the node's limit, of an unknown kind or with
non-zero padding is answered with its status and the channel is closed (its
stream cannot be trusted after it); a malformed body is answered with
INVALID_ARGUMENT, as gRPC would, and the channel goes on.
"""

from __future__ import annotations

import struct

REQUEST_HEAD = struct.Struct("<IBBHd")
"""The head of a request: body bytes, kind, two zero fields, deadline (seconds)."""
REPLY_HEAD = struct.Struct("<IBBH")
"""The head of a reply: body bytes, status code, two zero fields."""

LOOKUP, GET_SHARED, PUT_SHARED = 1, 2, 3
KINDS = {LOOKUP: "Lookup", GET_SHARED: "GetShared", PUT_SHARED: "PutShared"}
"""Each request kind and the gRPC method whose request, reply and checks it has."""

MAX_REPLY_BYTES = 64 << 20
"""The largest reply body a client reads, bytes (a Lookup or GetShared reply of the most hashes a node allows
is far smaller)."""

MAX_CHANNELS = 16
"""The most control channels a client may ask for at a handoff."""

MAX_REPLY_DESCRIPTORS = 32
"""The most file descriptors one reply carries (``SCM_RIGHTS`` with its head: the shared pool's slabs a
GetShared reply names for the first time; the client makes room for this many)."""


class FrameError(ValueError):
    """A frame's head is malformed: an unknown kind, non-zero padding, or a body over the limit.

    Attributes:
        oversized: whether the body was over the limit (RESOURCE_EXHAUSTED) rather than malformed (INVALID_ARGUMENT).
    """

    def __init__(self, message: str, *, oversized: bool = False) -> None:
        super().__init__(message)
        self.oversized = oversized


def pack_request(kind: int, body: bytes, deadline: float | None) -> bytes:
    """One request frame: its head, then ``body``.

    Args:
        kind: one of :data:`KINDS`.
        body: the serialized request message.
        deadline: ``time.monotonic()`` seconds by which the call must end, ``None`` for none.
    """
    return REQUEST_HEAD.pack(len(body), kind, 0, 0, deadline or 0.0) + body


def unpack_request_head(head: bytes, max_body_bytes: int) -> tuple[int, int, float | None]:
    """``(body_bytes, kind, deadline)`` of a request head of :data:`REQUEST_HEAD` ``.size`` bytes.

    Raises:
        FrameError: on an unknown kind, non-zero padding, a deadline not finite and >= 0, or a body
            over ``max_body_bytes``.
    """
    body_bytes, kind, pad8, pad16, deadline = REQUEST_HEAD.unpack(head)
    if pad8 or pad16:
        raise FrameError("malformed control frame: its padding is not zero")
    if kind not in KINDS:
        raise FrameError(f"malformed control frame: unknown kind {kind} (known: {sorted(KINDS)})")
    if not 0.0 <= deadline < float("inf"):
        raise FrameError(f"malformed control frame: deadline {deadline!r}")
    if body_bytes > max_body_bytes:
        raise FrameError(f"control request of {body_bytes} bytes is over the node's limit of {max_body_bytes} "
                         f"(server.max_message_bytes)", oversized=True)
    return body_bytes, kind, deadline or None


def pack_reply(code: int, body: bytes) -> bytes:
    """One reply frame: status ``code`` (0 for OK) and ``body`` (the reply message, or the status's details)."""
    return REPLY_HEAD.pack(len(body), code, 0, 0) + body


def unpack_reply_head(head: bytes) -> tuple[int, int]:
    """``(body_bytes, code)`` of a reply head of :data:`REPLY_HEAD` ``.size`` bytes.

    Raises:
        FrameError: on non-zero padding or a body over :data:`MAX_REPLY_BYTES`.
    """
    body_bytes, code, pad8, pad16 = REPLY_HEAD.unpack(head)
    if pad8 or pad16:
        raise FrameError("malformed control reply: its padding is not zero")
    if body_bytes > MAX_REPLY_BYTES:
        raise FrameError(f"control reply of {body_bytes} bytes is over {MAX_REPLY_BYTES}", oversized=True)
    return body_bytes, code
