"""The node's event publisher: a thread that sends the log's batches on a ZMQ PUB socket and serves replays.

The framing is vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):
each batch is three frames, ``topic``, an 8-byte big-endian sequence number and
the msgpack of a :class:`~kvstore.events.schema.KVEventBatch`. Sequence numbers
start at 0 when the node starts and have no gaps. The replay socket (ROUTER)
takes a start sequence number (8 bytes, big-endian) and streams every buffered
batch from there, then an end marker (``b""``, ``END_SEQ``, ``b""``); a
malformed request gets the end marker with ``b"error: ..."`` as its payload
(``kvstore.events.replay``: bounded, shared, freed).

On a node with bearer tokens (``access``), both sockets require a token
(ZMQ PLAIN, checked by a ZAP handler on this thread) and the node publishes one
stream per set of tenants a token covers, each with its own topic, sequence
numbers and replay buffer; a subscriber gets its token's stream and nothing
else (``kvstore.events.access``). Without tokens there is one stream, of every
event, with the topic ``events.topic``.

Nothing here can block the store: the store only appends to the log, the
publishing socket drops what a subscriber cannot take past its high-water mark
(ZMQ's ``SNDHWM``; the subscriber sees the gap in sequence numbers and replays),
the replay socket sends a peer only what its queue has room for, and every
buffer is bounded. The thread owns every socket (ZMQ sockets are not thread-safe).

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
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import msgspec
import zmq

from kvstore.errors import ConfigError
from kvstore.events.access import ZAP_ENDPOINT, EventAccess, authenticate_server
from kvstore.events.log import EVERY_STREAM, EventLog
from kvstore.events.replay import MAX_REQUEST_BYTES, ReplayLimits, ReplayServer, StreamBuffer
from kvstore.events.schema import KVEventBatch, encoder

logger = logging.getLogger(__name__)

__all__ = ["MAX_REQUEST_BYTES", "EventPublisher", "PublisherSettings", "check_endpoint", "is_local_endpoint",
           "replay_address"]


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    """How the node publishes (``[events]`` in the config, :class:`kvstore.config.EventsConfig`).

    Attributes:
        endpoint: the PUB socket's ZMQ address, bound by the node: ``tcp://127.0.0.1:5557``,
            ``tcp://*:5557``, ``ipc:///run/kvstore/events``; port 0 picks a free one.
        replay_endpoint: the ROUTER socket's address; ``""`` binds the next port
            (``ipc``: the path plus ``.replay``), ``"off"`` serves no replays.
        topic: the first frame of every batch (subscribers filter on its prefix).
        hwm: ZMQ high-water mark of the PUB socket, batches per subscriber (they share the buffer's bytes).
        buffer_steps: batches kept for replay, per stream.
        buffer_bytes: bytes of batches kept for replay, per stream.
        interval_s: seconds a publisher woken by a first event waits for more before it cuts a batch.
        max_batch_events: block changes in one batch at most.
        replay: the bounds of the replay socket (``kvstore.events.replay``).
    """

    endpoint: str
    replay_endpoint: str = ""
    topic: str = "kvstore"
    hwm: int = 100_000
    buffer_steps: int = 10_000
    buffer_bytes: int = 64 << 20
    interval_s: float = 0.01
    max_batch_events: int = 8192
    replay: ReplayLimits = ReplayLimits()


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can be reached only from this host: ``ipc://``, ``inproc://`` or a loopback ``tcp://``."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = urlsplit(endpoint).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def check_endpoint(endpoint: str, *, client_auth: bool, authenticated: bool, allow_remote: bool,
                   name: str = "events.endpoint") -> None:
    """Refuse an endpoint that would publish an authenticating node's events to the network unprotected.

    Events carry namespace tags and block hashes, never tokens or KV bytes, but
    they tell anyone who can read them which prefixes the node holds. A node that
    authenticates its clients in any way (bearer tokens, or client certificates)
    publishes on a non-local endpoint only if its stream is authenticated (it has
    tokens: subscribers send theirs) **and** ``events.allow_remote`` says so
    (ZMQ's PLAIN handshake sends the token in the clear: bring it across the
    network inside something that encrypts). A node that authenticates with
    client certificates alone has no token to check, so its stream stays local
    (``docs/events.md``: the trust model).

    Args:
        endpoint: the address to check.
        client_auth: whether the node authenticates clients (``kvstore.server.admission.authenticates_clients``).
        authenticated: whether the stream's subscribers authenticate (the node has tokens).
        allow_remote: ``events.allow_remote``.
        name: the setting, for the error.

    Raises:
        ConfigError: naming ``name``, for an endpoint that is not ``tcp://``, ``ipc://`` or ``inproc://``, or a
            non-local one on a node that authenticates clients, unless its stream is authenticated and
            ``allow_remote`` is set.
    """
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(name, f"must be a ZMQ tcp://, ipc:// or inproc:// address, got {endpoint!r}")
    if not client_auth or is_local_endpoint(endpoint):
        return
    if not authenticated:
        raise ConfigError(name, f"{endpoint} is reachable from other hosts, and this node authenticates its clients "
                                "(client certificates) but its events cannot be: subscribers authenticate with a "
                                "bearer token, and the node has none. Publish on tcp://127.0.0.1:<port> or "
                                "ipc://<path>, or add tokens (security.auth_tokens) and set events.allow_remote")
    if not allow_remote:
        raise ConfigError(name, f"{endpoint} is reachable from other hosts, and subscribers send their bearer token "
                                "in the clear (ZMQ PLAIN): publish on tcp://127.0.0.1:<port> or ipc://<path> (behind "
                                "a tunnel that encrypts), or set events.allow_remote = true")
    logger.warning("%s = %s: subscribers' bearer tokens cross the network in the clear (events.allow_remote)",
                   name, endpoint)


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
        context: the ZMQ context; the process's shared one when ``None`` (with ``access``, always one of its own:
            its ZAP handler is the context's).
        access: who reads which stream (a node with tokens); ``None``: one stream, of every event, for anyone.
        clock: seconds, monotonic, for the replays' stall bound.

    Attributes:
        endpoint: the bound PUB address (its real port when 0 was asked for).
        replay_endpoint: the bound ROUTER address, ``None`` when off.
        streams: each stream's sequence numbers and replay buffer (stream 0: every event).

    Raises:
        ConfigError: naming ``events.endpoint`` or ``events.replay_endpoint``, if a socket cannot bind.
    """

    def __init__(self, log: EventLog, settings: PublisherSettings, context: zmq.Context | None = None, *,
                 access: EventAccess | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self.settings = settings
        self._wake_recv: int | None = None  # the pipe the log wakes the thread by, once open (until closed)
        self._wake_send: int | None = None
        self._access = access
        self._own_context = access is not None
        self._ctx = zmq.Context() if access is not None else (context or zmq.Context.instance())
        specs = access.streams if access is not None else None
        self.streams = [StreamBuffer(settings.topic.encode(), None, settings.buffer_steps, settings.buffer_bytes)] \
            if specs is None else [StreamBuffer(spec.topic, spec.tenants, settings.buffer_steps, settings.buffer_bytes)
                                   for spec in specs]
        self._stop = threading.Event()
        self.num_batches = 0
        self.num_events = 0
        self.num_overruns = 0
        self._zap: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._replays: ReplayServer | None = None
        self._pub = self._ctx.socket(zmq.XPUB)
        try:
            if access is not None:  # the handler first: a socket that authenticates never runs without it
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
                authenticate_server(self._pub)
                self._pub.setsockopt(zmq.XPUB_MANUAL, 1)  # the node subscribes each connection to its stream
            self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # a full subscriber fails the send: counted (module docstring)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(self._pub, settings.endpoint, "events.endpoint")
            address = replay_address(settings.endpoint, settings.replay_endpoint)
            self.replay_endpoint: str | None = None
            if address is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                if access is not None:
                    authenticate_server(self._replay)
                ReplayServer.configure(self._replay, settings.replay)
                self.replay_endpoint = _bind(self._replay, address, "events.replay_endpoint")
                self._replays = ReplayServer(self._replay, self.streams, access, settings.replay, clock)
        except BaseException:
            self._close_sockets()
            raise
        # the log wakes the thread through a pipe (written from the store's loop only: one os.write, far cheaper
        # there than a ZMQ send), so an idle publisher sleeps instead of polling, and takes no GIL time from the store
        wake_recv, wake_send = os.pipe()
        os.set_blocking(wake_recv, False)
        os.set_blocking(wake_send, False)
        self._wake_recv, self._wake_send = wake_recv, wake_send
        log.set_waker(self._wake)
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control (any thread)

    @property
    def authenticated(self) -> bool:
        """Whether subscribers must authenticate (with a bearer token: ``kvstore.events.access``)."""
        return self._access is not None

    @property
    def access(self) -> EventAccess | None:
        """Who reads which stream (``None``: one stream, for anyone)."""
        return self._access

    def counters(self) -> dict[str, int]:
        """The publisher's and the log's counts: ``batches``, ``events`` (of the stream of every event),
        ``dropped_events``, ``overflows``, ``subscriber_overruns`` (sends that found a subscriber's queue full: it
        lost batches), ``replays``, ``replay_errors``, ``replays_refused`` (too many at once),
        ``replays_abandoned`` (their peer read nothing for ``replay_stall_s``), ``replayed_batches`` (sent to
        replay peers), and three levels: ``queued``
        (block changes not yet taken), ``replays_pending`` (replays under way), ``buffered_bytes`` (of every
        stream's replay buffer). Plain ints: safe to read from any thread."""
        replays = self._replays
        return {"batches": self.num_batches, "events": self.num_events, "dropped_events": self._log.num_dropped,
                "overflows": self._log.num_overflows, "subscriber_overruns": self.num_overruns,
                "replays": replays.num_replays if replays else 0,
                "replay_errors": replays.num_errors if replays else 0,
                "replays_refused": replays.num_refused if replays else 0,
                "replays_abandoned": replays.num_abandoned if replays else 0,
                "replayed_batches": replays.num_batches if replays else 0,
                "queued": len(self._log), "replays_pending": replays.pending if replays else 0,
                "buffered_bytes": sum(s.buffered_bytes for s in self.streams)}

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch of the stream of every event gets (its batches sent so far)."""
        return self.streams[0].next_seq

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
        fd = self._wake_send
        if fd is None:  # closed (a closed fd's number may belong to another file by now)
            return
        try:
            os.write(fd, b"w")
        except OSError:  # the pipe is full (wake-ups are pending already), or closing
            pass

    def _close_sockets(self) -> None:
        self._log.set_waker(None)
        for sock in (self._pub, self._replay, self._zap):
            if sock is not None:
                sock.close(linger=0)
        if self._own_context:
            self._ctx.term()
        fds = (self._wake_send, self._wake_recv)
        self._wake_send = self._wake_recv = None
        for fd in fds:
            if fd is not None:
                os.close(fd)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        pack = encoder()
        idle_ms = 200  # how often an idle publisher checks whether it is closing
        busy_ms = 10  # how often replays whose peers' queues are full try again
        wake = self._wake_recv
        assert wake is not None  # opened before the thread starts, closed after it ends
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)  # (un)subscriptions: read (and, with access, routed)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        replays, zap, access = self._replays, self._zap, self._access
        while True:
            stopping = self._stop.is_set()
            while self._publish(pack):  # everything the log holds, in batches
                pass
            if stopping:
                return
            try:
                if replays is not None:
                    replays.pump()
                ready = dict(poller.poll(busy_ms if replays is not None and replays.pending else idle_ms))
                if zap is not None and access is not None and ready.get(zap):  # a ZAP socket only with access
                    access.answer(zap)
                if ready.get(wake):
                    self._drain_wakes(wake)
                    self._stop.wait(self.settings.interval_s)  # let the batch fill: fewer, larger batches
                if ready.get(self._pub):
                    self._subscriptions()
                if replays is not None and ready.get(self._replay):
                    replays.read_requests()
            except zmq.ZMQError as exc:  # a closed context at interpreter exit: nothing more to do
                logger.warning("events publisher stopped: %s", exc)
                return
            except Exception:  # noqa: BLE001 - the thread must outlive one bad request
                logger.exception("serving a subscriber or a replay failed")

    @staticmethod
    def _drain_wakes(wake: int) -> None:
        try:
            while os.read(wake, 4096):
                pass
        except BlockingIOError:  # empty
            pass

    def _subscriptions(self) -> None:
        """Read the subscribers' (un)subscriptions; with ``access``, subscribe each to its own stream.

        A connection's subscription to a prefix of its stream's topic subscribes
        it to that topic (``XPUB_MANUAL``: the node's subscription applies to the
        connection whose message it just read); any other is ignored, and so are
        unsubscriptions (a subscription ends with its connection).
        """
        pub, access = self._pub, self._access
        while pub.poll(0):
            frame = pub.recv(zmq.NOBLOCK, copy=False)
            if access is None:
                continue
            data = frame.bytes
            if data[:1] != b"\x01":
                continue
            try:
                stream = access.stream_of_name(frame.get("User-Id"))
            except zmq.ZMQError:  # no identity: not authenticated (cannot happen past the handshake)
                continue
            if stream is not None and self.streams[stream].topic.startswith(data[1:]):
                pub.setsockopt(zmq.SUBSCRIBE, self.streams[stream].topic)

    def _publish(self, pack: msgspec.msgpack.Encoder) -> bool:
        """Send one batch of what the log holds to each stream it concerns; whether there was one."""
        routed = self._log.take_routed(self.settings.max_batch_events)
        if not routed:
            return False
        ts = time.time()
        for stream in self.streams:
            tenants = stream.tenants
            events = [event for _, event in routed] if tenants is None else \
                [event for route, event in routed if route == EVERY_STREAM or route in tenants]
            if not events:
                continue
            payload = pack.encode(KVEventBatch(ts=ts, events=events))
            frame = zmq.Frame(payload)  # one message, shared by every send of it, live and replayed
            seq = stream.append(frame, len(payload))
            self._send(stream.topic, seq, frame)
        self.num_batches += 1
        self.num_events += len(routed)
        return True

    def _send(self, topic: bytes, seq: int, frame: zmq.Frame) -> None:
        """Send one batch to the subscribers of ``topic``; a full subscriber is counted and left out."""
        frames = (topic, seq.to_bytes(8, "big"), frame)
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
