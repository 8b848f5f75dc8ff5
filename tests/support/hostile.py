"""Hostile gRPC clients of a real ``kvstore serve`` node, and the node's resident memory while they run.

Shared by ``tests/security/test_hostile_clients.py`` (bounded counts, bounds on
the figures) and ``benchmarks/bench_hostile.py`` (larger counts, figures
recorded). Every attack sends raw requests over channels of its own, as a
client that does not use kvstore's library would, and returns the status codes
the node answered with.

The node's resident set (``VmRSS`` of ``/proc/<pid>/status``) is read before an
attack, sampled while it runs (its peak), and read once the attackers have
gone; a node keeps some freed heap for reuse by design
(``kvstore.server.process.tune_malloc``), so "after" is the figure that shows
whether anything stayed pinned.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc

from kvstore.keys import HashAlgorithm, Namespace
from kvstore.security import bearer_metadata
from kvstore.wire import namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (``VmRSS``), bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class Figures:
    """One attack's outcome: status codes answered, and the node's RSS before, at its peak during, and after, bytes."""

    name: str
    calls: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    seconds: float = 0.0

    def row(self) -> dict[str, object]:
        """The figures as one JSON-able row, RSS in MiB."""
        return {"attack": self.name, "calls": self.calls, "codes": dict(self.codes), "seconds": round(self.seconds, 2),
                "rss_before_mib": round(self.rss_before / MiB, 1), "rss_peak_mib": round(self.rss_peak / MiB, 1),
                "rss_after_mib": round(self.rss_after / MiB, 1)}


class _Sampler:
    """Samples a process's RSS every ``interval_s`` in a thread, keeping the peak (a sampler, not an ordering)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes(self.pid))


def _channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1),
                                                  ("grpc.max_send_message_length", 8 * MiB),
                                                  ("grpc.max_receive_message_length", 8 * MiB)])


def _code_of(call: Callable[[], object]) -> str:
    try:
        result = call()
        if isinstance(result, Iterator):
            collections.deque(result, maxlen=0)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


class Attacks:
    """Attacks on one node (``target``, process ``pid``); each returns its :class:`Figures`.

    Args:
        target: the node's ``host:port``.
        pid: the node's process id, for its RSS.
        token: the bearer token attackers send (``None``: none).
        threads: attackers calling at once.
    """

    def __init__(self, target: str, pid: int, *, token: str | None = None, threads: int = 8) -> None:
        self.target = target
        self.pid = pid
        self.metadata = bearer_metadata(token) if token is not None else ()
        self.threads = threads

    def _run(self, name: str, calls: list[Callable[[pb_grpc.KVStoreStub], object]]) -> Figures:
        figures = Figures(name, calls=len(calls), rss_before=rss_bytes(self.pid))
        sampler = _Sampler(self.pid)
        started = time.monotonic()
        channels = [_channel(self.target) for _ in range(self.threads)]
        stubs = [pb_grpc.KVStoreStub(channel) for channel in channels]
        try:
            with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
                for code in pool.map(lambda i: _code_of(lambda: calls[i](stubs[i % self.threads])), range(len(calls))):
                    figures.codes[code] += 1
        finally:
            for channel in channels:
                channel.close()
        figures.seconds = time.monotonic() - started
        figures.rss_peak = sampler.stop()
        figures.rss_after = rss_bytes(self.pid)
        return figures

    def oversized_namespaces(self, count: int, model_bytes: int = 4_000_000) -> Figures:
        """Lookups whose namespaces each carry a distinct ``model_bytes``-long model string (the issue's 4 MB)."""
        def call(i: int) -> Callable[[pb_grpc.KVStoreStub], object]:
            def lookup(stub: pb_grpc.KVStoreStub) -> object:
                message = namespace_to_pb(Namespace(model="m", hash_algorithm=HashAlgorithm.SHA256))
                message.model = f"{i:08d}".ljust(model_bytes, "x")
                return stub.Lookup(pb.LookupRequest(namespace=message, block_hashes=[b"\0" * 32]),
                                   metadata=self.metadata, timeout=60)
            return lookup
        return self._run(f"{count} Lookups, distinct {model_bytes / 1e6:.0f} MB models", [call(i) for i in range(count)])

    def distinct_namespaces(self, count: int, cache_salt: str = "") -> Figures:
        """Lookups in ``count`` distinct valid namespaces, each field near its limit (models of 500 bytes)."""
        def call(i: int) -> Callable[[pb_grpc.KVStoreStub], object]:
            message = namespace_to_pb(Namespace(model=f"{i:08d}".ljust(500, "m"), revision="r" * 120,
                                                adapter="a" * 250, cache_salt=cache_salt,
                                                hash_algorithm=HashAlgorithm.SHA256))
            return lambda stub: stub.Lookup(pb.LookupRequest(namespace=message, block_hashes=[b"\0" * 32]),
                                            metadata=self.metadata, timeout=60)
        return self._run(f"{count} Lookups, distinct namespaces of ~900 bytes", [call(i) for i in range(count)])

    def stalled_readers(self, namespace: Namespace, block_hashes: list[bytes], count: int, hold_s: float) -> Figures:
        """``count`` Gets of a cached prefix whose callers read nothing for ``hold_s`` seconds, then go away."""
        figures = Figures(f"{count} stalled Gets of {len(block_hashes)} blocks, held {hold_s:g} s",
                          calls=count, rss_before=rss_bytes(self.pid))
        sampler = _Sampler(self.pid)
        started = time.monotonic()
        channel = _channel(self.target)
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(namespace=namespace_to_pb(namespace), block_hashes=block_hashes)
        streams = [stub.Get(request, metadata=self.metadata, timeout=600) for _ in range(count)]
        stop = threading.Event()
        stop.wait(hold_s)  # the readers stall: nothing is read from the streams meanwhile
        for stream in streams:
            figures.codes[_first_message_code(stream)] += 1
            stream.cancel()
        channel.close()
        figures.seconds = time.monotonic() - started
        figures.rss_peak = sampler.stop()
        figures.rss_after = rss_bytes(self.pid)
        return figures


def _first_message_code(stream: grpc.Future) -> str:
    """What a stalled stream got: OK once its first message can be read, else its error code."""
    try:
        next(stream)  # type: ignore[call-overload]
    except grpc.RpcError as exc:
        return exc.code().name
    except StopIteration:
        return "OK"
    return "OK"
