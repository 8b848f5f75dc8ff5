"""The replay buffers of a node's event streams, and the replay socket's peers: bounded, shared, and freed.

A peer asks the replay socket (ROUTER) for the batches of its stream from a
sequence number (vLLM's protocol: one frame, 8 bytes, big-endian) and gets them,
then the end marker (``b""``, ``END_SEQ``, ``b""``). Memory is bounded however
peers behave (``docs/events.md``, "Replay"):

* **Shared, not copied.** Each buffered batch is one ZMQ message (a
  :class:`zmq.Frame`), made once when the batch is published; every send of it,
  live or replayed, to any number of peers, shares its bytes (pyzmq would copy
  a ``bytes`` frame under 64 KiB on every send).
* **Bounded per peer.** A replay is a cursor, not a burst: the node sends a
  peer's batches while its queue (``replay_hwm`` batches, the ROUTER's
  ``SNDHWM``) has room, and goes on as the peer reads. A peer that asks again
  restarts its cursor; it never stacks a second copy of the history.
* **Bounded in total.** At most ``max_replays`` replays at once
  (``max_replays_per_stream`` of one stream, so one tenant cannot take them
  all); more get the end marker with ``b"error: busy ..."``. A replay that makes
  no progress for ``replay_stall_s`` is dropped. The buffers are bounded in
  batches and bytes.
* **Freed when a peer goes.** The ROUTER is ``ROUTER_MANDATORY``: a send to a
  peer that has gone fails, and its cursor goes; ZMQ frees its queue.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterator, Sequence

import zmq

from kvstore.events.access import EventAccess
from kvstore.events.schema import END_SEQ

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64
"""Largest replay request message the ROUTER accepts; a peer that sends more is disconnected (``ZMQ_MAXMSGSIZE``)."""
SENDS_PER_ROUND = 256
"""Batches one replay sends before the next replay's turn (and the next live batch's)."""
REQUESTS_PER_ROUND = 256
"""Requests read before the publisher turns to its other sockets."""


@dataclass(frozen=True, slots=True)
class ReplayLimits:
    """Bounds of the replay socket (``[events]`` in the config).

    Attributes:
        max_replays: replays served at once, over every peer.
        max_replays_per_stream: replays of one stream (one token's tenants) at once.
        replay_hwm: batches queued on the node for one peer (the ROUTER's ``SNDHWM``).
        replay_stall_s: seconds a replay may make no progress (its peer reads nothing) before it is dropped.
    """

    max_replays: int = 64
    max_replays_per_stream: int = 16
    replay_hwm: int = 64
    replay_stall_s: float = 10.0


class StreamBuffer:
    """One stream's sequence numbers and the batches kept for replay, as shared ZMQ frames.

    Args:
        topic: the stream's topic (the first frame of its batches).
        tenants: the routes it carries (``kvstore.events.access``); ``None``: every event.
        max_steps: batches kept, at most.
        max_bytes: bytes of batches kept, at most (the newest batch is always kept).

    Attributes:
        next_seq: the sequence number of the next batch.
        buffered_bytes: bytes of the batches kept.
    """

    __slots__ = ("topic", "tenants", "next_seq", "buffered_bytes", "_batches", "_max_steps", "_max_bytes")

    def __init__(self, topic: bytes, tenants: frozenset[int] | None, max_steps: int, max_bytes: int) -> None:
        self.topic = topic
        self.tenants = tenants
        self.next_seq = 0
        self.buffered_bytes = 0
        self._batches: deque[tuple[int, zmq.Frame, int]] = deque()
        self._max_steps = max_steps
        self._max_bytes = max_bytes

    def append(self, frame: zmq.Frame, nbytes: int) -> int:
        """Keep one more batch of ``nbytes``; returns its sequence number. The oldest go past either bound."""
        seq = self.next_seq
        self.next_seq = seq + 1
        batches = self._batches
        batches.append((seq, frame, nbytes))
        self.buffered_bytes += nbytes
        while len(batches) > self._max_steps or (self.buffered_bytes > self._max_bytes and len(batches) > 1):
            self.buffered_bytes -= batches.popleft()[2]
        return seq

    @property
    def first_seq(self) -> int:
        """The oldest batch kept (``next_seq`` when none is)."""
        return self._batches[0][0] if self._batches else self.next_seq

    def __len__(self) -> int:
        """Batches kept."""
        return len(self._batches)

    def batches_from(self, seq: int) -> Iterator[tuple[int, zmq.Frame]]:
        """The batches kept from ``seq`` on, ``(seq, frame)`` in order (do not append while iterating)."""
        start = max(0, seq - self.first_seq)
        return ((s, frame) for s, frame, _ in islice(self._batches, start, None))


class _Cursor:
    """One peer's replay: where it is, where it ends, and when it last made progress."""

    __slots__ = ("envelope", "stream", "next_seq", "end_seq", "progress_at")

    def __init__(self, envelope: list[bytes], stream: int, next_seq: int, end_seq: int, now: float) -> None:
        self.envelope = envelope
        self.stream = stream
        self.next_seq = next_seq
        self.end_seq = end_seq
        self.progress_at = now


class ReplayServer:
    """Serves the replay socket from the publisher's thread (module docstring).

    Args:
        sock: the bound ROUTER (its options are set here).
        streams: the streams' buffers, by stream number.
        access: who reads which stream (its peers authenticated by their handshake); ``None``: every peer
            reads stream 0.
        limits: the bounds.
        clock: seconds, monotonic (injectable for tests).

    Attributes:
        num_replays: requests served. num_errors: malformed or unauthorized requests.
        num_refused: requests refused because too many replays were under way.
        num_abandoned: replays dropped because their peer read nothing for ``replay_stall_s``.
        num_batches: batches sent to replay peers.
    """

    def __init__(self, sock: zmq.Socket, streams: Sequence[StreamBuffer], access: EventAccess | None,
                 limits: ReplayLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self._sock = sock
        self._streams = streams
        self._access = access
        self._limits = limits
        self._clock = clock
        self._cursors: dict[bytes, _Cursor] = {}
        self.num_replays = 0
        self.num_errors = 0
        self.num_refused = 0
        self.num_abandoned = 0
        self.num_batches = 0

    @staticmethod
    def configure(sock: zmq.Socket, limits: ReplayLimits) -> None:
        """Set the ROUTER's options (before it binds): its per-peer queue, mandatory routing, the request bound."""
        sock.setsockopt(zmq.SNDHWM, limits.replay_hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer fails the send: the cursor waits or goes
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.LINGER, 0)

    @property
    def pending(self) -> int:
        """Replays under way."""
        return len(self._cursors)

    def read_requests(self) -> None:
        """Take the requests waiting on the socket (a bounded number per call) and start their replays."""
        for _ in range(REQUESTS_PER_ROUND):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._request(frames)

    def _request(self, frames: list[zmq.Frame]) -> None:
        """One request: ``[identity, (b""), start_seq]`` -> a cursor, or the end marker with an error."""
        identity, rest = frames[0].bytes, [f.bytes for f in frames[1:]]
        envelope = [identity, b""] if len(rest) == 2 and rest[0] == b"" else [identity]
        payload = rest[-1] if len(rest) in (1, 2) else None
        if payload is None or len(payload) != 8 or (len(rest) == 2 and rest[0] != b""):
            self.num_errors += 1
            self._end(envelope, f"error: a replay request is one frame of 8 bytes (the start sequence number, "
                                f"big-endian); got {len(rest)} frame(s) of {[len(f) for f in rest[:4]]} bytes")
            return
        stream = 0
        if self._access is not None:
            try:
                name = frames[-1].get("User-Id")
            except zmq.ZMQError:
                name = ""
            found = self._access.stream_of_name(name)
            if found is None:  # (the handshake lets no one in without a stream: never here)
                self.num_errors += 1
                self._end(envelope, "error: not authenticated")
                return
            stream = found
        cursors = self._cursors
        if identity not in cursors:  # a peer that asks again restarts its replay: it never holds two
            limits = self._limits
            of_stream = sum(1 for c in cursors.values() if c.stream == stream)
            if len(cursors) >= limits.max_replays or of_stream >= limits.max_replays_per_stream:
                self.num_refused += 1
                self._end(envelope, f"error: busy: {len(cursors)} replays under way ({of_stream} of this stream; "
                                    f"at most {limits.max_replays}, {limits.max_replays_per_stream}); ask again")
                return
        self.num_replays += 1
        buffer = self._streams[stream]
        start = max(int.from_bytes(payload, "big"), buffer.first_seq)
        cursors.pop(identity, None)
        cursors[identity] = _Cursor(envelope, stream, start, buffer.next_seq, self._clock())

    def pump(self) -> None:
        """Send each replay what its peer's queue has room for (round robin); end those done, drop those gone."""
        if not self._cursors:
            return
        now = self._clock()
        for identity, cursor in list(self._cursors.items()):
            state = self._advance(cursor)
            if state == "sent":
                cursor.progress_at = now
                self._cursors.pop(identity)  # to the back of the line
                self._cursors[identity] = cursor
            elif state in ("done", "gone"):
                del self._cursors[identity]
            elif now - cursor.progress_at > self._limits.replay_stall_s:
                self.num_abandoned += 1
                del self._cursors[identity]
                logger.info("events: a replay peer read nothing for %.0f s: its replay is dropped",
                            self._limits.replay_stall_s)

    def _advance(self, cursor: _Cursor) -> str:
        """Send one round of ``cursor``'s batches: ``sent`` (some), ``full`` (none: no room), ``done``, ``gone``."""
        buffer = self._streams[cursor.stream]
        cursor.next_seq = max(cursor.next_seq, buffer.first_seq)  # batches dropped from the buffer meanwhile
        sent = 0
        sock, envelope, topic = self._sock, cursor.envelope, buffer.topic
        try:
            for seq, frame in buffer.batches_from(cursor.next_seq):
                if seq >= cursor.end_seq or sent >= SENDS_PER_ROUND:
                    break
                sock.send_multipart([*envelope, topic, seq.to_bytes(8, "big"), frame], flags=zmq.NOBLOCK, copy=False)
                cursor.next_seq = seq + 1
                sent += 1
                self.num_batches += 1
            if cursor.next_seq >= cursor.end_seq or cursor.next_seq >= buffer.next_seq:
                sock.send_multipart([*envelope, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
                return "done"
        except zmq.Again:  # the peer's queue is full: the rest waits for it to read
            return "sent" if sent else "full"
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the peer has gone: ZMQ freed its queue
                return "gone"
            raise
        return "sent"

    def _end(self, envelope: list[bytes], message: str) -> None:
        """Send the end marker with ``message`` (an error) if the peer has room; nothing waits for it."""
        try:
            self._sock.send_multipart([*envelope, b"", END_SEQ, message.encode()], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # full or gone: the peer does not read what it is sent
            pass
