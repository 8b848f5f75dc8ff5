"""Hostile same-host processes against a node's data plane: a session opened by hand with control channels, and
the attacks of issue 39 on it (half-frames on control channels, a flood of idle handoff connections).

Shared by ``tests/shm/test_hostile_plane.py`` (bounded, waited on) and the soak (``benchmarks/soak.py``, a timed
round now and then). Each attack returns what it saw, by outcome, as the soak counts the hostile client's calls.
"""

from __future__ import annotations

import array
import collections
import contextlib
import os
import queue
import socket
import threading

import grpc

from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.frames import MAX_REPLY_DESCRIPTORS, PUT_SHARED, REPLY_HEAD, pack_request, unpack_reply_head
from kvstore.shm.segment import Segment
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

HALF_FRAME_BYTES = 4 << 20
"""The body a half-frame announces: the largest a node takes by default (``server.max_message_bytes``)."""

_CODES = {code.value[0]: code.name for code in grpc.StatusCode}


class Channels:
    """A same-host session opened by hand with control channels, as a hostile same-uid process would open one.

    Args:
        target: the node.
        num_channels: control channels to ask for (0 to 16).
        metadata: call metadata (a bearer token).

    Attributes:
        session_id: the node's name for the session.
        fds: its get and put segments' descriptors, as handed over (this object closes them).
        put: the put segment, mapped read-write.
        socks: the control channels.
    """

    def __init__(self, target: str, num_channels: int = 1, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        stub = pb_grpc.KVStoreStub(self.channel)
        offer = stub.Capabilities(pb.CapabilitiesRequest(), timeout=10, metadata=metadata).shared_memory
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.call = stub.Attach(iter(self._requests.get, None), metadata=metadata)
        reply = next(self.call)
        self.session_id = reply.session_id
        sizes, fds = redeem_grant(offer.handoff_socket, reply.grant, 10.0, num_channels)
        self.fds = fds[:2]
        self.put = Segment.attach(os.dup(fds[1]), sizes[1], writable=True)
        self.socks = [socket.socket(fileno=fd) for fd in fds[2:]]

    def request(self, sock: socket.socket, kind: int, message: object) -> tuple[int, bytes, list[int]]:
        """One control call: the reply's status code, body and descriptors (the caller closes them)."""
        sock.settimeout(30)
        sock.sendall(pack_request(kind, message.SerializeToString(), None))  # type: ignore[attr-defined]
        data, fds, _, _ = socket.recv_fds(sock, REPLY_HEAD.size, MAX_REPLY_DESCRIPTORS)
        while len(data) < REPLY_HEAD.size:
            data += sock.recv(REPLY_HEAD.size - len(data))
        nbytes, code = unpack_reply_head(data)
        body = b""
        while len(body) < nbytes:
            body += sock.recv(nbytes - len(body))
        return code, body, fds

    def close(self) -> None:
        """End the session (its channels, segments and ``Attach`` stream)."""
        for sock in self.socks:
            sock.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.put.close()
        self._requests.put(None)
        self.call.cancel()
        self.channel.close()


def send_half_frames(socks: list[socket.socket]) -> None:
    """On each channel, a request head that announces :data:`HALF_FRAME_BYTES` of body, and no body."""
    head = pack_request(PUT_SHARED, b"", None)
    for sock in socks:
        sock.sendall(array.array("I", [HALF_FRAME_BYTES]).tobytes() + head[4:])


def read_channel_ends(socks: list[socket.socket], timeout_s: float = 60.0) -> collections.Counter[str]:
    """Wait for the node to answer each channel's half-frame and close it; the answers' codes, by name."""
    codes: collections.Counter[str] = collections.Counter()
    for sock in socks:
        sock.settimeout(timeout_s)
        try:
            data = sock.recv(REPLY_HEAD.size)
            codes[_CODES.get(unpack_reply_head(data[:REPLY_HEAD.size])[1], "?") if len(data) >= REPLY_HEAD.size
                  else "closed"] += 1
            while sock.recv(4096):
                pass
        except OSError as exc:
            codes[type(exc).__name__] += 1
    return codes


def control_slowloris(target: str, sessions: int = 2, channels: int = 16) -> collections.Counter[str]:
    """Half-frames on every channel of ``sessions`` sessions, until the node ends each one (a round of the soak)."""
    opened = [Channels(target, num_channels=channels) for _ in range(sessions)]
    try:
        socks = [sock for session in opened for sock in session.socks]
        send_half_frames(socks)
        return read_channel_ends(socks)
    finally:
        for session in opened:
            session.close()


def handoff_address(target: str) -> str:
    """The node's handoff socket, as ``socket.connect`` takes it (an abstract one with its leading NUL)."""
    with grpc.insecure_channel(target) as channel:
        address = pb_grpc.KVStoreStub(channel).Capabilities(pb.CapabilitiesRequest(), timeout=10) \
            .shared_memory.handoff_socket
    return "\0" + address[1:] if address.startswith("@") else address


class HandoffFlood:
    """Idle connections to a node's handoff socket, opened as fast as the node accepts them and never used.

    Args:
        target: the node.
        held: connections kept open at once (the oldest is closed as a new one opens).

    Attributes:
        opened: connections opened so far.
    """

    def __init__(self, target: str, held: int = 600) -> None:
        self.address = handoff_address(target)
        self.held = held
        self.opened = 0
        self._socks: collections.deque[socket.socket] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flood, name="handoff-flood", daemon=True)

    def _flood(self) -> None:
        while not self._stop.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(self.address)
            except (BlockingIOError, InterruptedError):
                pass  # a full backlog: the connection is queued or refused; either way it is held
            except OSError:
                sock.close()
                continue
            self._socks.append(sock)
            self.opened += 1
            if len(self._socks) > self.held:
                self._socks.popleft().close()

    def __enter__(self) -> HandoffFlood:
        self._thread.start()
        return self

    def holding(self) -> bool:
        """Whether the flood holds its full count of idle connections."""
        return len(self._socks) >= self.held

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        while self._socks:
            self._socks.popleft().close()
