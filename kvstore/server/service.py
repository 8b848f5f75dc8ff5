"""The node's service: its checks and operations, whatever transport carries a call.

Two transports reach a node: gRPC (``kvstore.server.servicer``, every
client) and a same-host session's control channels (``kvstore.shm.node.control``).
Both call the one :class:`NodeService`, so a call is checked the same way
whichever way it came: the caller's token, the namespace's tenant against
it, the hash algorithm, the request limits, the tenant quota, and the same
operation on the same store. The gRPC servicer wraps each call in its own
scope (``KVStoreServicer._call``, which deals with grpc.aio's contexts); any
other transport uses :meth:`NodeService.scope`, which admits the call,
counts it in the metrics, and turns a raised kvstore error into its status
(:class:`CallFailed`), with no gRPC context in sight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NoReturn, Sequence, cast

import grpc

from kvstore.config import Config
from kvstore.errors import InvalidArgumentError, KVStoreError, UnavailableError
from kvstore.keys import NAMESPACE_FIELD_MAX_BYTES, BlockHash, HashAlgorithm, Namespace
from kvstore.server.admission import Admission, Ticket
from kvstore.server.auth import Principal
from kvstore.server.budgets import PutBudget, ReplyBudget
from kvstore.server.failure import CallFailed
from kvstore.server.metrics import ServiceMetrics
from kvstore.server.quota import TenantQuota
from kvstore.server.tenants import TenantTags
from kvstore.error_codes import DeadlineExceededError, UnauthenticatedError, status_of
from kvstore.store.tiered import TieredStore
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import (
    MAX_NAMESPACE_WIRE_BYTES,
    HashRequest,
    chunk_bytes_for,
    explanation_to_pb,
    lookup_to_pb,
    namespace_from_pb,
    namespace_to_pb,
    parse_request,
    stats_to_pb,
)

__all__ = ["CallFailed", "CallScope", "NamespaceCache", "NodeService"]

if TYPE_CHECKING:
    from kvstore.bulk.node.operations import BulkOperations
    from kvstore.shm.node.operations import SameHostOperations

logger = logging.getLogger(__name__)

NAMESPACE_CACHE_BYTES = 1 << 20
"""Bytes of validated namespaces a node keeps by their wire form (a node serves a handful; 1 MiB holds hundreds)."""

NAMESPACE_ENTRY_OVERHEAD_BYTES = 768
"""What :class:`NamespaceCache` counts per entry beyond twice its wire bytes: the ``Namespace`` object, its
strings' headers and root, and the dict's share (CPython 3.11, measured with ``tracemalloc``)."""


class NamespaceCache:
    """Validated namespaces by their serialized form, least recently used first out, bounded in bytes.

    Each entry counts twice its wire bytes (the key, and the parsed strings)
    plus :data:`NAMESPACE_ENTRY_OVERHEAD_BYTES`; the service only adds
    namespaces whose caller was authorized, and the wire form is at most
    :data:`~kvstore.wire.MAX_NAMESPACE_WIRE_BYTES`, so no caller can make
    it hold more than ``max_bytes``.

    Args:
        max_bytes: the bound, bytes.
    """

    def __init__(self, max_bytes: int = NAMESPACE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[bytes, Namespace] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, wire: object) -> bool:
        return wire in self._entries

    @staticmethod
    def entry_bytes(wire: bytes) -> int:
        """The bytes one entry counts for."""
        return 2 * len(wire) + NAMESPACE_ENTRY_OVERHEAD_BYTES

    def get(self, wire: bytes) -> Namespace | None:
        """The namespace cached under ``wire``, now the most recently used; ``None`` if none is."""
        namespace = self._entries.get(wire)
        if namespace is not None:
            self._entries.move_to_end(wire)
        return namespace

    def put(self, wire: bytes, namespace: Namespace) -> None:
        """Cache ``namespace`` under ``wire``, dropping the least recently used entries past ``max_bytes``."""
        if wire in self._entries:
            return
        self._entries[wire] = namespace
        self.nbytes += self.entry_bytes(wire)
        while self.nbytes > self.max_bytes and self._entries:
            old, _ = self._entries.popitem(last=False)
            self.nbytes -= self.entry_bytes(old)


class NodeService:
    """One node's checks and operations over its store, for every transport (see the module docstring).

    Args:
        store: the started store; the service never closes it.
        config: the whole configuration; ``server.max_message_bytes`` sets the chunk size,
            ``limits.max_hashes_per_request`` the largest request, ``limits.tenant_quota_bytes`` the bytes one
            tenant may hold, ``security.*`` the tokens (see ``kvstore.server.admission``).
        metrics: where to count calls; ``None`` for no metrics.
        admission: the token check and in-flight limit of every call; built from ``config`` when ``None``.
        tenants: the pairs tenant -> namespace of this node (``kvstore.server.tenants``: the quota's, and the
            event stream's routes); a new one from ``config`` when ``None``.

    Raises:
        ConfigError: when ``admission`` is ``None`` and the tokens of ``config`` are unusable.

    Attributes:
        store, config, metrics: as given.
        admission: admits every call (token, in-flight slot).
        require_sha256: namespaces must use SHA-256 (``security.require_sha256``; when unset, on exactly when
            authentication is on).
        namespaces: validated namespaces of authorized calls, by their wire form.
        quota: the per-tenant byte quota, ``None`` without one.
        replies: the budget of Get replies in flight (``kvstore.server.budgets.ReplyBudget``).
        puts: the budget of Put bytes being received (``kvstore.server.budgets.PutBudget``).
        chunk_bytes: the block bytes one Get reply message carries.
        same_host: the same-host operations (``kvstore.shm.node.operations``), ``None`` when the node offers
            no same-host data plane.
        bulk: the bulk path's control calls (``kvstore.bulk.node.operations``), ``None`` when the node offers none.
        accepting: ``False`` once shutdown began (new calls get UNAVAILABLE).
    """

    def __init__(self, store: TieredStore, config: Config, metrics: ServiceMetrics | None = None,
                 admission: Admission | None = None, *, tenants: TenantTags | None = None) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.admission = admission if admission is not None else Admission.from_config(config)
        self.chunk_bytes = chunk_bytes_for(config.server.max_message_bytes)
        self.max_hashes = config.limits.max_hashes_per_request
        security = config.security
        self._auth = self.admission.authenticates or bool(security.auth_tokens or security.auth_tokens_file)
        self.require_sha256 = self._auth if security.require_sha256 is None else security.require_sha256
        self.namespaces = NamespaceCache()
        self.tenants = tenants if tenants is not None else TenantTags.from_config(config, store.namespace_bytes)
        self.quota = TenantQuota.from_config(config, store.namespace_bytes, self.tenants)
        self.replies = ReplyBudget.from_config(config)
        self.puts = PutBudget.from_config(config)
        self.same_host: SameHostOperations | None = None
        self.bulk: BulkOperations | None = None
        self.accepting = True

    # ------------------------------------------------------------------ checks

    def namespace(self, wire: bytes, principal: Principal | None) -> Namespace:
        """The namespace of a request (its serialized ``Namespace``), once ``principal`` may use its tenant and hash.

        A namespace over :data:`~kvstore.wire.MAX_NAMESPACE_WIRE_BYTES`
        is refused before it is parsed. Validated namespaces are kept by their
        serialized form in :attr:`namespaces` (bounded in bytes), so a worker's
        repeated namespace is parsed once, but only once the caller is allowed
        to use it: a refused caller leaves nothing behind. The tenant and hash
        checks run on every call.

        Raises:
            InvalidArgumentError: on a malformed or oversized namespace (each text field has a limit,
                ``kvstore.keys.NAMESPACE_FIELD_MAX_BYTES``), or xxh3 where SHA-256 is required.
            UnauthenticatedError: if authentication is on and the call carries no principal.
            PermissionDeniedError: if the caller's token does not cover the namespace's ``cache_salt``.
        """
        namespace = self.namespaces.get(wire)
        fresh = namespace is None
        if namespace is None:
            if len(wire) > MAX_NAMESPACE_WIRE_BYTES:
                raise InvalidArgumentError(
                    f"namespace of {len(wire)} bytes is over the limit of {MAX_NAMESPACE_WIRE_BYTES}; each field has "
                    f"its own limit: {NAMESPACE_FIELD_MAX_BYTES}")
            namespace = namespace_from_pb(parse_request(pb.Namespace, wire))
        if self._auth:
            if principal is None:  # fail closed: an authenticating node never serves an anonymous call
                raise UnauthenticatedError("authentication is on but this call was not authenticated")
            principal.authorize(namespace.cache_salt)
            self.tenants.note(namespace)  # its blocks' events go to its tenant's stream (kvstore.events.access)
        if self.require_sha256 and namespace.hash_algorithm is not HashAlgorithm.SHA256:
            raise InvalidArgumentError(
                "this server requires namespace.hash_algorithm='sha256' (security.require_sha256, on by default "
                "with authentication): xxh3 collisions can be forced, so untrusted clients must hash with SHA-256"
            )
        if fresh:
            self.namespaces.put(wire, namespace)
        return namespace

    def hashes(self, block_hashes: Sequence[bytes]) -> Sequence[BlockHash]:
        """``block_hashes`` as the store takes them, once there are no more than ``limits.max_hashes_per_request``
        (the store checks each one's length).

        Raises:
            InvalidArgumentError: if there are more.
        """
        if len(block_hashes) > self.max_hashes:
            raise InvalidArgumentError(
                f"{len(block_hashes)} block hashes is over max_hashes_per_request={self.max_hashes}; split the request")
        return cast("Sequence[BlockHash]", block_hashes)  # a request's hashes are block hashes (a NewType of bytes)

    def reserve(self, namespace: Namespace, incoming_bytes: int) -> contextlib.AbstractContextManager[None]:
        """Hold ``incoming_bytes`` of the namespace's tenant quota while a put stores them (without a quota: note
        the namespace as written, for its tenant's event routes and the next start, ``TenantTags.writing``).

        Raises:
            ResourceExhaustedError: (on entering) if the put would take the tenant over its quota.
        """
        if self.quota is None:
            return self.tenants.writing(namespace)
        return self.quota.reserve(namespace, incoming_bytes)

    @staticmethod
    def check_deadline(time_remaining: float | None) -> None:
        """Raise if a call's deadline has passed (``time_remaining`` seconds, ``None`` for none).

        Raises:
            DeadlineExceededError: if ``time_remaining`` is 0 or less.
        """
        if time_remaining is not None and time_remaining <= 0:
            raise DeadlineExceededError("the deadline passed before the blocks were stored")

    # ------------------------------------------------------------------ operations

    async def lookup(self, principal: Principal | None, request: HashRequest) -> pb.LookupResponse:
        """The longest cached prefix of a Lookup request's hashes, and each block's tier."""
        namespace = self.namespace(request.namespace, principal)
        hashes = self.hashes(request.block_hashes)
        located = await self.store.locate(namespace, hashes, session_id=request.session_id, ttl_s=request.ttl_s,
                                          request_id=request.request_id)
        return lookup_to_pb(located, self.store.tier_names)

    async def explain(self, principal: Principal | None, request: pb.ExplainRequest) -> pb.ExplainResponse:
        """Each block of a request, hit or the cause of its miss (``kvstore explain``); a ``request_id`` names a
        recent Lookup's namespace and blocks (the caller's token must cover its tenant).

        Raises:
            InvalidArgumentError: on a ``request_id`` the node does not remember, or a malformed namespace or hash.
        """
        if request.request_id:
            found = self.store.recent_request(request.request_id)
            if found is None:
                raise InvalidArgumentError(f"no recent Lookup named request_id {request.request_id!r} (the node "
                                           f"keeps the last ones only)")
            namespace = self.namespace(namespace_to_pb(found[0]).SerializeToString(), principal)
            hashes: Sequence[BlockHash] = cast("list[BlockHash]", found[1])  # a Lookup's, checked then
        else:
            namespace = self.namespace(request.namespace.SerializeToString(), principal)
            hashes = self.hashes(request.block_hashes)
        blocks = await self.store.explain(namespace, hashes)
        return explanation_to_pb(blocks, namespace, self.store.misses.near_namespace(namespace, blocks))

    async def delete(self, principal: Principal | None, request: HashRequest) -> pb.DeleteResponse:
        """Delete a Delete request's blocks from every tier."""
        namespace = self.namespace(request.namespace, principal)
        hashes = self.hashes(request.block_hashes)
        return pb.DeleteResponse(num_deleted=await self.store.delete(namespace, hashes))

    async def clear(self, principal: Principal | None, request: pb.ClearRequest) -> pb.ClearResponse:
        """Delete every block of one namespace (the caller's token must cover its tenant)."""
        namespace = self.namespace(request.namespace.SerializeToString(), principal)
        return pb.ClearResponse(num_deleted=await self.store.clear(namespace))

    def stats(self) -> pb.StatsResponse:
        """Per-tier counts, summed over every tenant (any valid token may read them)."""
        return stats_to_pb(self.store.stats())

    # ------------------------------------------------------------------ calls of other transports

    def scope(self, method: str, metadata: Sequence[tuple[str, Any]], peer: str,
              deadline: float | None) -> CallScope:
        """The scope of one call that did not come over gRPC: ``async with service.scope(...) as call``.

        Args:
            method: the gRPC method whose operation it is (``Lookup``, ``GetShared``, ``PutShared``).
            metadata: the call's credentials (``authorization``), as gRPC metadata.
            peer: the connection its in-flight slot counts against.
            deadline: ``time.monotonic()`` seconds by which the client wants the call done, ``None`` for none.
        """
        return CallScope(self, method, metadata, peer, deadline)

    def count(self, method: str, code: str, start_s: float) -> None:
        """Count one finished call in the metrics (``start_s`` from ``time.perf_counter()``)."""
        if self.metrics is not None:
            self.metrics.observe(method, code, time.perf_counter() - start_s)


class CallScope:
    """One call of a transport other than gRPC, from admission to its status (:meth:`NodeService.scope`).

    On entry it refuses the call while shutting down (UNAVAILABLE) and admits it
    (token, in-flight slot); on exit it gives the slot back, counts the call, and
    turns a raised kvstore error into :class:`CallFailed` carrying its status. A
    call that returns after its deadline ends with DEADLINE_EXCEEDED, as gRPC
    would end it.

    Attributes:
        principal: the caller (``None`` without authentication), once admitted.
    """

    __slots__ = ("_service", "_method", "_metadata", "_peer", "_deadline", "_start_s", "_ticket", "principal")

    def __init__(self, service: NodeService, method: str, metadata: Sequence[tuple[str, Any]], peer: str,
                 deadline: float | None) -> None:
        self._service = service
        self._method = method
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline
        self._ticket: Ticket | None = None
        self.principal: Principal | None = None

    def time_remaining(self) -> float | None:
        """Seconds left before the call's deadline (``CLOCK_MONOTONIC``), ``None`` for none."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    async def __aenter__(self) -> CallScope:
        self._start_s = time.perf_counter()
        service = self._service
        try:
            if not service.accepting:
                raise UnavailableError("the server is shutting down")
            ticket = service.admission.admit_call(self._method, self._metadata, self._peer)
        except KVStoreError as exc:
            self._fail(exc)
        self._ticket = ticket
        self.principal = ticket.principal
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: object) -> bool:
        service = self._service
        if self._ticket is not None:
            service.admission.release(self._ticket)
        if isinstance(exc, asyncio.CancelledError):
            service.count(self._method, "CANCELLED", self._start_s)
            return False
        if exc is not None and not isinstance(exc, Exception):
            return False  # a KeyboardInterrupt goes on
        remaining = self.time_remaining()
        if remaining is not None and remaining <= 0:  # over for its client already: its reply would come too late
            service.count(self._method, "DEADLINE_EXCEEDED", self._start_s)
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed on the node") from exc
        if exc is None:
            service.count(self._method, "OK", self._start_s)
            return False
        self._fail(exc)
        return False

    def _fail(self, exc: BaseException) -> NoReturn:
        status, message = status_of(exc)
        if status is grpc.StatusCode.INTERNAL:
            logger.error("%s failed", self._method, exc_info=exc,
                         extra={"fields": {"method": self._method, "code": status.name}})
        else:
            logger.debug("%s %s: %s", self._method, status.name, message)
        self._service.count(self._method, status.name, self._start_s)
        raise CallFailed(status, message) from None
