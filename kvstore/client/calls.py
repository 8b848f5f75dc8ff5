"""The builders of each kvstore method's parts (:class:`~kvstore.client.plan.Rpc`), and the merges of the nodes'
results: what ``kvstore.client.core`` puts in its plans (``kvstore.client.plan``)."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvstore.api import Block, Buffer
from kvstore.blockcopy import Copied
from kvstore.codec import encode_blocks
from kvstore.errors import DestinationMismatchError
from kvstore.keys import BlockHash, Namespace
from kvstore.routing import Partition
from kvstore.shm.frames import GET_SHARED, LOOKUP, PUT_SHARED
from kvstore.shm.client.link import SharedSession
from kvstore.bulk.client import calls as bulk_calls
from kvstore.bulk.client.link import BulkLink, Endpoint
from kvstore.bulk.client.transfer import put_sizes
from kvstore.client.channel import TargetChannel
from kvstore.client.plan import REPLY_STREAM, REQUEST_STREAM, UNARY, RequestStream, Rpc
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

def _assembler(num_blocks: int) -> BlockAssembler:
    return BlockAssembler(_NO_BLOCK_LIMIT, max(1, num_blocks), copy=False)  # one-chunk blocks stay views



def stub(name: str) -> Callable[[TargetChannel], Any]:
    """The method of :class:`Rpc` for the kvstore RPC ``name`` (e.g. ``"Lookup"``): its multicallable on a channel."""
    return lambda channel: getattr(channel.stub, name)


def health_method(channel: TargetChannel) -> Any:
    """The method of :class:`Rpc` for ``grpc.health.v1``'s Check: its multicallable on ``channel``."""
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


UNCLEAR_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
"""Statuses after which a same-host call may still be running on the node (its staged range is not reused)."""

MAX_SHARED_TRIES = 2
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


def health_name(reply: health_pb2.HealthCheckResponse) -> str:
    """The name of a health reply's status (``SERVING``, ``NOT_SERVING``, ...)."""
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return name


_SERVICE_UNKNOWN: str = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


def unknown_service(exc: grpc.RpcError) -> str:
    """A health call's rescue (:attr:`Rpc.rescue`): ``grpc.health.v1`` answers NOT_FOUND for a service it does not
    know, an answer (``SERVICE_UNKNOWN``), not a failure.

    Raises:
        grpc.RpcError: ``exc``, for any other status.
    """
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return _SERVICE_UNKNOWN
    raise exc


def lookup_rpc(namespace: pb.Namespace, block_hashes: Sequence[BlockHash], session_id: str = "", ttl_s: float = 0.0,
                request_id: str = "") -> Rpc:
    """A Lookup: over a same-host session's control channels where it has them, else over gRPC.

    Args:
        namespace: the namespace's message (:func:`kvstore.wire.cached_namespace_pb`).
        block_hashes: the node's hashes, in prefix order.
        session_id, ttl_s: the agentic fields (``docs/agentic.md``): a session, a TTL in seconds (0: none).
        request_id: a name for the request, for ``explain`` later (``""``: none).

    Returns:
        The part, whose result is a :class:`~kvstore.api.LookupResult`.
    """
    request = request_with_hashes(pb.LookupRequest, namespace, block_hashes)
    if session_id:
        request.agent_session_id = session_id
    if ttl_s:
        request.ttl_s = ttl_s
    if request_id:
        request.request_id = request_id

    def shared(session: SharedSession) -> tuple[Rpc, None] | None:
        if session.control is None:
            return None
        return Rpc(UNARY, _control_or(session, LOOKUP, pb.LookupResponse, stub("Lookup")), request,
                   lookup_from_pb), None

    return Rpc(UNARY, stub("Lookup"), request, lookup_from_pb, shared=shared)


def get_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], session_id: str = "",
             ttl_s: float = 0.0) -> Rpc:
    """A Get over gRPC or the bulk path whose result is the blocks (a list of :data:`~kvstore.api.Buffer`).

    The same-host path is added by the caller (:attr:`Rpc.shared`, :func:`shared_get`); ``session_id`` and
    ``ttl_s`` are the agentic fields (``docs/agentic.md``).
    """
    num_blocks = len(block_hashes)
    return Rpc(REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes, session_id, ttl_s),
               lambda: _assembler(num_blocks), bulk=_bulk_get(namespace, block_hashes, list, session_id, ttl_s))


def get_then(namespace: Namespace, block_hashes: Sequence[BlockHash], then: Callable[[list[Buffer]], Any],
              shared: Callable[[SharedSession, pb.GetSharedResponse, float], Any], session_id: str = "",
              ttl_s: float = 0.0) -> Rpc:
    """A Get over gRPC or the bulk path whose blocks go through ``then``, or on the same-host path through ``shared``.

    Args:
        namespace: namespace of the blocks.
        block_hashes: the node's hashes, in prefix order.
        then: ``blocks -> result``, for the blocks received (over gRPC, views of the messages; over the bulk
            path, buffers of their own).
        shared: ``(session, reply, started) -> result`` for a ``GetSharedResponse`` (``started``: the
            ``time.monotonic()`` the request was made).
        session_id, ttl_s: the agentic fields (``docs/agentic.md``).
    """
    num_blocks = len(block_hashes)
    return Rpc(REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes, session_id, ttl_s),
               lambda: _Then(_assembler(num_blocks), then),
               shared=shared_get(cached_namespace_pb(namespace), block_hashes, shared, session_id, ttl_s),
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
              session_id: str = "", ttl_s: float = 0.0) -> Callable[[BulkLink, Endpoint], Rpc]:
    """A Get on the bulk path whose blocks (each in a buffer of its own) go through ``then``."""

    def make(link: BulkLink, endpoint: Endpoint) -> Rpc:
        request = _bulk_get_request(namespace, block_hashes, session_id, ttl_s)
        return Rpc(UNARY, lambda channel: bulk_calls.get_blocks(link, endpoint, then, channel.aio), request, _same)

    return make


def bulk_get_into(namespace: Namespace, block_hashes: Sequence[BlockHash], destinations: Sequence[Any],
                   verify: bool, session_id: str = "", ttl_s: float = 0.0) -> Callable[[BulkLink, Endpoint], Rpc]:
    """The :attr:`Rpc.bulk` of a Get received straight into the caller's tensors (its result a :class:`Copied`).

    Args:
        namespace: namespace of the blocks.
        block_hashes: the node's hashes, in prefix order.
        destinations: one tensor per hash.
        verify: check each block's checksum.
        session_id, ttl_s: the agentic fields (``docs/agentic.md``).
    """

    def make(link: BulkLink, endpoint: Endpoint) -> Rpc:
        request = _bulk_get_request(namespace, block_hashes, session_id, ttl_s)
        return Rpc(UNARY, lambda channel: bulk_calls.get_into(link, endpoint, destinations, namespace.layout, verify,
                                                               channel.aio), request, _same)

    return make


def _same(result: _T) -> _T:
    return result


def shared_get(namespace: pb.Namespace, block_hashes: Sequence[BlockHash],
                use: Callable[[SharedSession, pb.GetSharedResponse, float], Any], session_id: str = "",
                ttl_s: float = 0.0) -> Callable[[SharedSession], Any]:
    """The :attr:`Rpc.shared` of a Get: a GetShared on a session, whose reply (and the ``time.monotonic()`` it was
    asked at) goes through ``use``.

    Args:
        namespace: the namespace's message (:func:`kvstore.wire.cached_namespace_pb`).
        block_hashes: the node's hashes, in prefix order.
        use: ``(session, reply, started) -> result`` (e.g. :meth:`SharedSession.take_bytes`).
        session_id, ttl_s: the agentic fields (``docs/agentic.md``).
    """

    def make(session: SharedSession) -> tuple[Rpc, None]:
        request = request_with_hashes(pb.GetSharedRequest, namespace, block_hashes)
        request.session_id = session.session_id
        request.in_place = session.in_place
        if session_id:
            request.agent_session_id = session_id
        if ttl_s:
            request.ttl_s = ttl_s
        started = time.monotonic()
        method = _control_or(session, GET_SHARED, pb.GetSharedResponse, _get_shared_call)
        return Rpc(UNARY, method, request, lambda reply: use(session, reply, started)), None

    return make


def put_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], blocks: Sequence[Block], chunk_bytes: int,
             priority: int | None, retention_s: float | None, session_id: str = "", ttl_s: float = 0.0) -> Rpc:
    """A Put, whose result is how many blocks were newly stored: over gRPC, its blocks encoded once on the first
    attempt; on the same-host path, staged straight from the caller's memory; on the bulk path, sent from it.

    Args:
        namespace: namespace of the blocks.
        block_hashes: the node's hashes, one per block.
        blocks: encoded blocks or tensors, their dtypes and shapes checked beforehand (encoding cannot fail).
        chunk_bytes: the largest chunk of a gRPC message, bytes.
        priority, retention_s: the retention priority and how long it holds, seconds (``None``: the node's default).
        session_id, ttl_s: the agentic fields (``docs/agentic.md``).
    """
    encoded: list[list[bytes]] = []

    def messages() -> Iterator[bytes]:
        if not encoded:
            encoded.append(encode_blocks(blocks, namespace.layout))
        yield from put_requests(namespace, block_hashes, encoded[0], chunk_bytes, priority=priority,
                                retention_s=retention_s, session_id=session_id, ttl_s=ttl_s)

    def requests() -> RequestStream:
        return RequestStream(messages())

    def shared(session: SharedSession) -> tuple[Rpc, Callable[[], None]] | None:
        staged = session.stage(blocks, namespace.layout)
        if staged is None:  # no room in the put segment now: over gRPC
            return None
        request = request_with_hashes(pb.PutSharedRequest, cached_namespace_pb(namespace), block_hashes)
        request.session_id = session.session_id
        request.offsets.extend(staged.offsets)
        request.sizes.extend(staged.sizes)
        _put_options(request, priority, retention_s, session_id, ttl_s)
        method = _control_or(session, PUT_SHARED, pb.PutResponse, _put_shared_call)
        return (Rpc(UNARY, method, request, lambda reply: int(reply.num_stored)),
                lambda: session.unstage(staged))

    def bulk(link: BulkLink, endpoint: Endpoint) -> Rpc:
        items, sizes = put_sizes(blocks, namespace.layout)
        request = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(namespace), block_hashes)
        request.sizes.extend(sizes)
        _put_options(request, priority, retention_s, session_id, ttl_s)
        return Rpc(UNARY, lambda channel: bulk_calls.put(link, endpoint, items, channel.aio), request, _same)

    return Rpc(REQUEST_STREAM, _put_call, requests, lambda reply: int(reply.num_stored), shared=shared, bulk=bulk)


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


def merge_copied(partition: Partition | None, results: list[Copied | None]) -> int:
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


def delete_rpc(namespace: pb.Namespace, block_hashes: Sequence[BlockHash]) -> Rpc:
    """A Delete of ``block_hashes`` from ``namespace`` (its message), whose result is how many were found."""
    return Rpc(UNARY, stub("Delete"), request_with_hashes(pb.DeleteRequest, namespace, block_hashes),
               lambda reply: int(reply.num_deleted))


def total(results: list[int | None]) -> int:
    """A :attr:`Plan.merge`: the sum of the nodes' counts (a node with no part, or down, counts nothing)."""
    return sum(r for r in results if r is not None)


def first(results: list[_T]) -> _T:
    """A :attr:`Plan.merge` of a plan of one node (the first): its result."""
    return results[0]
