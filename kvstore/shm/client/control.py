"""The client's side of a session's control channels: Lookup, GetShared and PutShared without a gRPC call each.

The node hands a session's control channels over with its segments (the
handoff's version 2, ``kvstore.shm.handoff``): Unix socket pairs whose other
ends the node serves, each one call at a time (``kvstore.shm.frames``). Only
this process holds them, so they need no token of their own: every call on
them is admitted by the node as the session's ``Attach`` call was (its token
checked again, call by call, by the same rules as gRPC's). A reply may carry
file descriptors (``SCM_RIGHTS``): the slabs of the node's shared pool a
GetShared reply names for the first time, handed to :attr:`ControlChannels.on_descriptors`.

A call that fails on a channel reports a gRPC status (:class:`ControlError`,
a ``grpc.RpcError``), so the client's retry and fallback logic treat it as
the unary call it replaces: FAILED_PRECONDITION when the channel closed
before the reply (the node closes a session's channels as the session ends,
so the client attaches again, or uses gRPC) or once no channel is left,
DEADLINE_EXCEEDED when the deadline passed before the reply (the channel is
dropped then: its late reply would answer the next call).
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.shm.frames import MAX_REPLY_DESCRIPTORS, REPLY_HEAD, FrameError, pack_request, unpack_reply_head

CHANNELS_ENV = "KVSTORE_SHM_CONTROL_CHANNELS"
"""The environment variable setting how many control channels a client asks for (``0``: control over gRPC)."""
DEFAULT_CHANNELS = 4
"""Control channels a session asks for by default: calls beyond this many at once wait for a free one."""

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def channels_wanted() -> int:
    """How many control channels to ask for: :data:`CHANNELS_ENV` if set (clamped to 0..16), else the default."""
    from kvstore.shm.frames import MAX_CHANNELS

    value = os.environ.get(CHANNELS_ENV, "").strip()
    if not value:
        return DEFAULT_CHANNELS
    try:
        return max(0, min(MAX_CHANNELS, int(value)))
    except ValueError:
        return DEFAULT_CHANNELS


class ControlError(grpc.RpcError):
    """A control call's failure, as the gRPC status the same call over gRPC would have had."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        """The status code."""
        return self._code

    def details(self) -> str:
        """The status's message."""
        return self._details


class ControlChannels:
    """A session's control channels (thread-safe): each call takes a free one, and gives it back after its reply.

    Args:
        fds: the client ends of the channels, connected Unix stream sockets (this object owns them).

    Attributes:
        on_descriptors: ``(reply, fds)``, called with a reply that came with file descriptors, before the
            reply is returned; it owns them from then on. ``None``: they are closed.
    """

    def __init__(self, fds: list[int]) -> None:
        self.on_descriptors: Callable[[Message, list[int]], None] | None = None
        self._idle: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: set[socket.socket] = set()
        for fd in fds:
            sock = socket.socket(fileno=fd)
            self._all.add(sock)
            self._idle.put(sock)
        self.closed = not fds

    def __len__(self) -> int:
        return len(self._all)

    def call(self, kind: int, request: Message, reply_type: type[Message], timeout_s: float | None) -> Message:
        """One call: send ``request`` as a frame of ``kind``, wait for the reply (blocking).

        Args:
            kind: one of ``kvstore.shm.frames.KINDS``.
            request: the request message (as the gRPC method takes it).
            reply_type: the reply message's class.
            timeout_s: the call's deadline from now, seconds (``None``: none).

        Returns:
            The parsed reply.

        Raises:
            ControlError: with the node's status, or as described in the module docstring.
        """
        if self.closed:
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION, "the session's control channels are closed")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        body = request.SerializeToString()
        try:
            sock = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            raise ControlError(grpc.StatusCode.DEADLINE_EXCEEDED, "no free control channel before the deadline") \
                from None
        kept = False
        fds: list[int] = []
        try:
            sock.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))
            sock.sendall(pack_request(kind, body, deadline))
            code_bytes = _recv_head(sock, fds)
            nbytes, code = unpack_reply_head(code_bytes)
            payload = _recv_exactly(sock, nbytes) if nbytes else b""
            kept = True
        except (socket.timeout, TimeoutError):
            _close_all(fds)
            raise ControlError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the node's reply") \
                from None
        except (OSError, EOFError, FrameError) as exc:  # the node closes channels only as the session ends
            _close_all(fds)
            raise ControlError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the session's control channel closed (the session ended): {exc}") from None
        finally:
            if kept and not self.closed:
                self._idle.put(sock)
            else:
                self._drop(sock)
        if code:
            _close_all(fds)
            raise ControlError(_CODES.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))
        try:
            reply = reply_type.FromString(payload)
        except DecodeError as exc:
            _close_all(fds)
            raise ControlError(grpc.StatusCode.INTERNAL, f"malformed {reply_type.__name__} from the node: {exc}") \
                from None
        if fds:
            if self.on_descriptors is None:
                _close_all(fds)
            else:
                self.on_descriptors(reply, fds)
        return reply

    def method(self, kind: int, reply_type: type[Message], aio: bool) -> Callable[..., Any]:
        """A callable with a gRPC unary multicallable's signature (``request, timeout=, metadata=``) making this
        call; for ``aio``, a coroutine function, run in a worker thread (the calls block)."""
        if aio:
            async def acall(request: Message, timeout: float | None = None, **_: Any) -> Message:
                return await asyncio.to_thread(self.call, kind, request, reply_type, timeout)

            return acall

        def call(request: Message, timeout: float | None = None, **_: Any) -> Message:
            return self.call(kind, request, reply_type, timeout)

        return call

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._all.discard(sock)
            if not self._all:
                self.closed = True
        sock.close()

    def close(self) -> None:
        """Close every channel (the node ends its side; calls in flight fail with FAILED_PRECONDITION and close
        theirs); idempotent."""
        with self._lock:
            self.closed = True
            socks = list(self._all)
        for sock in socks:  # wakes a call waiting on its reply; the call closes its channel itself
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        while True:
            try:
                sock = self._idle.get_nowait()
            except queue.Empty:
                return
            self._drop(sock)


def _recv_head(sock: socket.socket, fds: list[int]) -> bytes:
    """A reply's head, and the descriptors that came with it (appended to ``fds``, which the caller then owns).

    Raises:
        FrameError: if descriptors were cut off (more than :data:`~kvstore.shm.frames.MAX_REPLY_DESCRIPTORS`).
        EOFError: if the node closed the channel.
    """
    data, received, flags, _ = socket.recv_fds(sock, REPLY_HEAD.size, MAX_REPLY_DESCRIPTORS)
    fds.extend(received)
    if flags & socket.MSG_CTRUNC:
        raise FrameError(f"a control reply came with more than {MAX_REPLY_DESCRIPTORS} descriptors")
    if not data:
        raise EOFError("the node closed the control channel")
    if len(data) < REPLY_HEAD.size:
        data += _recv_exactly(sock, REPLY_HEAD.size - len(data))
    return data


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the node closed the control channel")
        got += n
    return bytes(buffer)
