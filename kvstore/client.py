"""Clients of ``kvstore serve`` nodes: ``KVStoreClient`` (synchronous) and ``AsyncKVStoreClient`` (asyncio).

Both implement :class:`kvstore.api.BlockClient`, so a connector takes either
or the embedded store, and both are written once: every call's requests, its
merge over nodes, the retries (:class:`Retry`, :class:`Backoff`), the fan-out
and the nodes' membership are one piece of code with no I/O (``_Client``),
which yields the I/O it needs; each client is a thin transport that performs
it, in threads or on an asyncio loop, as redis-py shares its commands between
its two clients. Every call has a deadline (``timeout_s``, covering all
its retries and, with several nodes, all of its fan-out), the number of calls
in flight is bounded (``max_inflight``), and calls that are safe to repeat are
retried on UNAVAILABLE with exponential backoff and full jitter (the AWS
Architecture Blog's "Exponential Backoff and Jitter"). Status errors are raised
as kvstore's typed errors through the one mapping in ``kvstore.status``.

Retried calls: lookup, get, delete, clear, stats, health and put. Put is
idempotent because a block hash names its content (the chained hash of the
prefix in the namespace) and a put of a key already stored is a no-op; a put
retried after a lost reply may therefore report fewer blocks as newly stored.

Several nodes. ``KVStoreClient(["a:50051", "b:50051", "c:50051"])`` (or
``targets=[...]``) spreads blocks over the nodes by rendezvous hashing
(:mod:`kvstore.routing`: ``owner(h) = argmax_n XXH3_64(h, seed=XXH3_64(node id))``,
Thaler & Ravishankar 1998; the node id is the target string, so every client
must list a node under the same name):

* lookup asks every node that owns some of the hashes, in parallel, for its own
  hashes in order, and merges the answers into the longest prefix (block ``i``
  is a hit iff its position in its owner's sub-list is below that owner's
  prefix; the prefix ends at the first miss);
* get fetches from the owners in parallel and merges in order, cutting at the
  first miss; put sends each block to its owner, delete to the owners; clear
  goes to every node and returns the sum; stats returns the tier-by-tier sum
  over the nodes that answered (:meth:`KVStoreClient.node_stats` gives each node's).

A node that cannot be reached (UNAVAILABLE or DEADLINE_EXCEEDED after the
retries) is marked down and the call goes on without it: its blocks are misses,
puts, deletes and clears to it are skipped, and no error reaches the caller.
Other errors (a malformed request, RESOURCE_EXHAUSTED, an auth failure) still
raise, as with one node. A down node's blocks are not re-routed, so a node that
flaps moves no keys. The node stays down for a backoff (``down_backoff_s``,
doubling per failure up to ``max_down_backoff_s``); after it, the next call
starts a ``grpc.health.v1`` probe in the background, and a SERVING answer
brings the node back. Health is thus probed lazily, by the client's own
traffic; a client that makes no calls probes nothing.

With a single target the client behaves as before: a failed call raises (after
its retries). Credentials, metadata and channel options apply to every target.

Fork safety: gRPC channels must not cross ``fork``. Each client remembers the
process id that opened its channel; in a forked child the first call opens a
fresh channel (with its own subchannel pool, so no connection of the parent is
reused) and leaves the parent's untouched. gRPC's core fork handling must be
on, which it is unless ``GRPC_ENABLE_FORK_SUPPORT`` is set false; then a child
gets :class:`UnavailableError` at once instead of a hang. The worker threads of
a synchronous client of several nodes are likewise started afresh in a child.

Example::

    from kvstore import Namespace, hash_blocks
    from kvstore.client import KVStoreClient

    with KVStoreClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        ns = Namespace(model="my-llama", dtype="float16", block_size=16)
        hashes = hash_blocks(ns, token_ids)
        client.put(ns, hashes, tensors)            # [L, 2, H, 16, D] each
        hit = client.lookup(ns, hashes).num_blocks
        tensors = client.get_tensors(ns, hashes[:hit])
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import numbers
import operator
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generator, Iterator, NamedTuple, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.api import Block, Buffer, LookupResult, StoreStats, TierStats, merge_tier_status
from kvstore.blockcopy import Copied, blocks_for_put, check_destinations, copy_into_destinations
from kvstore.codec import decode_block, encode_blocks
from kvstore.encoding import encode_for_put
from kvstore.errors import DestinationMismatchError, InvalidArgumentError, KVStoreError, UnavailableError
from kvstore.keys import BlockHash, Namespace, check_block_hashes
from kvstore.policy import MAX_PRIORITY, MIN_PRIORITY
from kvstore.security import call_metadata
from kvstore.routing import (
    DEFAULT_DOWN_BACKOFF_S,
    DEFAULT_MAX_DOWN_BACKOFF_S,
    Membership,
    NodeStatus,
    Partition,
    RendezvousRouter,
)
from kvstore.shm.link import BlockLease, SharedMemoryLink, SharedSession, UseGrpc
from kvstore.status import RETRYABLE_CODES, DeadlineExceededError, error_of
from kvstore.wire import (
    GET_METHOD,
    PUT_METHOD,
    BlockAssembler,
    channel_options,
    sync_client_channel_options,
    cached_namespace_pb,
    chunk_bytes_for,
    encode_get_request,
    identity,
    lookup_from_pb,
    put_requests,
    request_with_hashes,
    stats_from_pb,
)
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_INFLIGHT = 64
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.05
DEFAULT_MAX_BACKOFF_S = 2.0
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
RECONNECT_BACKOFF_MS = (100, 2000)
"""First and largest pause between reconnection attempts of a channel, milliseconds."""
CONNECT_TIMEOUT_MS = 1000
"""Shortest time one connection attempt may take (gRPC's ``min_reconnect_backoff_ms``), milliseconds."""
DEFAULT_PROBE_TIMEOUT_S = 1.0
"""Deadline of one health probe of a down node, seconds."""
MAX_TIMEOUT_S = 1e9
"""Longest deadline of a call, seconds (about 31 years): gRPC fails a call at once whose deadline,
in nanoseconds since the epoch, overflows 64 bits (from about 7.4e9 s from now)."""
_FALSE = ("0", "false", "no", "off")
_MAX_WORKERS = 256
"""Most worker threads of a synchronous client of several nodes (created as calls need them)."""
_GRACE_S = 0.5
"""How long past a call's deadline its caller waits for a node's part to finish, seconds (each part has the deadline itself)."""
_NO_BLOCK_LIMIT = sys.maxsize


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter, ``uniform(0, min(cap, base * 2^attempt))``."""
    return random.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 64)))  # 2.0 ** 1024 overflows


class TargetChannel:
    """The gRPC channel to one target and its stubs, reopened lazily in a forked child.

    One instance per server address; a client of several nodes keeps one each.

    Args:
        target: ``host:port`` (any gRPC target string, e.g. ``unix:/path``).
        aio: open a ``grpc.aio`` channel (for :class:`AsyncKVStoreClient`).
        max_message_bytes: largest message sent or received, bytes (match the server's).
        credentials: channel credentials for TLS; ``None`` for plaintext.
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        aio: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.aio = aio
        self.max_message_bytes = max_message_bytes
        self._credentials = credentials
        self._options = [
            *(channel_options(max_message_bytes) if aio else sync_client_channel_options(max_message_bytes)),
            ("grpc.use_local_subchannel_pool", 1),  # a child's channel must not reuse the parent's connections
            # reconnect soon after a node restarts (gRPC's default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
            *options,
        ]
        self._pid = -1
        self._channel: Any = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._get: Any = None
        self._put: Any = None
        self._orphans: list[Any] = []  # parents' channels, kept alive and untouched in a forked child
        self._closed = False

    def _open(self) -> None:
        pid = os.getpid()
        if self._channel is not None:
            fork_support = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
            if fork_support is not None and fork_support.strip().lower() in _FALSE:
                raise UnavailableError(
                    f"this kvstore client was opened in process {self._pid} and cannot be used in forked "
                    f"child {pid} because GRPC_ENABLE_FORK_SUPPORT is off; open a new client in the child"
                )
            logger.debug("process %s forked from %s: opening a fresh channel to %s", pid, self._pid, self.target)
            self._orphans.append(self._channel)
        grpc_mod: Any = grpc.aio if self.aio else grpc
        if self._credentials is not None:
            channel = grpc_mod.secure_channel(self.target, self._credentials, options=self._options)
        else:
            channel = grpc_mod.insecure_channel(self.target, options=self._options)
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        # the data path: block bytes are (de)serialized by kvstore.wire, not copied through protobuf
        self._get = channel.unary_stream(GET_METHOD, request_serializer=identity, response_deserializer=identity)
        self._put = channel.stream_unary(PUT_METHOD, request_serializer=identity,
                                         response_deserializer=pb.PutResponse.FromString)
        self._pid = pid

    def _check(self) -> None:
        if self._closed:
            raise UnavailableError(f"the client of {self.target} is closed")
        if self._pid != os.getpid():
            self._open()

    @property
    def stub(self) -> pb_grpc.KVStoreStub:
        """The ``kvstore.v1.KVStore`` stub of this process's channel.

        Raises:
            UnavailableError: if the client is closed, or used in a forked child
                with gRPC fork support turned off.
        """
        self._check()
        assert self._stub is not None
        return self._stub

    @property
    def get_call(self) -> Any:
        """The Get multicallable of the data path: serialized ``GetRequest`` in, serialized ``BlockChunk`` s out."""
        self._check()
        return self._get

    @property
    def put_call(self) -> Any:
        """The Put multicallable of the data path: serialized ``PutRequest`` s in, ``PutResponse`` out."""
        self._check()
        return self._put

    @property
    def health_stub(self) -> health_pb2_grpc.HealthStub:
        """The ``grpc.health.v1.Health`` stub of this process's channel (same errors as :attr:`stub`)."""
        self._check()
        assert self._health is not None
        return self._health

    def close(self) -> None:
        """Close a synchronous channel opened by this process; idempotent."""
        self._closed = True
        if self._channel is not None and self._pid == os.getpid() and not self.aio:
            self._channel.close()
        self._channel = None

    async def aclose(self) -> None:
        """Close an asyncio channel opened by this process; idempotent."""
        self._closed = True
        if self._channel is not None and self._pid == os.getpid():
            await self._channel.close()
        self._channel = None


def _raise_typed(exc: grpc.RpcError) -> None:
    raise error_of(exc.code(), exc.details()) from None  # type: ignore[attr-defined]


_PLAIN_HASH_TYPES = frozenset((bytes, bytearray))
"""Hash types whose ``len`` is their byte length (a ``memoryview``'s need not be)."""


def _check_put(
    namespace: Namespace,
    block_hashes: Sequence[BlockHash],
    blocks: Sequence[Block],
    priority: int | None,
    retention_s: float | None,
) -> tuple[int | None, float | None]:
    """Check the arguments of a put before any call starts, as the node would (``TieredStore._meta``).

    A bad argument must raise here: the Put messages are built lazily on
    gRPC's side of the call, where an error is lost (sync: UNKNOWN; asyncio: a
    cancellation).

    Args:
        namespace: namespace of the blocks.
        block_hashes: one hash per block, each bytes-like of ``namespace.hash_bytes`` bytes.
        blocks: the blocks, as many as hashes.
        priority: an integer in ``[0, 100]`` (numpy integers too, not ``bool``), or ``None``.
        retention_s: a real number of seconds ``>= 0`` (``inf`` too, not NaN), or ``None``.

    Returns:
        ``(priority, retention_s)`` as ``int`` and ``float`` (``None`` stays ``None``).

    Raises:
        InvalidArgumentError: on a namespace that is not a :class:`Namespace`, a count
            mismatch, a hash that is not bytes-like or of the wrong length, or a bad
            priority or retention_s.
    """
    if not isinstance(namespace, Namespace):
        raise InvalidArgumentError(f"namespace must be a kvstore Namespace, got {type(namespace).__name__}")
    if len(block_hashes) != len(blocks):
        raise InvalidArgumentError(f"{len(block_hashes)} hashes but {len(blocks)} blocks")
    width = namespace.hash_bytes
    plain = set(map(type, block_hashes)) <= _PLAIN_HASH_TYPES and set(map(len, block_hashes)) <= {width}
    for index, block_hash in enumerate(() if plain else block_hashes):  # C loops above: 1,024 hashes in ~0.1 ms
        try:
            nbytes = memoryview(block_hash).nbytes
        except TypeError:
            raise InvalidArgumentError(
                f"block hash {index}: expected bytes, bytearray or memoryview, got {type(block_hash).__name__}"
            ) from None
        if nbytes != width:
            raise InvalidArgumentError(f"block hash {index}: must be {width} bytes for "
                                       f"{namespace.hash_algorithm.value}, got {nbytes}")
    if priority is not None:
        try:
            value = None if isinstance(priority, bool) else operator.index(priority)
        except TypeError:
            value = None
        if value is None or not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise InvalidArgumentError(
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}"
            )
        priority = value
    if retention_s is not None:
        try:
            seconds = float(retention_s) if not isinstance(retention_s, (str, bytes, bytearray)) else math.nan
        except (TypeError, ValueError, OverflowError):
            seconds = math.nan
        if not seconds >= 0:  # also NaN; inf is kept for good
            raise InvalidArgumentError(f"retention_s must be a number of seconds >= 0, got {retention_s!r}")
        retention_s = seconds
    return priority, retention_s


def _seconds(name: str, value: float, *, minimum_s: float = 0.0, open_minimum: bool = False,
             maximum_s: float = math.inf) -> float:
    """``value`` as a float if it is a finite number of seconds in ``[minimum_s, maximum_s]``.

    Args:
        name: the argument's name, for the error message.
        value: the argument.
        minimum_s: least value, seconds.
        open_minimum: ``minimum_s`` itself is out of range (``> minimum_s``).
        maximum_s: greatest value, seconds.

    Raises:
        InvalidArgumentError: otherwise (also on a ``bool`` or a string), naming the argument.
    """
    try:
        seconds = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    above = seconds > minimum_s if open_minimum else seconds >= minimum_s
    if not (math.isfinite(seconds) and above and seconds <= maximum_s):
        bound = f"{'>' if open_minimum else '>='} {minimum_s:g}" + (
            f" and <= {maximum_s:g}" if math.isfinite(maximum_s) else "")
        raise InvalidArgumentError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def _count(name: str, value: int, minimum: int) -> int:
    """``value`` if it is an integer (not ``bool``) ``>= minimum``.

    Raises:
        InvalidArgumentError: otherwise, naming the argument ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _Settings(NamedTuple):
    """The checked settings shared by both clients (durations in seconds)."""

    timeout_s: float
    max_inflight: int
    retries: int
    backoff_s: float
    max_backoff_s: float
    probe_timeout_s: float
    down_backoff_s: float
    max_down_backoff_s: float

    @classmethod
    def check(cls, *, timeout_s: float, max_inflight: int, retries: int, backoff_s: float, max_backoff_s: float,
              probe_timeout_s: float, down_backoff_s: float, max_down_backoff_s: float) -> _Settings:
        """The settings of a client's constructor, checked.

        Raises:
            InvalidArgumentError: naming the first bad one: a deadline (``timeout_s``,
                ``probe_timeout_s``) that is not a number in ``(0, MAX_TIMEOUT_S]``, a backoff
                that is not a finite number >= 0 (``max_down_backoff_s`` also not below
                ``down_backoff_s``), or a count that is not an integer (``max_inflight`` >= 1,
                ``retries`` >= 0).
        """
        down_backoff_s = _seconds("down_backoff_s", down_backoff_s)
        return cls(
            timeout_s=_seconds("timeout_s", timeout_s, open_minimum=True, maximum_s=MAX_TIMEOUT_S),
            max_inflight=_count("max_inflight", max_inflight, 1),
            retries=_count("retries", retries, 0),
            backoff_s=_seconds("backoff_s", backoff_s),
            max_backoff_s=_seconds("max_backoff_s", max_backoff_s),
            probe_timeout_s=_seconds("probe_timeout_s", probe_timeout_s, open_minimum=True, maximum_s=MAX_TIMEOUT_S),
            down_backoff_s=down_backoff_s,
            max_down_backoff_s=_seconds("max_down_backoff_s", max_down_backoff_s, minimum_s=down_backoff_s),
        )


class _RequestStream:
    """The serialized messages of a Put, remembering an error raised while making them.

    gRPC pulls a request iterator on its own side of the call and reports an
    error raised there only as UNKNOWN (sync) or a cancellation of the call
    (asyncio); the caller gets the real error back from :meth:`raise_error`.

    Args:
        messages: the serialized messages (:func:`kvstore.wire.put_requests`).
    """

    def __init__(self, messages: Iterator[bytes]) -> None:
        self._messages = messages
        self.error: Exception | None = None

    def __iter__(self) -> _RequestStream:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._messages)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise

    def raise_error(self) -> None:
        """Raise the error of making the messages, if there was one.

        Raises:
            KVStoreError: that error, if it was one of kvstore's.
            InvalidArgumentError: for any other error (a request that cannot be serialized).
        """
        if isinstance(self.error, KVStoreError):
            raise self.error
        if self.error is not None:
            raise InvalidArgumentError(f"cannot serialize the Put request: {self.error!r}") from self.error


def _assembler(num_blocks: int) -> BlockAssembler:
    return BlockAssembler(_NO_BLOCK_LIMIT, max(1, num_blocks), copy=False)  # one-chunk blocks stay views


def resolve_targets(target: str | Sequence[str] | None, targets: Sequence[str] | None) -> tuple[str, ...]:
    """The node targets of a client from its ``target`` and ``targets`` arguments, duplicates dropped.

    Args:
        target: one ``host:port``, or a sequence of them.
        targets: a sequence of ``host:port`` (give this or ``target``, not both).

    Returns:
        The targets in the order given, each once (a node listed twice is one node).

    Raises:
        InvalidArgumentError: if both or neither are given, or no target, or an empty one.
    """
    if (target is None) == (targets is None):
        raise InvalidArgumentError("give either target or targets")
    given = target if target is not None else targets
    listed = [given] if isinstance(given, str) else list(given or ())
    if not listed or not all(isinstance(t, str) and t for t in listed):
        raise InvalidArgumentError(f"targets must be non-empty host:port strings, got {given!r}")
    return tuple(dict.fromkeys(listed))


def merge_store_stats(node_stats: Sequence[StoreStats]) -> StoreStats:
    """The tier-by-tier sum of several nodes' stats (tiers in order of first appearance).

    Every count is summed (the lookup counts too), ``counters`` key by key; ``blocks`` is ``-1`` when any
    node reports ``-1`` for that tier (e.g. a shared Redis). Nodes that share one
    Redis each count their own Redis hits, so the sums stay meaningful.

    Args:
        node_stats: one :class:`StoreStats` per node.
    """
    merged: dict[str, dict[str, Any]] = {}
    for stats in node_stats:
        for tier in stats.tiers:
            acc = merged.get(tier.name)
            if acc is None:
                merged[tier.name] = {f: getattr(tier, f) for f in _TIER_FIELDS} | {"counters": dict(tier.counters)}
                merged[tier.name].update(merge_tier_status({}, tier))  # state and last_error
                continue
            acc.update(merge_tier_status(acc, tier))
            for f in _TIER_FIELDS:
                value = getattr(tier, f)
                acc[f] = -1 if f == "blocks" and (value < 0 or acc[f] < 0) else acc[f] + value
            for key, count in tier.counters.items():
                acc["counters"][key] = acc["counters"].get(key, 0) + count
    return StoreStats(tuple(TierStats(name=name, **fields) for name, fields in merged.items()),
                      sum(stats.lookup_hit_blocks for stats in node_stats),
                      sum(stats.lookup_miss_blocks for stats in node_stats))


_TIER_FIELDS = ("blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "demotions", "promotions",
                "corrupt_records")


def _merge_health(statuses: Sequence[str | None]) -> str:
    """``SERVING`` if any node serves, else the first answer; raises if no node answered."""
    answered = [s for s in statuses if s is not None]
    if not answered:
        raise UnavailableError("no kvstore node answered the health check")
    return "SERVING" if "SERVING" in answered else answered[0]


class InflightSlots:
    """At most ``num_slots`` calls in flight across threads: a counter under a lock, which waits only when full.

    What ``threading.BoundedSemaphore`` does, for a tenth of its cost when a slot
    is free (its acquire and release are Python methods under a ``Condition``,
    about 3 µs a call): a lock and an integer, and the condition only when a
    caller must wait.

    Args:
        num_slots: calls allowed at once, >= 1.
    """

    __slots__ = ("_lock", "_free", "_waiters", "_freed")

    def __init__(self, num_slots: int) -> None:
        self._lock = threading.Lock()
        self._free = num_slots
        self._waiters = 0
        self._freed = threading.Condition(self._lock)

    def acquire(self, timeout_s: float) -> bool:
        """Take a slot, waiting up to ``timeout_s`` seconds for one; whether one was taken."""
        with self._lock:
            if self._free:
                self._free -= 1
                return True
            self._waiters += 1
            try:
                if not self._freed.wait_for(lambda: self._free > 0, timeout_s):
                    return False
            finally:
                self._waiters -= 1
            self._free -= 1
            return True

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._free += 1
            if self._waiters:
                self._freed.notify()



# ---------------------------------------------------------------------- retries, as small composable objects


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: before retry ``n`` (0-based), ``uniform(0, min(cap_s, base_s * 2^n))``.

    From the AWS Architecture Blog's "Exponential Backoff and Jitter": full
    jitter spreads the retries of many clients that failed together.

    Attributes:
        base_s: the first pause's upper bound, seconds.
        cap_s: the largest upper bound, seconds.
    """

    base_s: float = DEFAULT_BACKOFF_S
    cap_s: float = DEFAULT_MAX_BACKOFF_S

    def pause_s(self, attempt: int) -> float:
        """The pause before retry ``attempt``, seconds."""
        return backoff_s(attempt, self.base_s, self.cap_s)


@dataclass(frozen=True, slots=True)
class Retry:
    """Which failed attempts of an idempotent call are made again, how often, and after what pause.

    Attributes:
        retries: retries per node after the first attempt (0 for none).
        backoff: the pause before each retry.
        codes: the status codes worth a retry (the node is restarting or shutting down).
    """

    retries: int = DEFAULT_RETRIES
    backoff: Backoff = Backoff()
    codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES

    def pause_s(self, attempt: int, code: grpc.StatusCode, idempotent: bool = True) -> float | None:
        """Seconds to wait before retrying after failed attempt ``attempt`` (0-based); ``None``: do not retry."""
        if idempotent and code in self.codes and attempt < self.retries:
            return self.backoff.pause_s(attempt)
        return None


# ---------------------------------------------------------------------- calls, described once

_UNARY, _REPLY_STREAM, _REQUEST_STREAM = range(3)


class _Rpc(NamedTuple):
    """One node's part of a call: what one attempt sends, and how its reply becomes a result.

    Attributes:
        kind: ``_UNARY``, ``_REPLY_STREAM`` (Get) or ``_REQUEST_STREAM`` (Put).
        method: the channel's multicallable for the call (``TargetChannel`` -> callable).
        request: the request (a message or serialized bytes); for ``_REQUEST_STREAM``,
            a function making a fresh :class:`_RequestStream` for each attempt.
        read: ``reply -> result``; for ``_REPLY_STREAM``, a function making a fresh
            assembler (``add_reply``, ``finish``) for each attempt.
        rescue: ``error -> result`` for a status that is an answer (health's NOT_FOUND), else ``None``.
        wait_for_ready: wait for the channel's connection within the deadline (a probe of a down node).
        shared: for a call the same-host data plane can carry, ``session -> (rpc, done)`` making this
            attempt's part on it (``None`` when it cannot take this one: gRPC then); ``done`` (or ``None``)
            is called once the attempt's outcome is known (a Put's staged range is given back).
    """

    kind: int
    method: Callable[[TargetChannel], Any]
    request: Any
    read: Callable[..., Any]
    rescue: Callable[[grpc.RpcError], Any] | None = None
    wait_for_ready: bool = False
    shared: Callable[[SharedSession], tuple[_Rpc, Callable[[], None] | None] | None] | None = None


class _Plan(NamedTuple):
    """A whole call: each node's part, and how the per-node results (``None``: no part, or down) merge."""

    rpcs: dict[int, _Rpc]
    merge: Callable[[list[Any]], Any]


# The I/O a call asks its transport for, yielded by the generators below (the logic is written once, without I/O;
# each client's transport performs these, synchronously in threads or on an asyncio loop).
class _Attempt(NamedTuple):
    node: int
    rpc: _Rpc
    timeout_s: float


class _Pause(NamedTuple):
    seconds: float


class _Together(NamedTuple):
    parts: list[Generator[Any, Any, Any]]  # run at once; the transport sends back each one's result or exception
    deadline: float  # of the call (time.monotonic()): a part not started by then is a miss


class _Slot(NamedTuple):
    pass  # take an in-flight slot; the transport sends back its release


class _Probe(NamedTuple):
    node_id: str  # start a health probe of a down node in the background


class _Link(NamedTuple):
    node: int  # the node's same-host session, attached first if it is time to try; the transport sends back it or None
    timeout_s: float  # the longest an attach may take (what is left of the call's deadline)


_SLOT = _Slot()
_Step = Generator[Any, Any, _T]
_RETURNED = object()


class _Outcome:
    """What the last I/O a step asked for gave, a value or an error, to send into the step (each transport's loop)."""

    __slots__ = ("value", "error")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

    def send_into(self, step: _Step[Any]) -> Any:
        """Resume ``step`` with this outcome; returns the next I/O it asks for, or ``_RETURNED`` (its result is
        then :attr:`value`)."""
        value, error = self.value, self.error
        self.value, self.error = None, None
        try:
            return step.throw(error) if error is not None else step.send(value)
        except StopIteration as stop:
            self.value = stop.value
            return _RETURNED


def _stub(name: str) -> Callable[[TargetChannel], Any]:
    return lambda channel: getattr(channel.stub, name)


def _health(channel: TargetChannel) -> Any:
    return channel.health_stub.Check


def _get_call(channel: TargetChannel) -> Any:
    return channel.get_call


def _put_call(channel: TargetChannel) -> Any:
    return channel.put_call


def _get_shared_call(channel: TargetChannel) -> Any:
    return channel.stub.GetShared


def _put_shared_call(channel: TargetChannel) -> Any:
    return channel.stub.PutShared


_UNCLEAR_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
"""Statuses after which a same-host call may still be running on the node (its staged range is not reused)."""

_MAX_SHARED_TRIES = 2
"""Attempts of one call on the same-host path that the node answered "no such session" before it goes over gRPC."""


class _Then:
    """An assembler of a Get's replies whose result goes through ``then`` (e.g. into the caller's tensors)."""

    __slots__ = ("_assembler", "_then")

    def __init__(self, assembler: BlockAssembler, then: Callable[[list[Buffer]], Any]) -> None:
        self._assembler = assembler
        self._then = then

    def add_reply(self, message: bytes) -> None:
        self._assembler.add_reply(message)

    def finish(self) -> Any:
        return self._then(self._assembler.finish())


def _health_name(reply: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


def _unknown_service(exc: grpc.RpcError) -> str:
    """grpc.health.v1 answers NOT_FOUND for a service it does not know: an answer, not a failure."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
        return _SERVICE_UNKNOWN
    raise exc


def _lookup_rpc(namespace: pb.Namespace, block_hashes: Sequence[BlockHash]) -> _Rpc:
    return _Rpc(_UNARY, _stub("Lookup"), request_with_hashes(pb.LookupRequest, namespace, block_hashes),
                lookup_from_pb)


def _get_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash]) -> _Rpc:
    num_blocks = len(block_hashes)
    return _Rpc(_REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes),
                lambda: _assembler(num_blocks))


def _get_then(namespace: Namespace, block_hashes: Sequence[BlockHash], then: Callable[[list[Buffer]], Any],
              shared: Callable[[SharedSession, pb.GetSharedResponse, float], Any]) -> _Rpc:
    """A Get over gRPC whose blocks go through ``then``, or on the same-host path through ``shared``."""
    num_blocks = len(block_hashes)
    return _Rpc(_REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes),
                lambda: _Then(_assembler(num_blocks), then),
                shared=_shared_get(cached_namespace_pb(namespace), block_hashes, shared))


def _shared_get(namespace: pb.Namespace, block_hashes: Sequence[BlockHash],
                use: Callable[[SharedSession, pb.GetSharedResponse, float], Any]) -> Callable[[SharedSession], Any]:
    """A GetShared on a session, whose reply (and the time it was asked for) goes through ``use``."""

    def make(session: SharedSession) -> tuple[_Rpc, None]:
        request = request_with_hashes(pb.GetSharedRequest, namespace, block_hashes)
        request.session_id = session.session_id
        started = time.monotonic()
        return _Rpc(_UNARY, _get_shared_call, request, lambda reply: use(session, reply, started)), None

    return make


def _put_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], blocks: Sequence[Block], chunk_bytes: int,
             priority: int | None, retention_s: float | None) -> _Rpc:
    """A Put: over gRPC, its blocks encoded once on the first attempt; on the same-host path, staged straight
    from the caller's memory (their dtypes and shapes were checked beforehand: encoding cannot fail)."""
    encoded: list[list[bytes]] = []

    def messages() -> Iterator[bytes]:
        if not encoded:
            encoded.append(encode_blocks(blocks, namespace.layout))
        yield from put_requests(namespace, block_hashes, encoded[0], chunk_bytes, priority=priority,
                                retention_s=retention_s)

    def requests() -> _RequestStream:
        return _RequestStream(messages())

    def shared(session: SharedSession) -> tuple[_Rpc, Callable[[], None]] | None:
        staged = session.stage(blocks, namespace.layout)
        if staged is None:  # no room in the put segment now: over gRPC
            return None
        request = request_with_hashes(pb.PutSharedRequest, cached_namespace_pb(namespace), block_hashes)
        request.session_id = session.session_id
        request.offsets.extend(staged.offsets)
        request.sizes.extend(staged.sizes)
        if priority is not None:
            request.priority = priority
        if retention_s is not None:
            request.retention_s = retention_s
        return (_Rpc(_UNARY, _put_shared_call, request, lambda reply: int(reply.num_stored)),
                lambda: session.unstage(staged))

    return _Rpc(_REQUEST_STREAM, _put_call, requests, lambda reply: int(reply.num_stored), shared=shared)


def _merge_copied(partition: Partition | None, results: list[Copied | None]) -> int:
    """The blocks a Get into caller tensors filled, in prefix order, from each node's :class:`Copied`.

    Raises:
        DestinationMismatchError: if the prefix ends at a block that was found but did not fit its destination.
    """
    if partition is None:
        copied = results[0]
        assert copied is not None
        if copied.error is not None:
            raise copied.error
        return copied.num_copied
    num_copied = partition.merge_prefix([0 if r is None else r.num_copied for r in results])
    num_found = partition.merge_prefix([0 if r is None else r.num_found for r in results])
    if num_copied < num_found:
        error = next(r.error for r in results if r is not None and r.error is not None)
        raise DestinationMismatchError(f"{error} (block {num_copied} of the call)", num_copied, num_found)
    return num_copied


def _delete_rpc(namespace: pb.Namespace, block_hashes: Sequence[BlockHash]) -> _Rpc:
    return _Rpc(_UNARY, _stub("Delete"), request_with_hashes(pb.DeleteRequest, namespace, block_hashes),
                lambda reply: int(reply.num_deleted))


def _total(results: list[int | None]) -> int:
    return sum(r for r in results if r is not None)


def _first(results: list[_T | None]) -> _T:
    return results[0]  # type: ignore[return-value]


class _Client:
    """What :class:`KVStoreClient` and :class:`AsyncKVStoreClient` share: every setting, every call's request and
    merge, the retries, the fan-out over nodes and their membership, written once.

    The logic is a generator per call that yields the I/O it needs (an attempt on
    a node, a pause, parts run at once, a slot, a probe) and is sent back the
    outcome; each client's transport (:meth:`_run`) performs the I/O, the
    synchronous one in the calling thread and worker threads, the asyncio one
    on its loop. The public methods return the transport's result: a value
    from :class:`KVStoreClient`, an awaitable from :class:`AsyncKVStoreClient`.
    """

    _aio = False

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        targets: Sequence[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel_options: Sequence[tuple[str, Any]] = (),
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        down_backoff_s: float = DEFAULT_DOWN_BACKOFF_S,
        max_down_backoff_s: float = DEFAULT_MAX_DOWN_BACKOFF_S,
        shared_memory: bool | None = None,
    ) -> None:
        settings = _Settings.check(
            timeout_s=timeout_s, max_inflight=max_inflight, retries=retries, backoff_s=backoff_s,
            max_backoff_s=max_backoff_s, probe_timeout_s=probe_timeout_s, down_backoff_s=down_backoff_s,
            max_down_backoff_s=max_down_backoff_s,
        )
        self.targets = resolve_targets(target, targets)
        self.target = self.targets[0]
        self.timeout_s = settings.timeout_s
        self.max_inflight = settings.max_inflight
        self.retries = settings.retries
        self.backoff_s = settings.backoff_s
        self.max_backoff_s = settings.max_backoff_s
        self.retry = Retry(settings.retries, Backoff(settings.backoff_s, settings.max_backoff_s))
        self.probe_timeout_s = min(settings.probe_timeout_s, settings.timeout_s)
        self.metadata = call_metadata(metadata)
        self._chunk_bytes = chunk_bytes_for(max_message_bytes)
        self.router = RendezvousRouter(self.targets)
        self.membership = Membership(self.router.node_ids, base_backoff_s=settings.down_backoff_s,
                                     max_backoff_s=settings.max_down_backoff_s)
        self._channels = tuple(
            TargetChannel(t, aio=self._aio, max_message_bytes=max_message_bytes, credentials=credentials,
                          options=channel_options)
            for t in self.router.node_ids
        )
        self._channel = self._channels[self.router.index(self.target)]
        self._single = len(self._channels) == 1
        if shared_memory is None:
            shared_memory = os.environ.get("KVSTORE_SHARED_MEMORY", "1").strip().lower() not in _FALSE
        self._links: tuple[SharedMemoryLink | None, ...] = tuple(
            SharedMemoryLink(t, credentials=credentials, metadata=self.metadata, options=channel_options)
            if shared_memory else None
            for t in self.router.node_ids
        )
        self._lock = threading.Lock()  # membership, across the synchronous client's threads
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Set up the transport (each client's own)."""

    def _run(self, plan: _Plan) -> Any:
        """Perform ``plan`` (see the class docstring); each client's transport."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the API

    def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks (a :class:`LookupResult`).

        With several nodes, each owner is asked for its own hashes in parallel and
        the answers are merged (see the module docstring); a down node's blocks are misses.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, or too many hashes.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        check_block_hashes(namespace, block_hashes)
        ns = cached_namespace_pb(namespace)
        if self._single:
            return self._run(_Plan({0: _lookup_rpc(ns, block_hashes)}, _first))
        partition = self.router.split(block_hashes)
        return self._run(_Plan({j: _lookup_rpc(ns, partition.sub_list(j, block_hashes))
                                for j in partition.nodes_with_blocks()}, partition.merge_lookup))

    def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """Encoded blocks of the longest cached prefix, in order; stops at the first miss (a list of :data:`Buffer`).

        A block that arrived in one message (up to ``max_message_bytes`` less
        4 KiB) is a read-only ``memoryview`` of it, with no copy; a larger one
        is ``bytes`` joined from its chunks (:data:`kvstore.api.Buffer`).
        With several nodes, the owners are asked in parallel and their blocks
        merged in order up to the first miss (a down node's blocks are misses).

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, or too many hashes.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        return self._run(self._get_plan(namespace, block_hashes))

    def _get_plan(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> _Plan:
        check_block_hashes(namespace, block_hashes)

        def rpc(hashes: Sequence[BlockHash]) -> _Rpc:
            return _get_rpc(namespace, hashes)._replace(
                shared=_shared_get(cached_namespace_pb(namespace), hashes, SharedSession.take_bytes))

        return self._per_node(block_hashes, rpc, lambda partition: partition.merge_blocks)

    def _per_node(self, block_hashes: Sequence[BlockHash], rpc: Callable[..., _Rpc],
                  merge: Callable[[Partition], Callable[[list[Any]], Any]], *per_block: Sequence[Any],
                  single: Callable[[list[Any]], Any] = _first) -> _Plan:
        """A plan that asks each owner for its blocks: ``rpc(hashes, *per_block items)`` per node, merged."""
        if self._single:
            return _Plan({0: rpc(block_hashes, *per_block)}, single)
        partition = self.router.split(block_hashes)
        return _Plan({j: rpc(partition.sub_list(j, block_hashes), *(partition.sub_list(j, items) for items in per_block))
                      for j in partition.nodes_with_blocks()}, merge(partition))

    def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """Like :meth:`get`, decoded (checksums verified) into CPU tensors.

        Each is ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or
        ``[num_layers, 1, block_size, latent_dim]`` (``mla``). Over gRPC they view
        this call's own received messages, which nothing else holds, so they are
        not copied (``decode_block(copy=False)``) and a write into a tensor changes
        only them; over the same-host data plane each is a tensor of its own,
        copied once from shared memory.

        Raises:
            CodecError: if a received block fails to decode.
        """
        check_block_hashes(namespace, block_hashes)

        def decode(blocks: list[Buffer]) -> list[Any]:
            return [decode_block(b, copy=False) for b in blocks]

        def rpc(hashes: Sequence[BlockHash]) -> _Rpc:
            return _get_then(namespace, hashes, decode,
                             lambda session, reply, started: session.take_tensors(reply, True, started))

        return self._run(self._per_node(block_hashes, rpc, lambda partition: partition.merge_blocks))

    def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor],
                 *, verify: bool | None = None) -> Any:
        """Copy the blocks of the longest cached prefix into the caller's tensors; returns how many (an int).

        The Get for a connector's staging buffer, or a pinned host tensor: block
        ``i`` of the prefix is copied into ``destinations[i]``, and the blocks
        past the prefix are left as they were. Same host: the node copies the
        blocks into this client's shared-memory segment, and they are copied
        once from there into the destinations, with no intermediate ``bytes``.
        Another host: over gRPC, once from the received messages.

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            destinations: one tensor per hash, each of the block's dtype and shape
                (``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for ``kv``):
                on any device, and any view (e.g. ``cache[:, :, :, i * bs:(i + 1) * bs]``).
            verify: check each block's checksum before copying it. ``None``: what
                crossed a network is checked (gRPC), what the node copied into shared
                memory from blocks it validated at put time is not (as the embedded
                store does not check its own memory).

        Returns:
            Blocks copied: the prefix length (the first miss ends it).

        Raises:
            InvalidArgumentError: before any call, if there is not one tensor per hash.
            DestinationMismatchError: if a block's dtype or shape is not its destination's;
                the blocks before it were copied (its ``num_blocks``).
            CodecError: on a malformed block, or (when checked) a corrupt one.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        check_block_hashes(namespace, block_hashes)
        check_destinations(destinations, len(block_hashes))
        over_grpc = True if verify is None else bool(verify)
        shared = False if verify is None else bool(verify)

        def rpc(hashes: Sequence[BlockHash], targets: Sequence[Any]) -> _Rpc:
            return _get_then(namespace, hashes, lambda blocks: copy_into_destinations(blocks, targets, over_grpc),
                             lambda session, reply, started: session.copy_into(reply, targets, shared, started))

        return self._run(self._per_node(block_hashes, rpc, lambda partition: functools.partial(_merge_copied, partition),
                                        destinations, single=functools.partial(_merge_copied, None)))

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """The encoded blocks of the longest cached prefix in place, until released (a :class:`BlockLease`).

        ``with client.read(ns, hashes) as blocks:`` (``with await ...`` on the
        asyncio client). Same host: each block is a read-only view of this
        client's shared-memory segment, held for it under a lease, so nothing
        overwrites it, whatever happens to the stored block (deleted, cleared,
        evicted), until the lease is released or runs out (``BlockLease.expires_at``).
        Another host: the received buffers.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, or too many hashes.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        check_block_hashes(namespace, block_hashes)

        def rpc(hashes: Sequence[BlockHash]) -> _Rpc:
            return _get_then(namespace, hashes, lambda blocks: BlockLease(blocks, []), SharedSession.lease)

        def merge(partition: Partition) -> Callable[[list[Any]], BlockLease]:
            return lambda results: BlockLease.merge(
                partition.merge_blocks([None if r is None else r.blocks for r in results]), results)

        return self._run(self._per_node(block_hashes, rpc, merge))

    def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> Any:
        """Store blocks (encoded bytes or tensors), each on its owner; returns how many were newly stored (an int).

        The blocks stream to a node in chunks; it stores them only once the
        whole stream has arrived and validated, so a failed put stores nothing
        there. With several nodes, each owner gets its blocks in parallel and
        blocks of a down node are skipped (not counted, no error).

        Args:
            namespace: namespace of the blocks.
            block_hashes: one chained hash per block.
            blocks: encoded blocks, or tensors of the namespace's layout
                (``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for ``kv``).
            priority: retention priority, an integer in ``[0, 100]``; the node's default when ``None``.
            retention_s: seconds (>= 0, ``inf`` for ever) the priority holds before it reverts to the default.

        Raises:
            InvalidArgumentError: at the call, on a namespace that is not a :class:`Namespace`,
                as many hashes as blocks not given, a hash that is not bytes-like or not
                ``namespace.hash_bytes`` long, a priority that is not an integer in ``[0, 100]``,
                or a ``retention_s`` that is not a number >= 0; from the node, on a malformed block.
            CodecError: on a tensor that does not fit the codec.
            ResourceExhaustedError: on a block over the node's ``max_block_bytes``, or no room.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        check_block_hashes(namespace, block_hashes)
        priority, retention_s = _check_put(namespace, block_hashes, blocks, priority, retention_s)
        blocks = blocks_for_put(blocks, namespace.layout)  # what encoding would refuse, refused now, before any call
        blocks = encode_for_put(blocks, namespace)  # a lossy namespace's tensors, encoded here (kvstore.encoding)

        def rpc(hashes: Sequence[BlockHash], items: Sequence[Block]) -> _Rpc:
            return _put_rpc(namespace, hashes, items, self._chunk_bytes, priority, retention_s)

        return self._run(self._per_node(block_hashes, rpc, lambda partition: _total, blocks))

    def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """Delete blocks from every tier of their owners; returns how many were found (down nodes are skipped)."""
        check_block_hashes(namespace, block_hashes)
        ns = cached_namespace_pb(namespace)
        if self._single:
            return self._run(_Plan({0: _delete_rpc(ns, block_hashes)}, _first))
        partition = self.router.split(block_hashes)
        return self._run(_Plan({j: _delete_rpc(ns, partition.sub_list(j, block_hashes))
                                for j in partition.nodes_with_blocks()}, _total))

    def clear(self, namespace: Namespace) -> Any:
        """Delete every block of ``namespace`` on every node; returns how many local blocks went.

        A node that is down keeps its local blocks (no error); clear again once
        it is back. The shared tier's are gone for every node at once (``docs/redis.md``).
        """
        rpc = _Rpc(_UNARY, _stub("Clear"), pb.ClearRequest(namespace=cached_namespace_pb(namespace)),
                   lambda reply: int(reply.num_deleted))
        return self._run(_Plan(dict.fromkeys(range(len(self._channels)), rpc), _total))

    def stats(self) -> Any:
        """Per-tier stats: the node's, or with several nodes the tier-by-tier sum (:func:`merge_store_stats`)
        over the nodes that answered (empty when none did)."""
        return self._run(self._stats_plan(lambda by_node: merge_store_stats(list(by_node.values()))))

    def node_stats(self) -> Any:
        """Per-tier stats of each node that answered, by target.

        Raises:
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        return self._run(self._stats_plan(lambda by_node: by_node))

    def _stats_plan(self, finish: Callable[[dict[str, StoreStats]], Any]) -> _Plan:
        rpc = _Rpc(_UNARY, _stub("Stats"), pb.StatsRequest(), stats_from_pb)
        node_ids = self.router.node_ids
        return _Plan(dict.fromkeys(range(len(self._channels)), rpc),
                     lambda results: finish({node_ids[j]: r for j, r in enumerate(results) if r is not None}))

    def health(self, service: str = "") -> Any:
        """The ``grpc.health.v1`` status: ``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or ``UNKNOWN``.

        A node that does not know ``service`` (it answers NOT_FOUND) is
        ``SERVICE_UNKNOWN``. With several nodes: ``SERVING`` if any up node
        serves (the client can serve calls), else the first answer in router order.

        Args:
            service: ``""`` for the whole server, or ``kvstore.v1.KVStore``.

        Raises:
            UnavailableError: if no node can be reached within the deadline
                (:class:`DeadlineExceededError` when the deadline passed).
            KVStoreError: with one target, the typed error of any other failed status
                (e.g. UNAUTHENTICATED).
        """
        rpc = _Rpc(_UNARY, _health, health_pb2.HealthCheckRequest(service=service), _health_name, _unknown_service)
        return self._run(_Plan(dict.fromkeys(range(len(self._channels)), rpc), _merge_health))

    def shared_memory(self) -> tuple[str, ...]:
        """Per node, in router order: ``"attached"``, ``"unknown"`` (not tried yet), or why it is off
        (e.g. ``"the node is on another host"``; ``"off"`` when this client was made with ``shared_memory=False``)."""
        states = []
        for link in self._links:
            if link is None:
                states.append("off")
            elif link.current() is not None:
                states.append("attached")
            else:
                states.append(link.reason or "unknown")
        return tuple(states)

    def _close_links(self) -> None:
        for link in self._links:
            if link is not None:
                link.close()

    def nodes(self) -> tuple[NodeStatus, ...]:
        """A snapshot of each node's membership (up or down, failures, next probe), in router order."""
        with self._lock:
            return self.membership.status()

    def __repr__(self) -> str:
        targets = repr(self.target) if self._single else repr(list(self.targets))
        return f"{type(self).__name__}({targets})"

    # ------------------------------------------------------------------ the logic of a call (no I/O)

    def _call(self, plan: _Plan) -> _Step[Any]:
        """A whole call under one deadline and one in-flight slot: with one target its errors raise; with several,
        the nodes' parts run at once and a node that cannot be reached is marked down and is a miss."""
        deadline = time.monotonic() + self.timeout_s
        if self._closed:
            raise UnavailableError(f"the client of {', '.join(self.targets)} is closed")
        results: list[Any] = [None] * len(self._channels)
        release = yield _SLOT
        try:
            if self._single:
                for node, rpc in plan.rpcs.items():
                    results[node] = yield from self._attempts(node, rpc, deadline)
                return plan.merge(results)
            with self._lock:
                due = self.membership.due_probes()
                live = [node for node in plan.rpcs if self.membership.is_up(self.router.node_ids[node])]
            for node_id in due:
                yield _Probe(node_id)
            outcomes = yield _Together([self._on_node(node, plan.rpcs[node], deadline) for node in live], deadline)
            for node, outcome in zip(live, outcomes):
                if isinstance(outcome, BaseException):
                    raise outcome
                results[node] = outcome
            return plan.merge(results)
        finally:
            release()

    def _attempts(self, node: int, rpc: _Rpc, deadline: float) -> _Step[Any]:
        """One node's part, attempted until it succeeds, under the deadline and :attr:`retry`.

        Raises:
            DeadlineExceededError: if the deadline passes.
            KVStoreError: the typed error of any other failed status.
        """
        attempt = 0
        shared_tries = 0
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise DeadlineExceededError(f"deadline of {self.timeout_s} s passed after {attempt} attempts")
            chosen, done, session = rpc, None, None
            if rpc.shared is not None and self._links[node] is not None and shared_tries < _MAX_SHARED_TRIES:
                session = yield _Link(node, remaining_s)
                made = None if session is None else rpc.shared(session)
                if made is not None:
                    chosen, done = made
            clear = False  # whether the attempt's outcome is known (a staged range may be reused)
            try:
                result = yield _Attempt(node, chosen, remaining_s)
                clear = True
                return result
            except UseGrpc:  # the same-host path declined this call (no room now): the rest of it goes over gRPC
                clear, shared_tries = True, _MAX_SHARED_TRIES
                continue
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                clear = code not in _UNCLEAR_CODES
                if chosen is not rpc and code == grpc.StatusCode.FAILED_PRECONDITION:
                    self._links[node].lost(session)  # type: ignore[union-attr]  # the node forgot it: attach again
                    shared_tries += 1
                    continue
                if rpc.rescue is not None:
                    try:
                        return rpc.rescue(exc)
                    except grpc.RpcError:
                        pass
                if self._closed:  # close() ended the call: gRPC says CANCELLED, "Channel closed!"
                    raise UnavailableError(f"the client of {', '.join(self.targets)} was closed during the call") \
                        from None
                code = exc.code()  # type: ignore[attr-defined]
                pause_s = self.retry.pause_s(attempt, code)
                if pause_s is None:
                    _raise_typed(exc)
                pause_s = min(pause_s, deadline - time.monotonic())  # type: ignore[type-var]
                logger.debug("retrying after %s in %.3f s (attempt %d)", code.name, pause_s, attempt + 1)
                yield _Pause(max(0.0, pause_s))
                attempt += 1
            finally:
                if done is not None:
                    if clear:
                        done()
                    else:  # the node may still be copying out of the staged range: never reuse it, nor the session
                        self._links[node].lost(session)  # type: ignore[union-attr]

    def _on_node(self, node: int, rpc: _Rpc, deadline: float) -> _Step[Any]:
        """One node's part of a fanned-out call; ``None`` (and the node marked down) if it cannot be reached."""
        node_id = self.router.node_ids[node]
        if time.monotonic() >= deadline:  # queued behind busy workers until the deadline: not the node's fault
            return None
        try:
            result = yield from self._attempts(node, rpc, deadline)
        except UnavailableError as exc:  # also DeadlineExceededError
            with self._lock:
                was_up = self.membership.is_up(node_id)
                wait_s = self.membership.record_failure(node_id)
            if was_up:
                logger.warning("kvstore node %s is down (%s); its blocks are misses for %.1f s", node_id, exc, wait_s)
            return None
        with self._lock:
            rejoined = self.membership.record_success(node_id)
        if rejoined:
            logger.info("kvstore node %s is up again", node_id)
        return result

    def _probe(self, node_id: str) -> _Step[None]:
        """Health-check a down node (waiting for its connection up to ``probe_timeout_s``) and report the result."""
        rpc = _Rpc(_UNARY, _health, health_pb2.HealthCheckRequest(), lambda reply: reply.status, wait_for_ready=True)
        try:
            status = yield _Attempt(self.router.index(node_id), rpc, self.probe_timeout_s)
            ok = status == health_pb2.HealthCheckResponse.SERVING
        except Exception as exc:  # noqa: BLE001 - a background probe reports every failure as "still down"
            logger.debug("probe of kvstore node %s failed: %s", node_id, exc)
            ok = False
        with self._lock:
            self.membership.probe_done(node_id, ok)
        if ok:
            logger.info("kvstore node %s answers SERVING again; it rejoins", node_id)


class KVStoreClient(_Client):
    """A synchronous, thread-safe client of one kvstore node or several; a :class:`~kvstore.api.BlockClient`.

    With several targets, blocks are spread over the nodes by rendezvous hashing
    and an unreachable node is a miss, not an error (see the module docstring).
    Its transport runs a call in the calling thread, and the parts of a call
    fanned out to several nodes in worker threads (started as calls need them).

    Args:
        target: ``host:port`` of the node, or a sequence of them (one per node).
        targets: the nodes' ``host:port``, as a keyword (instead of ``target``).
        timeout_s: deadline of every call, seconds, covering its retries and its fan-out.
        max_inflight: calls in flight at once across threads; more wait (within
            their deadline) for a slot. A call fanned out to several nodes is one call.
        retries: retries of an idempotent call on UNAVAILABLE, per node (0 for none).
        backoff_s: base of the exponential backoff, seconds (:class:`Backoff`).
        max_backoff_s: cap of one backoff, seconds.
        max_message_bytes: largest gRPC message, bytes; must match the server's
            ``server.max_message_bytes`` (blocks are chunked to fit).
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``), for every target;
            ``None`` for plaintext.
        metadata: ``(key, value)`` pairs sent with every call to every target (e.g. ``authorization``).
        channel_options: extra gRPC channel options, for every target.
        probe_timeout_s: deadline of one health probe of a down node, seconds (capped at ``timeout_s``).
        down_backoff_s: how long a node stays down after its first failure before it is probed, seconds.
        max_down_backoff_s: cap of that backoff, which doubles per consecutive failure, seconds.

    Raises:
        InvalidArgumentError: on no target, both ``target`` and ``targets``, or an empty target;
            on ``timeout_s`` or ``probe_timeout_s`` not a number in ``(0, MAX_TIMEOUT_S]``; on ``backoff_s``,
            ``max_backoff_s`` or ``down_backoff_s`` not a finite number >= 0, or
            ``max_down_backoff_s`` not a finite number >= ``down_backoff_s``; on
            ``max_inflight`` not an integer >= 1 or ``retries`` not one >= 0. The
            message names the argument.
    """

    _aio = False

    def _start(self) -> None:
        self._pid = os.getpid()
        self._slots = InflightSlots(self.max_inflight)
        self._executor: ThreadPoolExecutor | None = None

    def _run(self, plan: _Plan) -> Any:
        return self._drive(self._call(plan))

    def _drive(self, step: _Step[_T]) -> _T:
        """Perform the I/O ``step`` yields, in this thread, until it returns."""
        outcome = _Outcome()
        try:
            while (op := outcome.send_into(step)) is not _RETURNED:
                try:
                    outcome.value = self._perform(op)
                except BaseException as exc:  # noqa: BLE001 - sent back into the step, which decides
                    outcome.error = exc
            return outcome.value  # type: ignore[no-any-return]
        finally:
            step.close()

    def _perform(self, op: Any) -> Any:
        if type(op) is _Attempt:
            return self._attempt(op)
        if type(op) is _Link:
            return self._links[op.node].ensure(op.timeout_s)  # type: ignore[union-attr]
        if type(op) is _Slot:
            return self._acquire_slot()
        if type(op) is _Pause:
            time.sleep(op.seconds)
            return None
        if type(op) is _Together:
            return self._together(op.parts, op.deadline)
        self._pool().submit(self._drive, self._probe(op.node_id))  # _Probe
        return None

    def _attempt(self, op: _Attempt) -> Any:
        """One attempt of one node's part: the synchronous transport of :class:`_Rpc`."""
        rpc = op.rpc
        call = rpc.method(self._channels[op.node])
        if rpc.kind == _UNARY:
            if rpc.wait_for_ready:
                return rpc.read(call(rpc.request, timeout=op.timeout_s, metadata=self.metadata, wait_for_ready=True))
            return rpc.read(call(rpc.request, timeout=op.timeout_s, metadata=self.metadata))
        if rpc.kind == _REPLY_STREAM:
            assembler = rpc.read()
            stream = call(rpc.request, timeout=op.timeout_s, metadata=self.metadata)
            try:
                for message in stream:
                    assembler.add_reply(message)
            except BaseException:
                stream.cancel()  # frees the call on an error (a stream that ended needs nothing)
                raise
            return assembler.finish()
        requests = rpc.request()
        try:
            return rpc.read(call(requests, timeout=op.timeout_s, metadata=self.metadata))
        except grpc.RpcError:  # UNKNOWN: "Exception iterating requests!"
            requests.raise_error()
            raise

    def _after_fork(self) -> None:
        """In a forked child: fresh slots, lock and worker threads (a parent's thread may have held them)."""
        if self._pid != os.getpid():
            self._pid, self._slots = os.getpid(), InflightSlots(self.max_inflight)
            self._lock, self._executor = threading.Lock(), None

    def _acquire_slot(self) -> Callable[[], None]:
        self._after_fork()
        slots = self._slots
        if not slots.acquire(self.timeout_s):
            raise DeadlineExceededError(f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s")
        return slots.release

    def _pool(self) -> ThreadPoolExecutor:
        """The worker threads of this process (started on first use), for the nodes' parts and the probes.

        Raises:
            UnavailableError: if the client is closed.
        """
        with self._lock:
            if self._closed:
                raise UnavailableError(f"the client of {', '.join(self.targets)} is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=min(_MAX_WORKERS, len(self._channels) * self.max_inflight),
                    thread_name_prefix="kvstore-client",
                )
            return self._executor

    def _together(self, parts: list[_Step[Any]], deadline: float) -> list[Any]:
        """Run the parts at once: the first in this thread, the rest in worker threads; each one's result or
        exception, in order. A part still queued behind busy workers when the deadline has passed is a miss."""
        if not parts:
            return []
        futures = [self._pool().submit(self._outcome, part) for part in parts[1:]]
        outcomes = [self._outcome(parts[0])]
        if futures:
            futures_wait(futures, timeout=max(0.0, deadline - time.monotonic()) + _GRACE_S)
            for future in futures:
                if future.done():
                    outcomes.append(future.result())
                else:  # queued behind busy workers until the deadline: a miss, not the node's fault
                    future.cancel()
                    outcomes.append(None)
        return outcomes

    def _outcome(self, part: _Step[Any]) -> Any:
        try:
            return self._drive(part)
        except BaseException as exc:  # noqa: BLE001 - returned, and raised by the call that gathers it
            return exc

    def close(self) -> None:
        """Close the channels, then wait for the worker threads to end; idempotent.

        Closing a channel cancels its calls in flight (a health probe too; their
        callers get :class:`UnavailableError`), so the wait is short, and no thread of the client is left inside gRPC
        afterwards (which matters to a process that forks next). In a forked
        child this leaves the parent's connections alone.
        """
        self._closed = True
        self._close_links()
        for channel in self._channels:
            channel.close()
        executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVStoreClient(_Client):
    """The asyncio client: the same methods as :class:`KVStoreClient`, each returning an awaitable, the same policies.

    Use from one event loop; the channels are opened on the first call. With
    several targets the nodes are asked concurrently on that loop, and health
    probes of down nodes run as tasks on it. Its constructor takes the same
    arguments as :class:`KVStoreClient`'s, with the same checks.
    """

    _aio = True

    def _start(self) -> None:
        self._aslots: asyncio.Semaphore | None = None
        self._slots_pid = -1
        self._probes: set[asyncio.Task[None]] = set()

    def _run(self, plan: _Plan) -> Awaitable[Any]:
        return self._drive(self._call(plan))

    async def _drive(self, step: _Step[_T]) -> _T:
        """Perform the I/O ``step`` yields, on the running loop, until it returns."""
        outcome = _Outcome()
        try:
            while (op := outcome.send_into(step)) is not _RETURNED:
                try:
                    outcome.value = await self._perform(op)
                except asyncio.CancelledError:
                    raise  # the caller's cancellation is not the call's outcome
                except BaseException as exc:  # noqa: BLE001 - sent back into the step, which decides
                    outcome.error = exc
            return outcome.value  # type: ignore[no-any-return]
        finally:
            step.close()

    async def _perform(self, op: Any) -> Any:
        if type(op) is _Attempt:
            return await self._attempt(op)
        if type(op) is _Link:
            link = self._links[op.node]
            assert link is not None
            session = link.current()
            if session is not None or link.settled():
                return session
            return await asyncio.to_thread(link.ensure, op.timeout_s)  # attaching blocks (a handoff, a Unix socket)
        if type(op) is _Slot:
            return await self._acquire_slot()
        if type(op) is _Pause:
            await asyncio.sleep(op.seconds)
            return None
        if type(op) is _Together:
            return await asyncio.gather(*(self._drive(part) for part in op.parts), return_exceptions=True)
        task = asyncio.get_running_loop().create_task(self._drive(self._probe(op.node_id)))  # _Probe
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)
        return None

    async def _attempt(self, op: _Attempt) -> Any:
        """One attempt of one node's part: the asyncio transport of :class:`_Rpc`."""
        rpc = op.rpc
        call = rpc.method(self._channels[op.node])
        if rpc.kind == _UNARY:
            if rpc.wait_for_ready:
                return rpc.read(await call(rpc.request, timeout=op.timeout_s, metadata=self.metadata,
                                           wait_for_ready=True))
            return rpc.read(await call(rpc.request, timeout=op.timeout_s, metadata=self.metadata))
        if rpc.kind == _REPLY_STREAM:
            assembler = rpc.read()
            stream = call(rpc.request, timeout=op.timeout_s, metadata=self.metadata)
            try:
                async for message in stream:
                    assembler.add_reply(message)
            except BaseException:
                stream.cancel()
                raise
            return assembler.finish()
        requests = rpc.request()
        try:
            return rpc.read(await call(requests, timeout=op.timeout_s, metadata=self.metadata))
        except (asyncio.CancelledError, grpc.RpcError):  # grpc.aio cancels the call when the stream fails
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # a cancellation of the caller's task stays one
                requests.raise_error()
            raise

    async def _acquire_slot(self) -> Callable[[], None]:
        if self._aslots is None or self._slots_pid != os.getpid():
            self._aslots, self._slots_pid = asyncio.Semaphore(self.max_inflight), os.getpid()
        slots = self._aslots
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(
                f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s"
            ) from None
        return slots.release

    async def close(self) -> None:
        """Cancel running health probes and close the channels; idempotent."""
        self._closed = True
        probes = list(self._probes)
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._close_links()
        for channel in self._channels:
            await channel.aclose()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
