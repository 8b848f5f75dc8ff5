"""The thin ``kvstore.v1.KVStore`` servicer: gRPC's transport for the node's service.

Every method runs inside :meth:`KVStoreServicer._call`, the one place that
admits a gRPC call (``kvstore.server.admission``: token, in-flight slot),
counts it in the metrics, logs it, and turns a raised kvstore error into its
status code (``kvstore.error_codes.status_of``), and then calls the node's service
(``kvstore.server.service.NodeService``), whose checks and operations a
same-host session's control channels share. Requests arrive as raw bytes and
are parsed inside it, so a malformed message is INVALID_ARGUMENT (not gRPC's
UNKNOWN) and is parsed only after the caller was admitted. With authentication
on, every namespace must be one of the caller's tenants (``cache_salt``;
PERMISSION_DENIED otherwise), and with ``limits.tenant_quota_bytes`` a Put must
fit the tenant's quota (``kvstore.server.quota.TenantQuota``). Get and Put
stream their blocks, chunked and reassembled by ``kvstore.wire``; the same-host
methods' bytes move through ``kvstore.shm``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterable, NoReturn, TypeVar, cast

import grpc

from google.protobuf.message import Message

from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockHash, Namespace, block_key
from kvstore.error_codes import FailedPreconditionError, status_of
from kvstore.server.budgets import ReplyBudget
from kvstore.server.call import REPLY_LOST, SERVICE_NAME, GrpcCall, call_ended
from kvstore.server.watchdog import StreamWatchdog
from kvstore.server.metrics import ServiceMetrics
from kvstore.server.service import NodeService
from kvstore.wire import (
    BlockAssembler,
    HashRequest,
    decode_hash_request,
    decode_put_request,
    identity,
    iter_block_chunks,
    parse_request,
)
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvstore.bulk.node.operations import BulkOperations
    from kvstore.shm.node.operations import SameHostOperations

logger = logging.getLogger(__name__)

_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")
_HashMessage = TypeVar("_HashMessage", pb.GetRequest, pb.LookupRequest, pb.DeleteRequest)

CANCELLATION_GRACE_S = 0.1
"""How long a Put whose stream ended mid-block waits for a cancellation before it is refused as truncated, seconds."""

EMPTY_REPLY = b""
"""The reply of a Get that finds no block: an empty ``BlockChunk``, which carries none (clients skip it)."""

_GRPC_AIO_LOGGER = "grpc._cython.cygrpc"  # the logger of grpc.aio's server (its Cython module)


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Serves one node's service (:class:`~kvstore.server.service.NodeService`) over gRPC (``grpc.aio``).

    Args:
        service: the node's service (its store, checks and budgets; the servicer closes nothing of it).

    Attributes:
        service: as given.
        admission: the service's (``NodeService.admission``): admits each call.
        metrics: the service's, where each call is counted (``None``: none).
        replies: the service's budget of Get replies in flight.
        events_offer: the node's KV event stream, ``(endpoint, replay_endpoint, topic, authenticated)`` as
            bound (``docs/events.md``), offered in Capabilities; ``None`` when it publishes none.
    """

    def __init__(self, service: NodeService) -> None:
        self.service = service
        self._store = service.store
        self._config = service.config
        self.metrics: ServiceMetrics | None = service.metrics
        self._chunk_bytes = service.chunk_bytes
        self._max_hashes = service.max_hashes
        self._watchdog = StreamWatchdog(service.config.limits.max_stream_s)
        self.admission = service.admission
        self.replies: ReplyBudget = service.replies
        self.events_offer: tuple[str, str, str, bool] | None = None

    @property
    def accepting(self) -> bool:
        """``False`` once shutdown began (new calls get UNAVAILABLE)."""
        return self.service.accepting

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service on ``server``, with the data path's own (de)serializers.

        Get replies and Put requests are serialized by ``kvstore.wire``
        (block bytes are not copied through protobuf); the wire format is the
        ``.proto``'s all the same. Every request arrives as bytes and is parsed
        in the method (see the module docstring).

        Get, server-streaming in the ``.proto``, is served by a unary handler
        that writes all but its last message with ``context.write`` and returns
        the last: grpc.aio sends a unary handler's reply and the status in one
        batch, where a streaming handler's status is a batch of its own, one
        more trip through gRPC's completion queue and the event loop before the
        client has its reply. On the wire the two are the same: a stream of
        messages, then the status. That batch runs after the handler, so a
        client that goes away while it waits is seen through grpc.aio's log
        (:class:`ReplyLostFilter`, installed here).
        """
        handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Lookup), identity,
                                                          pb.LookupResponse.SerializeToString),
            # a unary handler, so that the reply's last message leaves with its status (Get's docstring)
            "Get": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Get), identity, identity),
            "Put": grpc.stream_unary_rpc_method_handler(_sheds_aborts(self.Put), identity,
                                                        pb.PutResponse.SerializeToString),
            "Delete": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Delete), identity,
                                                          pb.DeleteResponse.SerializeToString),
            "Clear": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Clear), identity,
                                                         pb.ClearResponse.SerializeToString),
            "Stats": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Stats), identity,
                                                         pb.StatsResponse.SerializeToString),
            "Capabilities": grpc.unary_unary_rpc_method_handler(
                _sheds_aborts(self.Capabilities), identity, pb.CapabilitiesResponse.SerializeToString),
            "Attach": grpc.stream_stream_rpc_method_handler(_sheds_aborts(self.Attach), identity, pb.AttachReply.SerializeToString),
            "GetShared": grpc.unary_unary_rpc_method_handler(
                _sheds_aborts(self.GetShared), identity, pb.GetSharedResponse.SerializeToString),
            "PutShared": grpc.unary_unary_rpc_method_handler(
                _sheds_aborts(self.PutShared), identity, pb.PutResponse.SerializeToString),
            "BulkGet": grpc.unary_unary_rpc_method_handler(
                _sheds_aborts(self.BulkGet), identity, pb.BulkGetResponse.SerializeToString),
            "BulkPut": grpc.unary_unary_rpc_method_handler(
                _sheds_aborts(self.BulkPut), identity, pb.BulkPutResponse.SerializeToString),
            "Explain": grpc.unary_unary_rpc_method_handler(_sheds_aborts(self.Explain), identity,
                                                           pb.ExplainResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        grpc_logger = logging.getLogger(_GRPC_AIO_LOGGER)
        if REPLY_LOST not in grpc_logger.filters:
            grpc_logger.addFilter(REPLY_LOST)

    def begin_shutdown(self) -> None:
        """Refuse every new call with UNAVAILABLE; calls already running go on."""
        self.service.accepting = False

    def close(self) -> None:
        """Stop the servicer's background work (the stream watchdog), once the gRPC server has stopped."""
        self._watchdog.close()

    # ------------------------------------------------------------------ RPCs

    async def Lookup(self, raw: bytes | pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """The longest cached prefix of ``request.block_hashes`` and each block's tier."""
        async with self._call("Lookup", context) as call:
            return await self.service.lookup(call.principal, _hash_request(pb.LookupRequest, raw))
        raise AssertionError("unreachable")  # _call re-raises as an abort

    async def Get(self, raw: bytes | pb.GetRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Stream the blocks of the longest cached prefix as chunks; a miss ends the stream.

        The prefix stays leased (pinned, and read in place from the memory
        tier) until the last chunk is handed to gRPC; if the client goes away or
        its deadline passes, cancellation leaves ``store.read`` and releases the
        leases. A block the heap tier holds framed as its ready reply
        (``store.read(...).framed``) is sent as stored; any other is copied once, from its leased view into its
        messages (so the last message never refers to a leased page). The read
        is closed (leases released, hits counted) on the loop's next turn, once
        gRPC has the last message and the status, which the client waits for.

        Every message but the last is written here; the last is returned, and
        gRPC sends it with the status in one batch, as gRPC C++'s
        ``ServerWriter::WriteLast`` does (see :meth:`add_to_server`). A Get that
        finds nothing returns an empty ``BlockChunk``, which carries no block.
        """
        async with self._call("Get", context) as call:
            namespace_wire, hashes, session_id, ttl_s, _ = (decode_hash_request(pb.GetRequest, raw) if type(raw) is bytes
                                                            else _hash_request(pb.GetRequest, raw))
            namespace, hashes = self.service.namespace(namespace_wire, call.principal), self.service.hashes(hashes)
            call.watch(self._watchdog)
            turn = call.reply_turn(self.replies, namespace.cache_salt, len(hashes))  # flow control: None, or wait
            if turn is not None:
                await turn
            read = self._store.read(namespace, hashes, session_id=session_id, ttl_s=ttl_s)
            blocks = read.open_now()
            if blocks is None:
                blocks = await read.open()
            call.charge_reply(blocks)
            try:
                framed = read.framed  # blocks the heap tier holds framed as this reply: sent as stored
                messages: Iterable[bytes] = (iter_block_chunks(blocks, self._chunk_bytes, framed)
                                             if framed is None or None in framed
                                             else cast("list[bytes]", framed))  # no None: checked
                last = None
                for message in messages:
                    if last is not None:
                        await context.write(last)
                    last = message
                return EMPTY_REPLY if last is None else last
            finally:
                asyncio.get_running_loop().call_soon(read.close)
        raise AssertionError("unreachable")

    async def Put(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Receive a whole Put stream, validate it, then store every block in one ``store.put``.

        Nothing is stored unless the whole stream arrives: a cancelled, truncated
        or malformed stream leaves the store unchanged. The blocks being received
        count against the connection's and tenant's put budget (:class:`PutBudget`) until the call ends.
        """
        async with self._call("Put", context) as call:
            namespace: Namespace | None = None
            priority: int | None = None
            retention_s: float | None = None
            session_id, ttl_s = "", 0.0
            hashes: list[bytes] = []
            assembler = BlockAssembler(self._config.store.max_block_bytes, self._max_hashes,
                                       self._config.limits.max_put_bytes)
            peer, held = call.peer(), 0  # the bytes this Put's blocks hold, under self.puts
            try:
                async with self._watchdog.watch("Put"):
                    async for raw in request_iterator:
                        message, data = decode_put_request(raw)
                        if namespace is None:
                            if not message.HasField("namespace"):
                                raise InvalidArgumentError("the first Put message must carry the namespace")
                            namespace = self.service.namespace(message.namespace.SerializeToString(),
                                                               call.principal)
                            priority = message.priority if message.HasField("priority") else None
                            retention_s = message.retention_s if message.HasField("retention_s") else None
                            session_id, ttl_s = message.agent_session_id, message.ttl_s
                        elif message.HasField("namespace"):
                            raise InvalidArgumentError("only the first Put message may carry the namespace")
                        if message.block_hash:
                            block_key(namespace, message.block_hash)  # the hash length, before buffering anything
                            assembler.begin(message.block_index, message.total_bytes)
                            await self.service.puts.take(peer, namespace.cache_salt, message.total_bytes, held)
                            held += message.total_bytes
                            hashes.append(message.block_hash)
                        elif not data:
                            continue  # e.g. a first message with the namespace alone: it carries no block bytes
                        assembler.add(message.block_index, message.offset, data)
                try:
                    blocks = assembler.finish()
                except InvalidArgumentError:  # a truncated stream; a client that cancelled mid-stream ends it
                    await _await_cancellation(context)  # early too, and its cancellation lands a moment later
                    raise
                if namespace is None:
                    return pb.PutResponse(num_stored=0, num_blocks=0)
                self.service.check_deadline(context.time_remaining())
                with self.service.reserve(namespace, sum(len(b) for b in blocks)):
                    stored = await self._store.put(namespace, cast("list[BlockHash]", hashes), blocks,
                                                   priority=priority, retention_s=retention_s, session_id=session_id,
                                                   ttl_s=ttl_s)
                return pb.PutResponse(num_stored=stored, num_blocks=len(blocks))
            finally:
                if held:
                    self.service.puts.release(peer, namespace.cache_salt if namespace is not None else "", held)
        raise AssertionError("unreachable")

    async def Delete(self, raw: bytes | pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        """Delete blocks from every tier."""
        async with self._call("Delete", context) as call:
            return await self.service.delete(call.principal, _hash_request(pb.DeleteRequest, raw))
        raise AssertionError("unreachable")

    async def Clear(self, raw: bytes | pb.ClearRequest, context: grpc.aio.ServicerContext) -> pb.ClearResponse:
        """Delete every block of one namespace (the token must cover its tenant)."""
        async with self._call("Clear", context) as call:
            return await self.service.clear(call.principal, parse_request(pb.ClearRequest, raw))
        raise AssertionError("unreachable")

    async def Explain(self, raw: bytes | pb.ExplainRequest, context: grpc.aio.ServicerContext) -> pb.ExplainResponse:
        """Each block of a request, hit or the cause of its miss (``kvstore explain``); a ``request_id`` names a
        recent Lookup's namespace and blocks (the token must cover its tenant)."""
        async with self._call("Explain", context) as call:
            return await self.service.explain(call.principal, parse_request(pb.ExplainRequest, raw))
        raise AssertionError("unreachable")

    async def Stats(self, raw: bytes | pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        """Per-tier counts, summed over every tenant (any valid token may read them)."""
        async with self._call("Stats", context):
            parse_request(pb.StatsRequest, raw)
            return self.service.stats()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ the same-host data plane

    def _same_host(self) -> SameHostOperations:
        same_host = self.service.same_host
        if same_host is None or not same_host.offering or not self.accepting:
            raise FailedPreconditionError("this node offers no same-host data plane; use Get and Put")
        return same_host

    async def Capabilities(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.CapabilitiesResponse:
        """What the node offers: a same-host data plane (its host id and handoff socket), its KV event stream."""
        async with self._call("Capabilities", context):
            parse_request(pb.CapabilitiesRequest, raw)
            reply = pb.CapabilitiesResponse()
            same_host = self.service.same_host
            if same_host is not None and same_host.offering and self.accepting:
                reply.shared_memory.host_id, reply.shared_memory.handoff_socket = same_host.offer()
            if self.events_offer is not None:
                (reply.events.endpoint, reply.events.replay_endpoint, reply.events.topic,
                 reply.events.authenticated) = self.events_offer
            bulk = self.service.bulk
            if bulk is not None and self.accepting:
                reply.bulk.host, reply.bulk.port, reply.bulk.tls = bulk.offer
            return reply
        raise AssertionError("unreachable")

    async def BulkGet(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.BulkGetResponse:
        """Lease the longest cached prefix for the bulk listener to send: its sizes and a one-time grant
        (``kvstore.bulk.node.operations``)."""
        async with self._call("BulkGet", context) as call:
            return await self._bulk().get(call.principal, parse_request(pb.BulkGetRequest, raw))
        raise AssertionError("unreachable")

    async def BulkPut(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.BulkPutResponse:
        """Reserve room for a Put's blocks, which the client sends to the bulk listener under a one-time grant."""
        async with self._call("BulkPut", context) as call:
            return await self._bulk().put(call.principal, parse_request(pb.BulkPutRequest, raw))
        raise AssertionError("unreachable")

    def _bulk(self) -> BulkOperations:
        bulk = self.service.bulk
        if bulk is None or not self.accepting:
            raise FailedPreconditionError("this node offers no bulk path; use Get and Put")
        return bulk

    async def Attach(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One client's session: the grant first, then the client's lease releases, until the stream ends.

        The session (its leases, its segments) ends with the stream: when the
        client closes it, when its process dies and the kernel closes its
        connection, or when the node begins to shut down.
        """
        async with self._call("Attach", context) as call:
            same_host = self._same_host()
            session = same_host.open(call.principal, context.invocation_metadata())
            call.give_back_slot()  # a session lasts as long as its client: max_sessions bounds them, not the slots
            try:
                await context.write(same_host.attach_reply(session))
                await same_host.serve(session, request_iterator)
            finally:
                same_host.close(session)
            return None
        raise AssertionError("unreachable")

    async def GetShared(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetSharedResponse:
        """The blocks of the longest cached prefix under one lease, copied into the session's get segment
        (gRPC carries no descriptors: only a control channel's GetShared reads the node's pool in place)."""
        async with self._call("GetShared", context) as call:
            return await self._same_host().get_shared(call.principal, parse_request(pb.GetSharedRequest, raw), None)
        raise AssertionError("unreachable")

    async def PutShared(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Store the blocks the client staged in its put segment (``kvstore.shm.node.operations``)."""
        async with self._call("PutShared", context) as call:
            return await self._same_host().put_shared(call.principal, parse_request(pb.PutSharedRequest, raw),
                                                      context.time_remaining)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ helpers

    def _call(self, method: str, context: grpc.aio.ServicerContext) -> GrpcCall:
        """The scope of one call (``async with self._call(...) as call``): see :class:`GrpcCall`."""
        return GrpcCall(self, method, context)

    async def fail(self, method: str, context: grpc.aio.ServicerContext, exc: BaseException,
                   start_s: float) -> NoReturn:
        """End a call with the status of ``exc``: log it, count it, then abort (which raises).

        Args:
            method: the call's method, as counted (``Get``).
            context: the call's.
            exc: what ended it (``kvstore.error_codes.status_of`` maps it).
            start_s: when it began, ``time.perf_counter()`` seconds.

        Raises:
            grpc.aio.AbortError: (through ``context.abort``) carrying the mapped status.
        """
        status, message = status_of(exc)
        code = status.name
        if status is grpc.StatusCode.INTERNAL:
            logger.error("%s failed", method, exc_info=exc, extra={"fields": {"method": method, "code": code}})
        else:
            logger.debug("%s %s: %s", method, code, message)
        if self.metrics is not None:  # before the abort sends the status: a client never sees it uncounted
            self.metrics.observe(method, code, time.perf_counter() - start_s)
        await context.abort(status, message)
        raise AssertionError("context.abort returned")  # it raises


def _sheds_aborts(handler: Callable[[_Request, grpc.aio.ServicerContext], Awaitable[_Reply]]
                  ) -> Callable[[_Request, grpc.aio.ServicerContext], Awaitable[_Reply]]:
    """``handler`` as registered with gRPC: an abort leaves it holding none of the call's frames.

    grpc.aio keeps an abort's exception on the call's state, which the frames
    of its traceback reference (each holds the context): every aborted call was
    cyclic garbage holding its request and all its handler held (a refused 4 MB
    request too) until the collector ran, so refused callers could pin memory.
    The exception leaves here without its traceback and the error it was raised
    in, and the frames go as soon as the call ends (``tests/security/test_hostile_clients.py``).
    """
    @functools.wraps(handler)
    async def handle(request: _Request, context: grpc.aio.ServicerContext) -> _Reply:
        try:
            return await handler(request, context)
        except grpc.aio.AbortError as abort:
            abort.__traceback__ = abort.__context__ = abort.__cause__ = None
            del request, context
            raise

    return handle


async def _await_cancellation(context: grpc.aio.ServicerContext) -> None:
    """Wait up to :data:`CANCELLATION_GRACE_S` for the client's side of the call to end (cancelled, or its deadline).

    A cancelled request stream simply ends, and the cancellation itself reaches
    the handler a little later; on a busy node one turn of the loop is not
    always enough. Waited for only on an error path (a truncated Put).
    """
    deadline = time.monotonic() + CANCELLATION_GRACE_S
    while not call_ended(context) and time.monotonic() < deadline:
        await asyncio.sleep(CANCELLATION_GRACE_S / 10)  # cancelled here when the cancellation lands


def _hash_request(message_type: type[_HashMessage], raw: bytes | _HashMessage) -> HashRequest:
    """A Lookup, Get or Delete request received as bytes (:func:`~kvstore.wire.decode_hash_request`).

    A message passes through, for direct calls.

    Raises:
        InvalidArgumentError: if the bytes are not a well-formed ``message_type``.
    """
    if isinstance(raw, Message):
        return HashRequest(raw.namespace.SerializeToString(), raw.block_hashes,
                           getattr(raw, "agent_session_id", ""), getattr(raw, "ttl_s", 0.0),
                           getattr(raw, "request_id", ""))
    return decode_hash_request(message_type, raw)

