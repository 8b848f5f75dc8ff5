"""The builders of each kvstore method's parts (:class:`~kvstore.client.plan.Rpc`), and the merges of the nodes'
results: what ``kvstore.client.core`` puts in its plans (``kvstore.client.plan``).

A part carries each path it can take: gRPC (its request and reply), the
same-host data plane (:attr:`~kvstore.client.plan.Rpc.shared`: the attempt's
part rewritten for a session) and the bulk path (:attr:`~kvstore.client.plan.Rpc.bulk`).
A Get is one builder, :func:`get_rpc`, whatever its blocks become: a
:class:`Delivery` says that once per medium (:data:`AS_BYTES`,
:data:`AS_TENSORS`, :data:`AS_LEASE`, :class:`IntoTensors`).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvstore.api import Block, Buffer
from kvstore.blocks.lease import BlockLease
from kvstore.blocks.copying import Copied, copy_into_destinations
from kvstore.blocks.tensors import decode_block, encode_blocks
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

if TYPE_CHECKING:
    import torch

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


class Delivery(Protocol):
    """What a Get makes of its blocks, on each path they can come by: one handler per medium.

    The blocks come assembled from gRPC's messages (read-only views of them),
    received from the bulk path (each in a buffer of its own), or in place on
    the same-host path (a ``GetSharedResponse`` naming where they lie under
    the node's lease). :data:`AS_BYTES`, :data:`AS_TENSORS`, :data:`AS_LEASE`
    and :class:`IntoTensors` are the client's.
    """

    def received(self, blocks: list[Buffer]) -> Any:
        """The result of blocks that came over gRPC or the bulk path, in prefix order."""
        ...

    def shared(self, session: SharedSession, reply: pb.GetSharedResponse, started: float) -> Any:
        """The result of a same-host reply (``started``: the ``time.monotonic()`` the request was made at).

        Raises:
            UseGrpc: when the blocks cannot be used (no room, the lease ran out): the Get goes over gRPC.
        """
        ...

    def bulk(self, link: BulkLink, endpoint: Endpoint, aio: bool) -> bulk_calls.BulkCall:
        """The bulk path's call of this Get (``aio``: made by the asyncio client)."""
        ...


class _AsBytes:
    """The blocks as they are: gRPC's views, or ``bytes`` copied once from shared memory (:meth:`ClientCore.get`)."""

    __slots__ = ()

    def received(self, blocks: list[Buffer]) -> list[Buffer]:
        return blocks

    shared = staticmethod(SharedSession.take_bytes)  # the method itself: no call in between on the hot path

    def bulk(self, link: BulkLink, endpoint: Endpoint, aio: bool) -> bulk_calls.BulkCall:
        return bulk_calls.get_blocks(link, endpoint, list, aio)


class _AsTensors:
    """The blocks decoded into CPU tensors, checksums verified (:meth:`ClientCore.get_tensors`)."""

    __slots__ = ()

    def received(self, blocks: list[Buffer]) -> list[torch.Tensor]:
        return [decode_block(b, copy=False) for b in blocks]

    def shared(self, session: SharedSession, reply: pb.GetSharedResponse, started: float) -> list[torch.Tensor]:
        return session.take_tensors(reply, True, started)

    def bulk(self, link: BulkLink, endpoint: Endpoint, aio: bool) -> bulk_calls.BulkCall:
        return bulk_calls.get_blocks(link, endpoint, self.received, aio)


class _AsLease:
    """The blocks in place under a lease (:meth:`ClientCore.read`): received buffers need no lease."""

    __slots__ = ()

    def received(self, blocks: list[Buffer]) -> BlockLease:
        return BlockLease(blocks, [])

    shared = staticmethod(SharedSession.lease)

    def bulk(self, link: BulkLink, endpoint: Endpoint, aio: bool) -> bulk_calls.BulkCall:
        return bulk_calls.get_blocks(link, endpoint, self.received, aio)


AS_BYTES: Delivery = _AsBytes()
"""A Get's blocks as a list of :data:`~kvstore.api.Buffer` (gRPC's assembled list itself, with no wrapper)."""
AS_TENSORS: Delivery = _AsTensors()
"""A Get's blocks as a list of CPU tensors (``decode_block``, checksums verified)."""
AS_LEASE: Delivery = _AsLease()
"""A Get's blocks as a :class:`~kvstore.blocks.lease.BlockLease`."""


class IntoTensors:
    """A Get's blocks copied into the caller's tensors (:meth:`ClientCore.get_into`); the result a :class:`Copied`.

    Args:
        destinations: one tensor per hash of the node's part.
        verify_received: check the checksums of what came over gRPC or the bulk path.
        verify_shared: check the checksums of what the node wrote in shared memory.
        layout: the namespace's layout (``kv`` or ``mla``), for the bulk path's checks.
    """

    __slots__ = ("destinations", "verify_received", "verify_shared", "layout")

    def __init__(self, destinations: Sequence[torch.Tensor], verify_received: bool, verify_shared: bool,
                 layout: str) -> None:
        self.destinations = destinations
        self.verify_received = verify_received
        self.verify_shared = verify_shared
        self.layout = layout

    def received(self, blocks: list[Buffer]) -> Copied:
        """Copy received blocks into the destinations (:func:`~kvstore.blocks.copying.copy_into_destinations`)."""
        return copy_into_destinations(blocks, self.destinations, self.verify_received)

    def shared(self, session: SharedSession, reply: pb.GetSharedResponse, started: float) -> Copied:
        """Copy a same-host reply's blocks into the destinations (:meth:`SharedSession.copy_into`)."""
        return session.copy_into(reply, self.destinations, self.verify_shared, started)

    def bulk(self, link: BulkLink, endpoint: Endpoint, aio: bool) -> bulk_calls.BulkCall:
        """The bulk path's Get, each block received straight into its destination."""
        return bulk_calls.get_into(link, endpoint, self.destinations, self.layout, self.verify_received, aio)


def get_rpc(namespace: Namespace, block_hashes: Sequence[BlockHash], delivery: Delivery, session_id: str = "",
            ttl_s: float = 0.0) -> Rpc:
    """A Get, on whichever path carries it (same host, bulk, gRPC), whose blocks go through ``delivery``.

    Args:
        namespace: namespace of the blocks.
        block_hashes: the node's hashes, in prefix order.
        delivery: what the blocks become (:data:`AS_BYTES`, :data:`AS_TENSORS`, :data:`AS_LEASE`,
            :class:`IntoTensors`).
        session_id, ttl_s: the agentic fields (``docs/agentic.md``).
    """
    num_blocks = len(block_hashes)
    if delivery is AS_BYTES:  # the assembler's list is the result
        read: Callable[[], Any] = lambda: _assembler(num_blocks)  # noqa: E731
    else:
        received = delivery.received
        read = lambda: _Then(_assembler(num_blocks), received)  # noqa: E731
    return Rpc(REPLY_STREAM, _get_call, encode_get_request(namespace, block_hashes, session_id, ttl_s), read,
               shared=_shared_get(cached_namespace_pb(namespace), block_hashes, delivery.shared, session_id, ttl_s),
               bulk=_bulk_get(namespace, block_hashes, delivery, session_id, ttl_s))


def _bulk_get_request(namespace: Namespace, block_hashes: Sequence[BlockHash], session_id: str,
                      ttl_s: float) -> pb.BulkGetRequest:
    """A BulkGet's request, with the agentic fields (``docs/agentic.md``)."""
    request = request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(namespace), block_hashes)
    if session_id:
        request.agent_session_id = session_id
    if ttl_s:
        request.ttl_s = ttl_s
    return request


def _bulk_get(namespace: Namespace, block_hashes: Sequence[BlockHash], delivery: Delivery, session_id: str,
              ttl_s: float) -> Callable[[BulkLink, Endpoint], Rpc]:
    """The :attr:`Rpc.bulk` of a Get: its bulk call, whose blocks go through ``delivery``."""

    def make(link: BulkLink, endpoint: Endpoint) -> Rpc:
        request = _bulk_get_request(namespace, block_hashes, session_id, ttl_s)
        return Rpc(UNARY, lambda channel: delivery.bulk(link, endpoint, channel.aio), request, _same)

    return make


def _same(result: _T) -> _T:
    return result


def _shared_get(namespace: pb.Namespace, block_hashes: Sequence[BlockHash],
                use: Callable[[SharedSession, pb.GetSharedResponse, float], Any], session_id: str,
                ttl_s: float) -> Callable[[SharedSession], tuple[Rpc, None]]:
    """The :attr:`Rpc.shared` of a Get: a GetShared on a session, whose reply (and the ``time.monotonic()`` it was
    asked at) goes through ``use``."""

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
