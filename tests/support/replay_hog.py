"""A replay hog: peers of a node's KV event replay socket that ask for the buffered history again and again and
never read what they are sent, and the node's resident memory while they do (issue 39, item 6).

Shared by ``tests/security/test_replay_memory.py`` (bounded counts, a bound on the figures) and the soak
(``benchmarks/soak.py``, one round now and then). Each peer is a raw ZMQ DEALER, as a client that does not use
kvstore's library would be, with the smallest receive buffer the kernel allows and a receive queue of one
message, so what the node sends it piles up on the node's side. A request is vLLM's: the start sequence number,
8 bytes, big-endian (0: everything buffered).

Usage in a test (a round; ``until`` says when the node has taken every request, e.g. from its ``/metrics``)::

    hog = ReplayHog(replay_endpoint, peers=2, requests_per_peer=20)
    figures = hog.attack(node_pid, until=lambda: replays_counted() >= hog.num_requests)

and in the soak, where time may pass (nodes started with ``KVSTORE_EVENTS__ENDPOINT=tcp://127.0.0.1:<port>``,
the replay socket on the next port), one round of the hostile thread::

    figures = ReplayHog(f"tcp://127.0.0.1:{port + 1}", peers=4, requests_per_peer=50).attack_for(node.pid, 2.0)
    self._count("replay hog", figures.codes)
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from tests.support.hostile import Figures, rss_bytes


class ReplayHog:
    """``peers`` replay peers, each sending ``requests_per_peer`` requests from ``start_seq`` and reading nothing.

    Args:
        replay_endpoint: the node's replay ROUTER (``events.replay_endpoint``).
        peers: peers (connections), each a DEALER of its own.
        requests_per_peer: requests each peer sends, at once.
        start_seq: the sequence number each request starts from.
        token: bearer token for a node with tokens (``None``: none).
        context: the ZMQ context; a new one when ``None`` (closed by :meth:`close`).
    """

    def __init__(self, replay_endpoint: str, *, peers: int = 2, requests_per_peer: int = 200, start_seq: int = 0,
                 token: str | None = None, context: zmq.Context | None = None) -> None:
        self.replay_endpoint = replay_endpoint
        self.peers = peers
        self.requests_per_peer = requests_per_peer
        self.start_seq = start_seq
        self.token = token
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self.num_sent = 0

    @property
    def num_requests(self) -> int:
        """Requests the hog sends in all."""
        return self.peers * self.requests_per_peer

    def start(self) -> ReplayHog:
        """Connect the peers and send every request (they are queued on the way: nothing waits for the node)."""
        request = [b"", self.start_seq.to_bytes(8, "big")]
        for _ in range(self.peers):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)  # the kernel rounds it up to its minimum
            sock.setsockopt(zmq.SNDHWM, self.requests_per_peer + 1)
            if self.token is not None:
                from kvstore.events.access import authenticate_client

                authenticate_client(sock, self.token)
            sock.connect(self.replay_endpoint)
            self._sockets.append(sock)
        for sock in self._sockets:
            for _ in range(self.requests_per_peer):
                sock.send_multipart(request)  # queued until connected (SNDHWM has room for them all)
                self.num_sent += 1
        return self

    def close(self) -> None:
        """The peers go: their sockets close at once, with nothing read."""
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        if self._own_context:
            self._ctx.term()

    def attack(self, pid: int, *, until: Callable[[], bool], timeout_s: float = 60.0,
               after: Callable[[], bool] | None = None) -> Figures:
        """One round against the node of process ``pid``: its RSS before, at its peak and after the peers went.

        Args:
            pid: the node's process id.
            until: whether the node has taken the requests (polled, RSS sampled each time, up to ``timeout_s``).
            timeout_s: bound of each wait, seconds.
            after: once the peers have gone, whether the node has let them go (e.g. no replay pending); RSS
                "after" is read then. ``None``: at once.

        Raises:
            TimeoutError: if ``until`` (or ``after``) is not true within ``timeout_s``.
        """
        figures = Figures(f"replay hog: {self.peers} peers x {self.requests_per_peer} requests, never read",
                          calls=self.num_requests, rss_before=rss_bytes(pid))
        started = time.monotonic()
        self.start()
        try:
            figures.rss_peak = self._sample_until(pid, until, timeout_s, figures.rss_before)
        finally:
            self.close()
        if after is not None:
            figures.rss_peak = self._sample_until(pid, after, timeout_s, figures.rss_peak)
        figures.rss_after = rss_bytes(pid)
        figures.codes["requests sent"] = self.num_sent
        figures.seconds = time.monotonic() - started
        return figures

    def attack_for(self, pid: int, hold_s: float, sample_s: float = 0.05) -> Figures:
        """One round for a benchmark: the peers send their requests, read nothing for ``hold_s`` seconds, then go;
        the node's RSS before, at its peak (sampled every ``sample_s``) and once they have gone.

        ``codes`` counts the requests sent (``requests sent``) and the peers that had anything queued for them
        when they went (``peers sent batches``), as a soak's tally of a hostile client's calls.
        """
        figures = Figures(f"replay hog: {self.peers} peers x {self.requests_per_peer} requests, held {hold_s:g} s",
                          calls=self.num_requests, rss_before=rss_bytes(pid))
        started = time.monotonic()
        self.start()
        peak = figures.rss_before
        try:
            deadline = started + hold_s
            while time.monotonic() < deadline:  # a benchmark's hold, not a test's ordering
                peak = max(peak, rss_bytes(pid))
                time.sleep(sample_s)
            figures.codes["peers sent batches"] = sum(1 for sock in self._sockets if sock.poll(0))
        finally:
            self.close()
        figures.rss_peak = max(peak, rss_bytes(pid))
        figures.rss_after = rss_bytes(pid)
        figures.codes["requests sent"] = self.num_sent
        figures.seconds = time.monotonic() - started
        return figures

    @staticmethod
    def _sample_until(pid: int, condition: Callable[[], bool], timeout_s: float, peak: int) -> int:
        """Poll ``condition`` (RSS sampled at each poll); returns the peak RSS seen. A bounded wait, no ordering."""
        deadline = time.monotonic() + timeout_s
        while True:
            peak = max(peak, rss_bytes(pid))
            if condition():
                return max(peak, rss_bytes(pid))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node did not get there within {timeout_s} s")
            time.sleep(0.02)
