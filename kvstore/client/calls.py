"""Every call of a client, described once as data with no I/O: each node's part (:class:`Rpc`), the whole call
(:class:`Plan`), the I/O a call asks its transport for, and the builders of each kvstore method's parts."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Generator, Iterator, NamedTuple, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvstore.api import Block, Buffer
from kvstore.blockcopy import Copied
from kvstore.codec import encode_blocks
from kvstore.errors import DestinationMismatchError, InvalidArgumentError, KVStoreError
from kvstore.keys import BlockHash, Namespace
from kvstore.routing import Partition
from kvstore.shm.frames import GET_SHARED, LOOKUP, PUT_SHARED
from kvstore.shm.client.link import SharedSession
from kvstore.bulk.client import calls as bulk_calls
from kvstore.bulk.client.link import BulkLink, Endpoint
from kvstore.bulk.client.transfer import put_sizes
from kvstore.client.channel import TargetChannel
from kvstore.wire import (
    BlockAssembler,
    cached_namespace_pb,
    encode_get_request,
    lookup_from_pb,
    put_requests,
    request_with_hashes,
)
from kvstore.v1 import kvstore_pb2 as pb

_T = TypeVar("_T")

_NO_BLOCK_LIMIT = sys.maxsize

_UNARY, _REPLY_STREAM, _REQUEST_STREAM = range(3)


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
        bulk: for a call the bulk path can carry (``kvstore.bulk``), ``(link, endpoint) -> rpc`` making this
            attempt's part on it (a ``BulkGet`` or ``BulkPut`` whose method then moves the bytes).
    """

    kind: int
    method: Callable[[TargetChannel], Any]
    request: Any
    read: Callable[..., Any]
    rescue: Callable[[grpc.RpcError], Any] | None = None
    wait_for_ready: bool = False
    shared: Callable[[SharedSession], tuple[_Rpc, Callable[[], None] | None] | None] | None = None
    bulk: Callable[[BulkLink, Endpoint], _Rpc] | None = None


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


class _BulkLink(NamedTuple):
    node: int  # the node's bulk endpoint, asked for first if it is time to; the transport sends back it or None
    timeout_s: float  # the longest asking may take (what is left of the call's deadline)


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


def _control_or(session: SharedSession, kind: int, reply_type: type, grpc_method: Callable[[TargetChannel], Any]
                ) -> Callable[[TargetChannel], Any]:
    """The session's control channels for a call of ``kind`` (``kvstore.shm.client.control``), else ``grpc_method``."""
    control = session.control
    if control is None:
        return grpc_method
    return lambda channel: control.method(kind, reply_type, channel.aio)


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


def _lookup_rpc(namespace: pb.Namespace, block_hashes: Sequence[BlockHash], session_id: str = "", ttl_s: float = 0.0,
                request_id: str = "") -> _Rpc:
    """A Lookup: over a same-host session's control channels where it has them, else over gRPC (with the agentic
    fields, ``docs/agentic.md``)."""
    request = request_with_hashes(pb.LookupRequest, namespace, block_hashes)
    if session_id:
        request.agent_session_id = session_id
    if ttl_s:
        request.ttl_s = ttl_s
    if request_id:
        request.request_id = request_id

    def shared(session: SharedSession) -> tuple[_Rpc, None] | None:
        if session.control is None:
            return None
        return _Rpc(_UNARY, _control_or(session, LOOKUP, pb.LookupResponse, _stub("Lookup")), request,
                    lookup_from_pb), None

    return _Rpc(_UNARY, _stub("Lookup"), request, lookup_from_pb, shared=shared)


def _get_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], session_id: str = "",
             ttl_s: float = 0.0) -> _Rpc:
    num_blocks = len(block_hashes)
    return _Rpc(_REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes, session_id, ttl_s),
                lambda: _assembler(num_blocks), bulk=_bulk_get(namespace, block_hashes, list, session_id, ttl_s))


def _get_then(namespace: Namespace, block_hashes: Sequence[BlockHash], then: Callable[[list[Buffer]], Any],
              shared: Callable[[SharedSession, pb.GetSharedResponse, float], Any], session_id: str = "",
              ttl_s: float = 0.0) -> _Rpc:
    """A Get over gRPC or the bulk path whose blocks go through ``then``, or on the same-host path through ``shared``."""
    num_blocks = len(block_hashes)
    return _Rpc(_REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes, session_id, ttl_s),
                lambda: _Then(_assembler(num_blocks), then),
                shared=_shared_get(cached_namespace_pb(namespace), block_hashes, shared, session_id, ttl_s),
                bulk=_bulk_get(namespace, block_hashes, then, session_id, ttl_s))


def _bulk_get_request(namespace: Namespace, block_hashes: Sequence[BlockHash], session_id: str,
                      ttl_s: float) -> pb.BulkGetRequest:
    """A BulkGet's request, with the agentic fields (``docs/agentic.md``)."""
    request = request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(namespace), block_hashes)
    if session_id:
        request.agent_session_id = session_id
    if ttl_s:
        request.ttl_s = ttl_s
    return request


def _bulk_get(namespace: Namespace, block_hashes: Sequence[BlockHash], then: Callable[[list[Buffer]], Any],
              session_id: str = "", ttl_s: float = 0.0) -> Callable[[BulkLink, Endpoint], _Rpc]:
    """A Get on the bulk path whose blocks (each in a buffer of its own) go through ``then``."""

    def make(link: BulkLink, endpoint: Endpoint) -> _Rpc:
        request = _bulk_get_request(namespace, block_hashes, session_id, ttl_s)
        return _Rpc(_UNARY, lambda channel: bulk_calls.get_blocks(link, endpoint, then, channel.aio), request, _same)

    return make


def _bulk_get_into(namespace: Namespace, block_hashes: Sequence[BlockHash], destinations: Sequence[Any],
                   verify: bool, session_id: str = "", ttl_s: float = 0.0) -> Callable[[BulkLink, Endpoint], _Rpc]:
    """A Get on the bulk path received straight into the caller's tensors (a :class:`Copied`)."""

    def make(link: BulkLink, endpoint: Endpoint) -> _Rpc:
        request = _bulk_get_request(namespace, block_hashes, session_id, ttl_s)
        return _Rpc(_UNARY, lambda channel: bulk_calls.get_into(link, endpoint, destinations, namespace.layout, verify,
                                                                channel.aio), request, _same)

    return make


def _same(result: _T) -> _T:
    return result


def _shared_get(namespace: pb.Namespace, block_hashes: Sequence[BlockHash],
                use: Callable[[SharedSession, pb.GetSharedResponse, float], Any], session_id: str = "",
                ttl_s: float = 0.0) -> Callable[[SharedSession], Any]:
    """A GetShared on a session, whose reply (and the time it was asked for) goes through ``use``."""

    def make(session: SharedSession) -> tuple[_Rpc, None]:
        request = request_with_hashes(pb.GetSharedRequest, namespace, block_hashes)
        request.session_id = session.session_id
        request.in_place = session.in_place
        if session_id:
            request.agent_session_id = session_id
        if ttl_s:
            request.ttl_s = ttl_s
        started = time.monotonic()
        method = _control_or(session, GET_SHARED, pb.GetSharedResponse, _get_shared_call)
        return _Rpc(_UNARY, method, request, lambda reply: use(session, reply, started)), None

    return make


def _put_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], blocks: Sequence[Block], chunk_bytes: int,
             priority: int | None, retention_s: float | None, session_id: str = "", ttl_s: float = 0.0) -> _Rpc:
    """A Put: over gRPC, its blocks encoded once on the first attempt; on the same-host path, staged straight
    from the caller's memory (their dtypes and shapes were checked beforehand: encoding cannot fail)."""
    encoded: list[list[bytes]] = []

    def messages() -> Iterator[bytes]:
        if not encoded:
            encoded.append(encode_blocks(blocks, namespace.layout))
        yield from put_requests(namespace, block_hashes, encoded[0], chunk_bytes, priority=priority,
                                retention_s=retention_s, session_id=session_id, ttl_s=ttl_s)

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
        _put_options(request, priority, retention_s, session_id, ttl_s)
        method = _control_or(session, PUT_SHARED, pb.PutResponse, _put_shared_call)
        return (_Rpc(_UNARY, method, request, lambda reply: int(reply.num_stored)),
                lambda: session.unstage(staged))

    def bulk(link: BulkLink, endpoint: Endpoint) -> _Rpc:
        items, sizes = put_sizes(blocks, namespace.layout)
        request = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(namespace), block_hashes)
        request.sizes.extend(sizes)
        _put_options(request, priority, retention_s, session_id, ttl_s)
        return _Rpc(_UNARY, lambda channel: bulk_calls.put(link, endpoint, items, channel.aio), request, _same)

    return _Rpc(_REQUEST_STREAM, _put_call, requests, lambda reply: int(reply.num_stored), shared=shared, bulk=bulk)


def _put_options(request: Any, priority: int | None, retention_s: float | None, session_id: str,
                 ttl_s: float) -> None:
    """Set a PutShared's or BulkPut's optional fields: priority, retention, and the agentic session and TTL."""
    if priority is not None:
        request.priority = priority
    if retention_s is not None:
        request.retention_s = retention_s
    if session_id:
        request.agent_session_id = session_id
    if ttl_s:
        request.ttl_s = ttl_s


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
