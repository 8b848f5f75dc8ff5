"""A subscriber of a node's (or a vLLM engine's) KV events: live batches in order, gaps filled by replay.

For operators (``kvstore events``), tests and routers written in Python. It
speaks vLLM's framing (``kvstore.events.publisher``): a SUB socket for the live
stream and a DEALER socket for the replay ROUTER. :class:`TierView` folds the
events into "which block is where", the view a router keeps.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Generic, cast

from typing_extensions import TypeVar  # a TypeVar with a default (PEP 696; typing's has one from 3.13)

import msgspec
import zmq

from kvstore.errors import KVStoreError
from kvstore.events.access import authenticate_client
from kvstore.events.schema import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
)


Batch = TypeVar("Batch", default=KVEventBatch)
"""What an :class:`EventSubscriber` yields: what its ``decode`` makes, a :class:`KVEventBatch` by default."""


class EventStreamError(KVStoreError):
    """The replay socket refused a request (its error marker's message), or a batch could not be decoded."""


class EventSubscriber(Generic[Batch]):
    """Follows one publisher: yields its batches in sequence order, replaying what the live stream dropped.

    Args:
        endpoint: the publisher's PUB address (``tcp://127.0.0.1:5557``).
        replay_endpoint: its ROUTER address; ``None``: gaps are counted, not filled.
        topic: the topic prefix to subscribe to (``""``: every topic).
        from_seq: replay from this sequence number on the first :meth:`receive` (0: everything the
            publisher still buffers); ``None`` starts with the live stream.
        decode: bytes -> batch; kvstore's :class:`KVEventBatch` by default (pass vLLM's decoder to read an engine).
        rcvhwm: the SUB socket's high-water mark, messages (small: a slow reader drops, and replays).
        replay_timeout_s: seconds :meth:`receive` waits for each message of a replay.
        context: the ZMQ context; the shared one when ``None``.
        token: the bearer token to authenticate with, for a node with tokens (``kvstore.events.access``:
            it sends the events of the tenants the token covers); ``None`` for a node without.

    Attributes:
        num_missed: batches neither the live stream nor the replay buffer had (the view must be rebuilt).
        num_replayed: batches obtained by replay.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "kvstore",
                 from_seq: int | None = 0, decode: Callable[[bytes], Batch] | None = None, rcvhwm: int = 100_000,
                 replay_timeout_s: float = 5.0, context: zmq.Context | None = None,
                 token: str | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._token = token
        self._sub = self._ctx.socket(zmq.SUB)
        if token is not None:
            authenticate_client(self._sub, token)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        # without ``decode`` Batch is KVEventBatch (its default), which the default decoder makes
        self._decode = decode if decode is not None else cast("Callable[[bytes], Batch]", decoder().decode)
        self._expected: int | None = None
        self._from_seq = from_seq
        self._replay_timeout_s = replay_timeout_s
        self.num_missed = 0
        self.num_replayed = 0

    def close(self) -> None:
        """Close the sockets."""
        self._sub.close(linger=0)

    def __enter__(self) -> EventSubscriber[Batch]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout_s: float = 1.0) -> list[tuple[int, Batch]]:
        """The next batches in sequence order, ``(seq, batch)``; empty if none came within ``timeout_s``.

        A gap in the live stream is filled from the replay socket; what it no
        longer holds is counted in :attr:`num_missed` (a view built from the
        stream must then be rebuilt: :meth:`TierView.apply` is told by the gap).

        Raises:
            EventStreamError: if a batch does not decode, or the replay socket answered with an error.
            TimeoutError: if the replay socket did not answer within ``replay_timeout_s``.
        """
        out: list[tuple[int, Batch]] = []
        if self._expected is None and self._from_seq is not None and self._replay_endpoint is not None:
            out += self.replay(self._from_seq, self._replay_timeout_s)
            self._expected = out[-1][0] + 1 if out else self._from_seq
            self._from_seq = None
        wait_ms = max(0, int(timeout_s * 1000))
        while self._sub.poll(0 if out else wait_ms):
            topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._expected is not None and seq < self._expected:
                continue  # already had it from a replay
            if self._expected is not None and seq > self._expected:
                filled = [(s, b) for s, b in self.replay(self._expected, self._replay_timeout_s) if s < seq] \
                    if self._replay_endpoint is not None else []
                self.num_missed += seq - self._expected - len(filled)
                out += filled
            out.append((seq, self._decode_one(payload)))
            self._expected = seq + 1
        return out

    def replay(self, start_seq: int, timeout_s: float = 1.0) -> list[tuple[int, Batch]]:
        """Every batch the publisher buffers from ``start_seq`` on, ``(seq, batch)`` in order.

        Raises:
            EventStreamError: if the publisher answered with an error, a batch does not decode, or there is
                no replay endpoint.
            TimeoutError: if it did not answer within ``timeout_s`` (per message).
        """
        if self._replay_endpoint is None:
            raise EventStreamError("no replay endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._token is not None:
            authenticate_client(sock, self._token)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            batches = []
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay from {self._replay_endpoint} within {timeout_s} s")
                frames = sock.recv_multipart()
                _, _topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    if payload:
                        raise EventStreamError(payload.decode(errors="replace"))
                    break
                batches.append((int.from_bytes(seq_bytes, "big"), self._decode_one(payload)))
            self.num_replayed += len(batches)
            return batches
        finally:
            sock.close(linger=0)

    def _decode_one(self, payload: bytes) -> Batch:
        try:
            return self._decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EventStreamError(f"a batch does not decode: {exc}") from None


class TierView:
    """Which blocks a node holds, and in which tier, as its events tell: the index a router keeps of one node.

    Keys are ``(namespace tag, block hash)``; values the tier (``medium``).
    """

    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, bytes], str | None] = {}
        self.num_events: Counter[str] = Counter()

    def apply(self, batch: KVEventBatch) -> None:
        """Fold one batch into the view, in order."""
        blocks = self.blocks
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.num_events["moved" if event.from_medium else "stored"] += len(event.block_hashes)
                for h in event.block_hashes:
                    blocks[(event.namespace, h)] = event.medium
            elif isinstance(event, BlockRemoved):
                self.num_events[event.reason or "removed"] += len(event.block_hashes)
                for h in event.block_hashes:
                    if blocks.get((event.namespace, h), event.medium) == event.medium:
                        blocks.pop((event.namespace, h), None)
            elif isinstance(event, AllBlocksCleared):
                self.num_events[f"cleared_{event.reason or 'all'}"] += 1
                if event.namespace:
                    for key in [k for k in blocks if k[0] == event.namespace]:
                        del blocks[key]
                else:
                    blocks.clear()

    def reset(self) -> None:
        """Forget everything (a gap the replay could not fill)."""
        self.blocks.clear()

    def per_tier(self) -> dict[str, int]:
        """Blocks per tier, ``{medium: count}``."""
        return dict(Counter(str(m) for m in self.blocks.values()))


def wait_for(subscriber: EventSubscriber, view: TierView, condition: Callable[[], bool],
             timeout_s: float = 10.0) -> bool:
    """Apply batches to ``view`` until ``condition()`` holds; whether it did within ``timeout_s`` (tests, tools)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        for _, batch in subscriber.receive(min(left, 0.2)):
            view.apply(batch)
    return True
