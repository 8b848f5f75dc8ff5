"""The node's event publisher: a thread that sends the log's batches on a ZMQ PUB socket and serves replays.

The framing is vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):
each batch is three frames, ``topic``, an 8-byte big-endian sequence number and
the msgpack of a :class:`~kvstore.events.schema.KVEventBatch`. Sequence numbers
start at 0 when the node starts and have no gaps. The replay socket (ROUTER)
takes a start sequence number (8 bytes, big-endian) and streams every buffered
batch from there, then an end marker (``b""``, ``END_SEQ``, ``b""``); a
malformed request gets the end marker with ``b"error: ..."`` as its payload.

Nothing here can block the store: the store only appends to the log, the
publishing socket drops what a subscriber cannot take past its high-water mark
(ZMQ's ``SNDHWM``; the subscriber sees the gap in sequence numbers and replays),
the ROUTER drops replies to a peer that does not read them, and every buffer is
bounded. The thread owns both sockets (ZMQ sockets are not thread-safe).

The publishing socket is an XPUB (a PUB to its subscribers) so that the node
can count those drops, which a PUB drops silently: it is sent to with
``XPUB_NODROP`` on and ``NOBLOCK``, so a send that finds a subscriber's queue
full fails (``zmq.Again``) instead of dropping; the publisher counts it
(``subscriber_overruns``) and sends the batch again with ``XPUB_NODROP`` off, to
the subscribers that have room. ZMQ then leaves the full subscriber out until it
has read its queue, so one overrun stands for one or more batches that
subscriber lost (a lower bound; the subscriber counts its own gaps exactly).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq

from kvstore.errors import ConfigError
from kvstore.events.log import EventLog
from kvstore.events.schema import END_SEQ, KVEventBatch, encoder

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64
"""Largest replay request message the ROUTER accepts; a peer that sends more is disconnected (``ZMQ_MAXMSGSIZE``)."""


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    """How the node publishes (``[events]`` in the config, :class:`kvstore.config.EventsConfig`).

    Attributes:
        endpoint: the PUB socket's ZMQ address, bound by the node: ``tcp://127.0.0.1:5557``,
            ``tcp://*:5557``, ``ipc:///run/kvstore/events``; port 0 picks a free one.
        replay_endpoint: the ROUTER socket's address; ``""`` binds the next port
            (``ipc``: the path plus ``.replay``), ``"off"`` serves no replays.
        topic: the first frame of every batch (subscribers filter on its prefix).
        hwm: ZMQ high-water mark of the PUB socket, batches per subscriber (the replay socket's
            is ``buffer_steps`` + 2: one whole replay; replies share the buffer's bytes).
        buffer_steps: batches kept for replay.
        interval_s: seconds a publisher woken by a first event waits for more before it cuts a batch.
        max_batch_events: block changes in one batch at most.
    """

    endpoint: str
    replay_endpoint: str = ""
    topic: str = "kvstore"
    hwm: int = 100_000
    buffer_steps: int = 10_000
    interval_s: float = 0.01
    max_batch_events: int = 8192


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can be reached only from this host: ``ipc://``, ``inproc://`` or a loopback ``tcp://``."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = urlsplit(endpoint).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def check_endpoint(endpoint: str, *, authenticates: bool, allow_remote: bool, name: str = "events.endpoint") -> None:
    """Refuse an endpoint that would publish an authenticated node's events to the network.

    Events carry namespace tags and block hashes, never tokens or KV bytes, but
    they tell anyone who can connect which prefixes the node holds; ZMQ's PUB
    socket has no authentication here. A node with bearer tokens on publishes
    only on a local endpoint unless ``events.allow_remote`` says otherwise
    (``docs/events.md``: the trust model).

    Raises:
        ConfigError: naming ``name``, for an endpoint that is not ``tcp://``, ``ipc://`` or ``inproc://``, or a
            non-local one on an authenticated node without ``allow_remote``.
    """
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(name, f"must be a ZMQ tcp://, ipc:// or inproc:// address, got {endpoint!r}")
    if authenticates and not allow_remote and not is_local_endpoint(endpoint):
        raise ConfigError(name, f"{endpoint} is reachable from other hosts, and events have no authentication: "
                                "this node has auth on, so publish on tcp://127.0.0.1:<port> or ipc://<path> "
                                "(behind a protected proxy), or set events.allow_remote = true")


def replay_address(endpoint: str, replay_endpoint: str) -> str | None:
    """The replay socket's address: ``replay_endpoint``, or derived from ``endpoint`` when it is ``""``, or
    ``None`` when it is ``"off"``. A tcp port ``N`` gives ``N + 1`` (0 stays 0: a free port)."""
    if replay_endpoint == "off":
        return None
    if replay_endpoint:
        return replay_endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + 1 if int(port) else 0}"
    return endpoint + ".replay"


class EventPublisher:
    """Publishes an :class:`EventLog` on ZMQ from a thread of its own (module docstring).

    Args:
        log: the store's event log.
        settings: endpoints, topic and bounds.
        context: the ZMQ context; the process's shared one when ``None``.

    Attributes:
        endpoint: the bound PUB address (its real port when 0 was asked for).
        replay_endpoint: the bound ROUTER address, ``None`` when off.

    Raises:
        ConfigError: naming ``events.endpoint`` or ``events.replay_endpoint``, if a socket cannot bind.
    """

    def __init__(self, log: EventLog, settings: PublisherSettings, context: zmq.Context | None = None) -> None:
        self._log = log
        self.settings = settings
        self._topic = settings.topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._next_seq = 0
        self._stop = threading.Event()
        self.num_batches = 0
        self.num_events = 0
        self.num_overruns = 0
        self.num_replays = 0
        self.num_replay_errors = 0
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber fails the send: counted (module docstring)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _bind(self._pub, settings.endpoint, "events.endpoint")
            address = replay_address(settings.endpoint, settings.replay_endpoint)
            self.replay_endpoint: str | None = None
            if address is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, settings.buffer_steps + 2)  # a whole replay and its end
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, address, "events.replay_endpoint")
        except BaseException:
            self._close_sockets()
            raise
        # the log wakes the thread through a pipe (written from the store's loop only: one os.write, far cheaper
        # there than a ZMQ send), so an idle publisher sleeps instead of polling, and takes no GIL time from the store
        self._wake_recv, self._wake_send = os.pipe()
        os.set_blocking(self._wake_recv, False)
        os.set_blocking(self._wake_send, False)
        log.set_waker(self._wake)
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control (any thread)

    def counters(self) -> dict[str, int]:
        """The publisher's and the log's counts: ``batches``, ``events``, ``dropped_events``, ``overflows``,
        ``subscriber_overruns`` (sends that found a subscriber's queue full: it lost batches), ``replays``,
        ``replay_errors``, ``queued`` (block changes not yet taken)."""
        return {"batches": self.num_batches, "events": self.num_events, "dropped_events": self._log.num_dropped,
                "overflows": self._log.num_overflows, "subscriber_overruns": self.num_overruns,
                "replays": self.num_replays, "replay_errors": self.num_replay_errors, "queued": len(self._log)}

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (the number of batches sent so far)."""
        return self._next_seq

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what the log still holds, stop the thread and close the sockets (waits up to ``timeout_s``)."""
        self._stop.set()
        self._wake()  # (a pipe's write is safe from any thread)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the events publisher did not stop within %.1f s", timeout_s)
            return
        self._close_sockets()

    def _wake(self) -> None:
        fd = getattr(self, "_wake_send", None)
        if fd is None:  # closed (a closed fd's number may belong to another file by now)
            return
        try:
            os.write(fd, b"w")
        except OSError:  # the pipe is full (wake-ups are pending already), or closing
            pass

    def _close_sockets(self) -> None:
        self._log.set_waker(None)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        fds = (getattr(self, "_wake_send", None), getattr(self, "_wake_recv", None))
        self._wake_send = self._wake_recv = None  # type: ignore[assignment]
        for fd in fds:
            if fd is not None:
                os.close(fd)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        pack = encoder()
        idle_ms = 200  # how often an idle publisher checks whether it is closing
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)  # (un)subscriptions, read and dropped: they must not pile up
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            while self._publish(pack):  # everything the log holds, in batches
                pass
            if stopping:
                return
            try:
                ready = dict(poller.poll(idle_ms))
                if ready.get(self._wake_recv):
                    self._drain_wakes()
                    self._stop.wait(self.settings.interval_s)  # let the batch fill: fewer, larger batches
                if ready.get(self._pub):
                    while self._pub.poll(0):
                        self._pub.recv(zmq.NOBLOCK)
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
            except zmq.ZMQError as exc:  # a closed context at interpreter exit: nothing more to do
                logger.warning("events publisher stopped: %s", exc)
                return
            except Exception:  # noqa: BLE001 - the thread must outlive one bad replay
                logger.exception("serving a replay failed")

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_recv, 4096):
                pass
        except BlockingIOError:  # empty
            pass

    def _publish(self, pack: object) -> bool:
        """Send one batch of what the log holds; whether there was one."""
        events = self._log.take(self.settings.max_batch_events)
        if not events:
            return False
        payload = pack.encode(KVEventBatch(ts=time.time(), events=events))  # type: ignore[attr-defined]
        seq = self._next_seq
        self._next_seq = seq + 1
        self._buffer.append((seq, payload))
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a subscriber's queue is full: count it, send to the others (module docstring)
            self.num_overruns += 1
            self._pub.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # cannot happen without XPUB_NODROP; the batch stays in the replay buffer
                pass
            finally:
                self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.num_batches += 1
        self.num_events += len(events)
        return True

    def _serve_replay(self) -> None:
        """Answer one replay request: ``[identity, (b""), start_seq]`` -> the batches from ``start_seq``, then the end."""
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        identity, rest = frames[0], frames[1:]
        envelope = [identity, b""] if len(rest) == 2 and rest[0] == b"" else [identity]
        payload = rest[-1] if len(rest) in (1, 2) else None
        if payload is None or len(payload) != 8 or (len(rest) == 2 and rest[0] != b""):
            self.num_replay_errors += 1
            message = (f"error: a replay request is one frame of 8 bytes (the start sequence number, big-endian); "
                       f"got {len(rest)} frame(s) of {[len(f) for f in rest[:4]]} bytes").encode()
            self._replay.send_multipart([*envelope, b"", END_SEQ, message], flags=zmq.NOBLOCK)
            return
        start = int.from_bytes(payload, "big")
        self.num_replays += 1
        for seq, batch in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([*envelope, self._topic, seq.to_bytes(8, "big"), batch],
                                            flags=zmq.NOBLOCK, copy=False)
        self._replay.send_multipart([*envelope, b"", END_SEQ, b""], flags=zmq.NOBLOCK)


def _bind(sock: zmq.Socket, endpoint: str, name: str) -> str:
    """Bind ``sock``; returns the bound address (the real port of a tcp port 0).

    Raises:
        ConfigError: naming ``name``, if the address cannot be bound.
    """
    address = endpoint
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        address = endpoint[:-2] + ":*"  # ZMQ's spelling of "any free port"
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ConfigError(name, f"cannot bind {endpoint}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound.replace("tcp://0.0.0.0:", "tcp://*:") if endpoint.startswith("tcp://*") else bound
