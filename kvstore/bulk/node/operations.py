"""The bulk path's control calls (``BulkGet``, ``BulkPut``): the node's checks, then a lease or room, then a grant.

Each runs inside its transport's call scope (gRPC's ``KVStoreServicer._call``,
or the node service's scope for a call that came on a bulk connection,
:meth:`BulkOperations.dispatch`: the caller's token, an in-flight slot, the
metrics, the status of an error)
and checks what every other operation checks, through the node's service
(:class:`~kvstore.shm.node.operations.NodeChecks`): the namespace's tenant
against the caller's token, the hash algorithm and lengths, the request and
Put limits. A ``BulkGet`` leases the longest cached prefix as a Get reads it
(held, so eviction cannot take it) and a ``BulkPut`` reserves room for its
blocks (staged ranges of the shared pool); either is then named by a one-time
grant (:mod:`kvstore.bulk.node.grants`), which the listener
(:mod:`kvstore.bulk.node.listener`) redeems. A Put's blocks, once arrived and
checked, are stored as a ``PutShared``'s are: the tenant quota reserved, one
``store.put`` of the node's own copies, nothing stored unless all passed.
"""

from __future__ import annotations

from typing import Any, Callable

import grpc

from kvstore.bulk.frames import GET
from kvstore.bulk.node.grants import GetGrant, Grant, GrantTable, PutGrant
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import block_key
from kvstore.shm.node.operations import NodeChecks, store_then
from kvstore.shm.node.pool import SharedPool
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.server.failure import CallFailed
from kvstore.validation import BlockChecker, CheckedBlocks
from kvstore.wire import parse_request

_AUTH_KEY = "authorization"


class BulkOperations:
    """The node's bulk control calls (see the module docstring).

    Args:
        checks: the node's service.
        grants: the node's grant table.
        pool: the store's memory tier when it is the shared pool (a Put's blocks are received straight into
            staged ranges of it); ``None``: into memory of the node's own.
        offer: what ``Capabilities`` offers: ``(host, port, tls)`` of the listener.

    Attributes:
        grants, pool, offer: as given.
    """

    def __init__(self, checks: NodeChecks, grants: GrantTable, pool: SharedPool | None,
                 offer: tuple[str, int, bool]) -> None:
        self._checks = checks
        self.grants = grants
        self.pool = pool
        self.offer = offer

    async def dispatch(self, kind: int, token: bytes, body: bytes, peer: str
                       ) -> tuple[grpc.StatusCode, Any, Grant | None]:
        """Run a ``BulkGet`` or ``BulkPut`` that came on a bulk connection, as gRPC would run it.

        The call is admitted by the node's service (:meth:`NodeService.scope`: the
        token, an in-flight slot of ``peer``, the metrics, the status of an error),
        and runs the operation gRPC runs.

        Args:
            kind: :data:`~kvstore.bulk.frames.GET` or :data:`~kvstore.bulk.frames.PUT`.
            token: the caller's ``authorization`` value, UTF-8 (empty for none).
            body: the serialized request.
            peer: the connection its in-flight slot counts against.

        Returns:
            ``(OK, reply, grant)``: the reply (no grant token in it) and what it granted, to transfer now on the
            same connection (``None``: nothing, or no room); or a status code, its details and ``None``.
        """
        method = "BulkGet" if kind == GET else "BulkPut"
        metadata = ((_AUTH_KEY, token.decode(errors="replace")),) if token else ()
        held: list[Grant] = []
        try:
            async with self._checks.scope(method, metadata, peer, None) as call:
                if kind == GET:
                    reply: Any = await self.get(call.principal, parse_request(pb.BulkGetRequest, body), held)
                else:
                    reply = await self.put(call.principal, parse_request(pb.BulkPutRequest, body), held)
        except CallFailed as failed:
            for grant in held:
                grant.finish()
            return failed.code, failed.message, None
        except BaseException:
            for grant in held:
                grant.finish()
            raise
        return grpc.StatusCode.OK, reply, held[0] if held else None

    async def get(self, principal: Any, request: pb.BulkGetRequest,
                  held: list[Grant] | None = None) -> pb.BulkGetResponse:
        """Lease the longest cached prefix of the request for one transfer; its sizes and grant.

        Args:
            principal: the caller.
            request: the request.
            held: for a call that came on a bulk connection: the grant is put here, for that connection to
                transfer at once, instead of a token into the reply (``None``: a token, for a gRPC call).

        Returns:
            The blocks' sizes and the grant; no grant for an empty prefix; ``no_room`` (nothing leased) when
            the grant budget is full now.

        Raises:
            InvalidArgumentError, UnauthenticatedError, PermissionDeniedError: the namespace's and the hashes'
                errors (``NodeService.namespace``).
        """
        checks = self._checks
        namespace = checks.namespace(request.namespace.SerializeToString(), principal)
        read = checks.store.read(namespace, checks.hashes(request.block_hashes), session_id=request.agent_session_id,
                                ttl_s=request.ttl_s)
        blocks = read.open_now()
        if blocks is None:
            blocks = await read.open()
        if not blocks:
            read.close()
            return pb.BulkGetResponse()
        sizes = [memoryview(block).nbytes for block in blocks]
        grant = GetGrant(namespace.cache_salt, list(blocks), sizes, read.close)
        token = self._grant(grant, held)
        if token is None:
            read.close()
            return pb.BulkGetResponse(no_room=True)
        return pb.BulkGetResponse(grant=token, sizes=sizes, grant_s=self.grants.grant_s)

    def _grant(self, grant: Grant, held: list[Grant] | None) -> bytes | None:
        """A token for ``grant`` (``b""`` when it goes into ``held`` instead); ``None`` when the budget is full."""
        if held is None:
            return self.grants.issue(grant)
        if not self.grants.take(grant):
            return None
        held.append(grant)
        return b""

    async def put(self, principal: Any, request: pb.BulkPutRequest,
                  held: list[Grant] | None = None) -> pb.BulkPutResponse:
        """Reserve room for a Put's blocks; the grant to send them with (``held``: as :meth:`get`).

        Raises:
            InvalidArgumentError: on mismatched counts, a bad hash or a block size of 0.
            ResourceExhaustedError: over ``limits.max_put_bytes`` or ``store.max_block_bytes``.
            UnauthenticatedError, PermissionDeniedError: as ``NodeService.namespace``.
        """
        checks = self._checks
        namespace = checks.namespace(request.namespace.SerializeToString(), principal)
        hashes = list(checks.hashes(request.block_hashes))
        sizes = list(request.sizes)
        if len(hashes) != len(sizes):
            raise InvalidArgumentError(f"{len(hashes)} hashes and {len(sizes)} sizes: give one of each per block")
        for block_hash in hashes:
            block_key(namespace, block_hash)  # the hash length, before anything is reserved
        limits, store_config = checks.config.limits, checks.config.store
        total_bytes = sum(sizes)
        if total_bytes > limits.max_put_bytes:
            raise ResourceExhaustedError(f"a put of {total_bytes} bytes is over limits.max_put_bytes="
                                         f"{limits.max_put_bytes}")
        for position, nbytes in enumerate(sizes):
            if nbytes <= 0:
                raise InvalidArgumentError(f"block {position}: a size of {nbytes} bytes")
            if nbytes > store_config.max_block_bytes:
                raise ResourceExhaustedError(f"block {position}: {nbytes} bytes is over "
                                             f"max_block_bytes={store_config.max_block_bytes}")
        if not hashes:
            return pb.BulkPutResponse()
        staging = self.pool.stage(namespace.tag, sizes) if self.pool is not None else None
        release: Callable[[], None] = staging.close if staging is not None else _nothing
        checker = BlockChecker(namespace, store_config.max_block_bytes)
        priority = request.priority if request.HasField("priority") else None
        retention_s = request.retention_s if request.HasField("retention_s") else None
        grant: PutGrant

        async def commit(blocks: list[Any]) -> pb.PutResponse:
            close = grant.take_release()  # the room is freed once the store's put has ended, not before
            began = False
            try:
                with checks.reserve(namespace, total_bytes):
                    began = True
                    stored = await store_then(
                        checks.store.put(namespace, hashes, CheckedBlocks(blocks, checker), priority=priority,
                                         retention_s=retention_s, session_id=request.agent_session_id,
                                         ttl_s=request.ttl_s), close)
            except BaseException:
                if not began:
                    close()
                raise
            grant.finish()  # its budget back before the client has the reply (its next call may need it)
            return pb.PutResponse(num_stored=stored, num_blocks=len(blocks))

        grant = PutGrant(namespace.cache_salt, sizes, release,
                         staging.targets if staging is not None else None,
                         staging.blocks if staging is not None else None, checker.check, commit)
        token = self._grant(grant, held)
        if token is None:
            release()
            return pb.BulkPutResponse(no_room=True)
        return pb.BulkPutResponse(grant=token, grant_s=self.grants.grant_s)


def _nothing() -> None:
    """Nothing to give back (blocks received into the node's own memory)."""
