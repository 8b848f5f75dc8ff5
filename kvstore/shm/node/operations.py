"""The same-host operations: a session's attach, its Gets read in place and its Puts, over the node's checks.

Each runs inside a call scope of its transport (gRPC's ``KVStoreServicer._call``,
or :meth:`SameHostOperations.dispatch` for a control channel's frame, both
admitting the caller by its token and counting the call) and checks what every
other operation checks, through the node's service (:class:`NodeChecks`): the
namespace's tenant against the caller's token, hash lengths, the request and
Put limits, the tenant quota. On top of that a session is used only by the
principal that opened it. The bytes move in :mod:`kvstore.shm.node.plane`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

import grpc

from kvstore.config import Config
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import BlockHash, Namespace, block_key
from kvstore.shm.frames import GET_SHARED, KINDS, LOOKUP, PUT_SHARED
from kvstore.shm.node.plane import SharedMemoryNode
from kvstore.shm.node.sessions import Session
from kvstore.error_codes import FailedPreconditionError
from kvstore.store.tiered import TieredStore
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.validation import BlockChecker, CheckedBlocks
from kvstore.wire import decode_hash_request, parse_request

logger = logging.getLogger(__name__)

_AUTH_KEY = "authorization"


class CallScope(Protocol):
    """What an operation uses of its call's scope (``kvstore.server.service.CallScope``)."""

    principal: Any

    def time_remaining(self) -> float | None: ...

    async def __aenter__(self) -> CallScope: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: object) -> bool: ...


class NodeChecks(Protocol):
    """What the same-host operations need of the node's service (``kvstore.server.service.NodeService``)."""

    store: TieredStore
    config: Config

    def namespace(self, wire: bytes, principal: Any) -> Namespace: ...

    def hashes(self, block_hashes: Sequence[bytes]) -> Sequence[BlockHash]: ...

    def reserve(self, namespace: Namespace, incoming_bytes: int) -> contextlib.AbstractContextManager[None]: ...

    def check_deadline(self, time_remaining: float | None) -> None: ...

    async def lookup(self, principal: Any, request: Any) -> pb.LookupResponse: ...

    def scope(self, method: str, metadata: Sequence[tuple[str, Any]], peer: str,
              deadline: float | None) -> CallScope: ...


class SameHostOperations:
    """The node's same-host operations (see the module docstring).

    Args:
        checks: the node's service.
        plane: the node's same-host data plane.
        failed: the exception a call scope raises for a call that ended with a status; it carries ``code`` (a
            ``grpc.StatusCode``) and ``message`` (``kvstore.server.service.CallFailed``).

    Attributes:
        plane: as given.
        offering: whether the node offers the same-host data plane now; once ``False``, Capabilities offers
            none and every same-host call is FAILED_PRECONDITION (the client then uses gRPC).
    """

    def __init__(self, checks: NodeChecks, plane: SharedMemoryNode, failed: type[Exception]) -> None:
        self._checks = checks
        self.plane = plane
        self._failed = failed
        self._tokens: dict[int, tuple[tuple[str, Any], ...]] = {}  # session id -> its Attach call's token
        self.offering = True
        plane.serve_frame = self.dispatch

    # ------------------------------------------------------------------ sessions

    def offer(self) -> tuple[str, str]:
        """The node's same-host offer: its host id and handoff socket (``Capabilities``)."""
        return self.plane.host_id, self.plane.handoff_address

    def open(self, principal: Any, metadata: Sequence[tuple[str, Any]] | None) -> Session:
        """A new session for ``principal``, whose control calls are admitted again with ``metadata``'s token.

        Raises:
            ResourceExhaustedError: if the node or the tenant has all the sessions it may.
            SegmentError: if the segments cannot be made.
        """
        session = self.plane.open(principal)
        self._tokens[session.session_id] = tuple((k, v) for k, v in (metadata or ()) if k.lower() == _AUTH_KEY)
        return session

    def attach_reply(self, session: Session) -> pb.AttachReply:
        """The one message of a session's ``Attach`` stream: its id, grant, segment sizes and times."""
        config = self.plane.config
        return pb.AttachReply(session_id=session.session_id, grant=session.grant,
                              get_segment_bytes=session.get_segment.nbytes,
                              put_segment_bytes=session.put_segment.nbytes,
                              lease_s=config.lease_s, grant_s=config.grant_s)

    async def serve(self, session: Session, requests: AsyncIterator[bytes]) -> None:
        """Apply the client's lease releases until its stream ends or the node begins to shut down.

        Raises:
            InvalidArgumentError: on a malformed request (the stream ends with that status).
        """
        plane = self.plane

        async def releases() -> None:
            async for raw in requests:
                plane.release(session, parse_request(pb.AttachRequest, raw).release_lease_ids)

        assert plane.stopping is not None
        reader = asyncio.ensure_future(releases())
        stopping = asyncio.ensure_future(plane.stopping.wait())
        try:
            await asyncio.wait((reader, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, stopping):
                task.cancel()
            for task in (reader, stopping):
                with contextlib.suppress(asyncio.CancelledError):
                    await task  # a reader's error (a malformed request) ends the call with its status

    def close(self, session: Session) -> None:
        """End a session: its control calls are no longer admitted, its leases and segments go."""
        self._tokens.pop(session.session_id, None)
        self.plane.close_session(session)

    # ------------------------------------------------------------------ Get and Put

    async def get_shared(self, principal: Any, request: pb.GetSharedRequest,
                         fds: list[int] | None) -> pb.GetSharedResponse:
        """The blocks of the longest cached prefix under one lease, in place where they lie in the node's pool.

        The prefix is read as a Get reads it (held, so eviction cannot take it)
        and stays held until the lease ends: the client releases it, or
        ``lease_s`` passes. Blocks in the pool are named where they lie (their
        slab and offset; a slab the session has not seen yet goes into ``fds``
        as a read-only descriptor, and into the reply's ``new_slabs``) when the
        request asks for that and the transport carries descriptors (``fds`` is
        a list); every other block is copied once into the session's get segment.

        Args:
            principal: the caller.
            request: the request.
            fds: where to put descriptors to send with the reply (the caller closes them once sent); ``None``
                when the transport carries none (gRPC).

        Raises:
            FailedPreconditionError: if the session is unknown (ended); PermissionDeniedError if another
                principal opened it; the namespace's and the hashes' errors (``NodeService.namespace``).
        """
        checks = self._checks
        namespace = checks.namespace(request.namespace.SerializeToString(), principal)
        session = self._session(request.session_id, principal)
        read = checks.store.read(namespace, checks.hashes(request.block_hashes), session_id=request.agent_session_id,
                                ttl_s=request.ttl_s)
        blocks = read.open_now()
        if blocks is None:
            blocks = await read.open()
        return await self.plane.lease_blocks(session, read, blocks, fds if request.in_place else None)

    async def put_shared(self, principal: Any, request: pb.PutSharedRequest,
                         time_remaining: Callable[[], float | None]) -> pb.PutResponse:
        """Store the blocks the client staged in its put segment: each is copied once, into the node's pool where
        it has room (else into memory of the node's own), and each copy validated as soon as it is made.

        As a Put: nothing is stored unless every block validates (header,
        checksum, the namespace's dtype, layout and block size), and the limits
        and quota apply. A client that writes into its segment during or after
        the call can spoil only this put's copies, which then fail validation.

        Raises:
            InvalidArgumentError: on mismatched counts, a bad range or a bad block.
            ResourceExhaustedError: over ``limits.max_put_bytes``, ``store.max_block_bytes`` or the quota.
            DeadlineExceededError: if the deadline passed before the blocks were stored.
        """
        checks = self._checks
        namespace = checks.namespace(request.namespace.SerializeToString(), principal)
        session = self._session(request.session_id, principal)
        hashes = checks.hashes(request.block_hashes)
        if not len(hashes) == len(request.offsets) == len(request.sizes):
            raise InvalidArgumentError(f"{len(hashes)} hashes, {len(request.offsets)} offsets and "
                                       f"{len(request.sizes)} sizes: give one of each per block")
        for block_hash in hashes:
            block_key(namespace, block_hash)  # the hash length, before copying anything
        limits, store_config = checks.config.limits, checks.config.store
        total_bytes = sum(request.sizes)
        if total_bytes > limits.max_put_bytes:
            raise ResourceExhaustedError(f"a put of {total_bytes} bytes is over limits.max_put_bytes="
                                         f"{limits.max_put_bytes}")
        for position, nbytes in enumerate(request.sizes):
            if nbytes > store_config.max_block_bytes:
                raise ResourceExhaustedError(f"block {position}: {nbytes} bytes is over "
                                             f"max_block_bytes={store_config.max_block_bytes}")
        checker = BlockChecker(namespace, store_config.max_block_bytes)  # each copy checked while in cache
        copies = await self.plane.copy_in(session, namespace.tag, request.offsets, request.sizes, checker.check)
        priority = request.priority if request.HasField("priority") else None
        retention_s = request.retention_s if request.HasField("retention_s") else None
        began = False
        try:
            checks.check_deadline(time_remaining())
            with checks.reserve(namespace, total_bytes):
                began = True  # from here on the copies are freed when the store's put has ended (store_then)
                stored = await store_then(checks.store.put(namespace, hashes, CheckedBlocks(copies.blocks, checker),
                                                            priority=priority, retention_s=retention_s,
                                                            session_id=request.agent_session_id,
                                                            ttl_s=request.ttl_s),
                                           copies.close)
        except BaseException:
            if not began:
                copies.close()
            raise
        return pb.PutResponse(num_stored=stored, num_blocks=len(copies.blocks))

    def _session(self, session_id: int, principal: Any) -> Session:
        if not self.offering:
            raise FailedPreconditionError("this node offers no same-host data plane; use Get and Put")
        return self.plane.session(session_id, principal)

    # ------------------------------------------------------------------ control channels

    async def dispatch(self, session: Session, kind: int, body: bytes,
                       deadline: float | None) -> tuple[int, bytes, list[int]]:
        """Serve one control-channel request of ``session``: its reply's status code, body and descriptors.

        The call is admitted as the session's ``Attach`` call was (its token,
        checked again now), counted, and its errors turned into their statuses,
        by the node service's scope; the operation is the one gRPC runs.

        Returns:
            ``(code, body, fds)``: 0, the reply message and the descriptors to send with it; or a status code,
            its details in UTF-8, and no descriptor.
        """
        method = KINDS[kind]
        fds: list[int] = []
        scope = self._checks.scope(method, self._tokens.get(session.session_id, ()),
                                   f"shm-session:{session.session_id:x}", deadline)
        try:
            async with scope as call:
                if kind == LOOKUP:
                    reply: Any = await self._checks.lookup(call.principal, decode_hash_request(pb.LookupRequest,
                                                                                             body))
                elif kind == GET_SHARED:
                    reply = await self.get_shared(call.principal, parse_request(pb.GetSharedRequest, body), fds)
                else:
                    assert kind == PUT_SHARED
                    reply = await self.put_shared(call.principal, parse_request(pb.PutSharedRequest, body),
                                                  call.time_remaining)
        except self._failed as failed:
            _close_all(fds)
            return getattr(failed, "code").value[0], getattr(failed, "message").encode(), []
        except BaseException:
            _close_all(fds)
            raise
        return grpc.StatusCode.OK.value[0], reply.SerializeToString(), fds


async def store_then(put: Awaitable[int], then: Callable[[], None]) -> int:
    """Await a store put; run ``then`` once it has ended, also when the caller is cancelled first (a put runs to
    its end, so what it reads must stay until then). Same-host and bulk Puts free their staged ranges with it."""
    task = asyncio.ensure_future(put)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def ended(task: asyncio.Future[int]) -> None:
            if not task.cancelled():
                task.exception()  # observed: the caller that would have had it went away
            then()

        task.add_done_callback(ended)
        raise
    finally:
        if task.done():
            then()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
