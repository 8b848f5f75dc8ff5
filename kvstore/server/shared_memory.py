"""The servicer's same-host methods: Capabilities, Attach, GetShared and PutShared (``docs/shared-memory.md``).

Each runs inside the servicer's one call scope (``KVStoreServicer._call``:
admission, token, metrics, status mapping) and checks what every other method
checks: the namespace's tenant against the caller's token, hash lengths, the
request and Put limits, the tenant quota. On top of that a session is used
only by the principal that opened it. The bytes move in ``kvstore.shm.node``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import block_key
from kvstore.server.shm_control import ControlServer
from kvstore.status import FailedPreconditionError
from kvstore.validation import BlockChecker, CheckedBlocks
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import parse_request, reply_head

if TYPE_CHECKING:
    from kvstore.shm.node import SharedMemoryNode
    from kvstore.shm.sessions import Session

logger = logging.getLogger(__name__)



class SharedMemoryMethods:
    """The same-host methods of :class:`kvstore.server.servicer.KVStoreServicer` (a mixin of it).

    Attributes:
        shm: the node's data plane, ``None`` when it offers none (every method but
            Capabilities is then FAILED_PRECONDITION, and clients use gRPC).
        events_offer: the node's KV event stream, ``(endpoint, replay_endpoint, topic)`` as bound
            (``docs/events.md``), offered in Capabilities; ``None`` when it publishes none.
    """

    shm: SharedMemoryNode | None = None
    events_offer: tuple[str, str, str] | None = None  # the node's KV events: (endpoint, replay endpoint, topic)

    # the servicer provides these
    _call: object
    _namespace: object
    _hashes: object
    _store: object
    _config: object
    _reserve: object
    _check_deadline: object
    accepting: bool

    def _require_shm(self) -> SharedMemoryNode:
        if self.shm is None or not self.accepting:
            raise FailedPreconditionError("this node offers no same-host data plane; use Get and Put")
        return self.shm

    async def Capabilities(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.CapabilitiesResponse:
        """What the node offers: a same-host data plane (its host id and handoff socket), its KV event stream."""
        async with self._call("Capabilities", context):  # type: ignore[operator]
            parse_request(pb.CapabilitiesRequest, raw)
            reply = pb.CapabilitiesResponse()
            if self.shm is not None and self.accepting:
                reply.shared_memory.host_id = self.shm.host_id
                reply.shared_memory.handoff_socket = self.shm.handoff_address
            if self.events_offer is not None:
                reply.events.endpoint, reply.events.replay_endpoint, reply.events.topic = self.events_offer
            return reply
        raise AssertionError("unreachable")

    async def Attach(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One client's session: the grant first, then the client's lease releases, until the stream ends.

        The session (its leases, its segments) ends with the stream: when the
        client closes it, when its process dies and the kernel closes its
        connection, or when the node begins to shut down.
        """
        async with self._call("Attach", context) as call:  # type: ignore[operator]
            shm = self._require_shm()
            control = self._control_server(shm)
            session = shm.open(call.principal)
            call.give_back_slot()  # a session lasts as long as its client: max_sessions bounds them, not the slots
            control.remember(session.session_id, context.invocation_metadata())
            try:
                await context.write(pb.AttachReply(
                    session_id=session.session_id, grant=session.grant,
                    get_segment_bytes=session.get_segment.nbytes, put_segment_bytes=session.put_segment.nbytes,
                    lease_s=shm.config.lease_s, grant_s=shm.config.grant_s))
                await _serve_session(shm, session, request_iterator)
            finally:
                control.forget(session.session_id)
                shm.close_session(session)
            return None
        raise AssertionError("unreachable")

    def _control_server(self, shm: SharedMemoryNode) -> ControlServer:
        """This servicer's control-channel server, made and offered to the node on the first Attach."""
        control = getattr(self, "_shm_control", None)
        if control is None:
            control = ControlServer(self, self._config.server.max_message_bytes)  # type: ignore[attr-defined]
            self._shm_control = control
            shm.serve_channel = control.serve
        return control

    async def GetShared(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GetSharedResponse:
        """Copy the blocks of the longest cached prefix into the session's get segment, under one lease.

        The prefix is read as a Get reads it (held, so eviction cannot take
        it), copied once into the segment, and given back; the lease then keeps
        that range of the segment until the client releases it or ``lease_s``
        passes. Deleting, clearing or evicting the blocks meanwhile changes
        nothing in the range.
        """
        async with self._call("GetShared", context) as call:  # type: ignore[operator]
            request = parse_request(pb.GetSharedRequest, raw)
            shm = self._require_shm()
            namespace = self._namespace(request.namespace.SerializeToString(), call)  # type: ignore[operator]
            session = shm.session(request.session_id, call.principal)
            read = self._store.read(namespace, self._hashes(request.block_hashes),  # type: ignore[attr-defined,operator]
                                    session_id=request.agent_session_id, ttl_s=request.ttl_s)
            blocks = read.open_now()
            if blocks is None:
                blocks = await read.open()
            try:
                ranges = await shm.copy_out(session, blocks)
            finally:
                read.close()
            if ranges.lease is None:
                return pb.GetSharedResponse(no_room=bool(ranges.sizes))
            return pb.GetSharedResponse(lease_id=ranges.lease.lease_id, offsets=ranges.offsets, sizes=ranges.sizes)
        raise AssertionError("unreachable")

    async def PutShared(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Store the blocks the client staged in its put segment: each is copied out, and each copy validated
        as soon as it is made (while in cache; the store's admission does not read it again).

        As a Put: nothing is stored unless every block validates (header,
        checksum, the namespace's dtype, layout and block size), and the limits
        and quota apply. A client that writes into its segment during or after
        the call can spoil only this put's copies, which then fail validation.
        """
        async with self._call("PutShared", context) as call:  # type: ignore[operator]
            request = parse_request(pb.PutSharedRequest, raw)
            shm = self._require_shm()
            namespace = self._namespace(request.namespace.SerializeToString(), call)  # type: ignore[operator]
            session = shm.session(request.session_id, call.principal)
            hashes = self._hashes(request.block_hashes)  # type: ignore[operator]
            if not len(hashes) == len(request.offsets) == len(request.sizes):
                raise InvalidArgumentError(f"{len(hashes)} hashes, {len(request.offsets)} offsets and "
                                           f"{len(request.sizes)} sizes: give one of each per block")
            for block_hash in hashes:
                block_key(namespace, block_hash)  # the hash length, before copying anything
            limits, store_config = self._config.limits, self._config.store  # type: ignore[attr-defined]
            total_bytes = sum(request.sizes)
            if total_bytes > limits.max_put_bytes:
                raise ResourceExhaustedError(f"a put of {total_bytes} bytes is over limits.max_put_bytes="
                                             f"{limits.max_put_bytes}")
            for position, nbytes in enumerate(request.sizes):
                if nbytes > store_config.max_block_bytes:
                    raise ResourceExhaustedError(f"block {position}: {nbytes} bytes is over "
                                                 f"max_block_bytes={store_config.max_block_bytes}")
            checker = BlockChecker(namespace, store_config.max_block_bytes)  # each copy checked while in cache
            framing = functools.partial(reply_head, chunk_bytes=self._chunk_bytes)  # type: ignore[attr-defined]
            blocks = CheckedBlocks(shm.copy_in(session, request.offsets, request.sizes, framing, checker.check),
                                   checker)
            priority = request.priority if request.HasField("priority") else None
            retention_s = request.retention_s if request.HasField("retention_s") else None
            self._check_deadline(context)  # type: ignore[operator]
            with self._reserve(namespace, total_bytes):  # type: ignore[operator]
                stored = await self._store.put(namespace, hashes, blocks,  # type: ignore[attr-defined]
                                               priority=priority, retention_s=retention_s,
                                               session_id=request.agent_session_id, ttl_s=request.ttl_s)
            return pb.PutResponse(num_stored=stored, num_blocks=len(blocks))
        raise AssertionError("unreachable")


async def _serve_session(shm: SharedMemoryNode, session: Session, requests: AsyncIterator[bytes]) -> None:
    """Apply the client's lease releases until its stream ends or the node begins to shut down."""

    async def releases() -> None:
        async for raw in requests:
            shm.release(session, parse_request(pb.AttachRequest, raw).release_lease_ids)

    assert shm.stopping is not None
    reader = asyncio.ensure_future(releases())
    stopping = asyncio.ensure_future(shm.stopping.wait())
    try:
        await asyncio.wait((reader, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reader, stopping):
            task.cancel()
        for task in (reader, stopping):
            with contextlib.suppress(asyncio.CancelledError):
                await task  # a reader's error (a malformed request) ends the call with its status

