"""The logic of both clients, written once with no I/O: settings, the API, retries, fan-out and membership."""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, NoReturn, Sequence

import grpc
from grpc_health.v1 import health_pb2

from kvstore.api import Block, StoreStats
from kvstore.blocks.copying import blocks_for_put, check_destinations
from kvstore.blocks.encoding import encode_for_put
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import BlockHash, Namespace, check_block_hashes
from kvstore.security import call_metadata
from kvstore.routing import (
    DEFAULT_DOWN_BACKOFF_S,
    DEFAULT_MAX_DOWN_BACKOFF_S,
    Membership,
    NodeStatus,
    Partition,
    RendezvousRouter,
)
from kvstore.blocks.lease import BlockLease
from kvstore.shm.client.link import SharedMemoryLink, UseGrpc
from kvstore.bulk.client.link import BulkLink
from kvstore.error_codes import DeadlineExceededError, error_of
from kvstore.validation import check_count, check_put, check_seconds, check_session_id, check_ttl_s
from kvstore.wire import cached_namespace_pb, chunk_bytes_for, explanation_from_pb, stats_from_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.calls import (
    AS_BYTES,
    AS_LEASE,
    AS_TENSORS,
    MAX_SHARED_TRIES,
    UNCLEAR_CODES,
    IntoTensors,
    delete_rpc,
    first,
    get_rpc,
    health_method,
    health_name,
    lookup_rpc,
    merge_copied,
    put_rpc,
    stub,
    total,
    unknown_service,
)
from kvstore.client.plan import SLOT, UNARY, Attempt, BulkOf, Pause, Plan, Probe, Rpc, SessionOf, Step, Together
from kvstore.client.channel import DEFAULT_MAX_MESSAGE_BYTES, FALSE_WORDS, TargetChannel, resolve_targets
from kvstore.client.retry import DEFAULT_BACKOFF_S, DEFAULT_MAX_BACKOFF_S, DEFAULT_RETRIES, Backoff, Retry
from kvstore.client.stats import merge_health, merge_store_stats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_INFLIGHT = 64
DEFAULT_PROBE_TIMEOUT_S = 1.0
"""Deadline of one health probe of a down node, seconds."""
MAX_TIMEOUT_S = 1e9
"""Longest deadline of a call, seconds (about 31 years): gRPC fails a call at once whose deadline,
in nanoseconds since the epoch, overflows 64 bits (from about 7.4e9 s from now)."""


def _raise_typed(exc: grpc.RpcError) -> NoReturn:
    raise error_of(exc.code(), exc.details()) from None



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
        down_backoff_s = check_seconds("down_backoff_s", down_backoff_s)
        return cls(
            timeout_s=check_seconds("timeout_s", timeout_s, open_minimum=True, maximum_s=MAX_TIMEOUT_S),
            max_inflight=check_count("max_inflight", max_inflight, 1),
            retries=check_count("retries", retries, 0),
            backoff_s=check_seconds("backoff_s", backoff_s),
            max_backoff_s=check_seconds("max_backoff_s", max_backoff_s),
            probe_timeout_s=check_seconds("probe_timeout_s", probe_timeout_s, open_minimum=True, maximum_s=MAX_TIMEOUT_S),
            down_backoff_s=down_backoff_s,
            max_down_backoff_s=check_seconds("max_down_backoff_s", max_down_backoff_s, minimum_s=down_backoff_s),
        )


class ClientCore:
    """What :class:`KVStoreClient` and :class:`AsyncKVStoreClient` share: every setting, every call's request and
    merge, the retries, the fan-out over nodes and their membership, written once.

    The logic is a generator per call that yields the I/O it needs (an attempt on
    a node, a pause, parts run at once, a slot, a probe) and is sent back the
    outcome (``kvstore.client.plan``); each client is the
    :class:`~kvstore.client.plan.Transport` that performs the I/O
    (:meth:`execute`), the synchronous one in the calling thread and worker
    threads, the asyncio one on its loop. The public methods return the
    transport's result: a value from :class:`KVStoreClient`, an awaitable from
    :class:`AsyncKVStoreClient`. The constructor's arguments are
    :class:`KVStoreClient`'s.
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
        bulk: bool | None = None,
        bulk_ssl_context: ssl.SSLContext | None = None,
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
            shared_memory = os.environ.get("KVSTORE_SHARED_MEMORY", "1").strip().lower() not in FALSE_WORDS
        self._links: tuple[SharedMemoryLink | None, ...] = tuple(
            SharedMemoryLink(t, credentials=credentials, metadata=self.metadata, options=channel_options)
            if shared_memory else None
            for t in self.router.node_ids
        )
        if bulk is None:
            bulk = os.environ.get("KVSTORE_BULK", "1").strip().lower() not in FALSE_WORDS
        self._bulk_links: tuple[BulkLink | None, ...] = tuple(
            BulkLink(t, credentials=credentials, metadata=self.metadata, options=channel_options,
                     ssl_context=bulk_ssl_context) if bulk else None
            for t in self.router.node_ids
        )
        self._lock = threading.Lock()  # membership, across the synchronous client's threads
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Set up the transport (each client's own)."""

    def execute(self, plan: Plan) -> Any:
        """Perform ``plan`` (:meth:`kvstore.client.plan.Transport.execute`); each client's transport.

        Returns:
            The plan's merged result (:class:`KVStoreClient`), or an awaitable of it (:class:`AsyncKVStoreClient`).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ the API

    def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
               ttl_s: float | None = None, request_id: str | None = None) -> Any:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks (a :class:`LookupResult`).

        With several nodes, each owner is asked for its own hashes in parallel and
        the answers are merged (see the module docstring); a down node's blocks are misses.

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            session_id: the request's agentic session (``docs/agentic.md``).
            ttl_s: a TTL pinning the cached prefix until the get that follows, seconds.
            request_id: a name for the request, for :meth:`explain` later.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, too many hashes, or a bad session id or TTL.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        check_block_hashes(namespace, block_hashes)
        session, ttl = check_session_id(session_id), check_ttl_s(ttl_s)
        request = check_session_id(request_id)
        ns = cached_namespace_pb(namespace)
        if self._single:
            return self.execute(Plan({0: lookup_rpc(ns, block_hashes, session, ttl, request)}, first))
        partition = self.router.split(block_hashes)
        return self.execute(Plan({j: lookup_rpc(ns, partition.sub_list(j, block_hashes), session, ttl, request)
                                  for j in partition.nodes_with_blocks()}, partition.merge_lookup))

    def explain(self, namespace: Namespace | None, block_hashes: Sequence[BlockHash] = (), *,
                request_id: str | None = None) -> Any:
        """Each block of a request on its node: a hit, or the cause of its miss (``kvstore explain``).

        Returns:
            ``(blocks, namespace, near)``: a list of :class:`~kvstore.store.explain.BlockExplanation`, the
            namespace explained (a ``request_id``'s own), and the near namespace the node holds blocks of
            when some missed as ``other_namespace`` (else ``None``).

        Raises:
            InvalidArgumentError: with several targets (explain one node at a time), on a malformed hash, or an
                unknown ``request_id``.
            UnavailableError: if the node cannot be reached; UNIMPLEMENTED from a node before Explain.
        """
        if not self._single:
            raise InvalidArgumentError("explain asks one node: give the client one target")
        request = pb.ExplainRequest(request_id=check_session_id(request_id))
        if namespace is not None:
            check_block_hashes(namespace, block_hashes)
            request.namespace.CopyFrom(cached_namespace_pb(namespace))
            request.block_hashes.extend(bytes(h) for h in block_hashes)
        rpc = Rpc(UNARY, stub("Explain"), request, explanation_from_pb)
        return self.execute(Plan({0: rpc}, first))

    def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
            ttl_s: float | None = None) -> Any:
        """Encoded blocks of the longest cached prefix, in order; stops at the first miss (a list of :data:`Buffer`).

        A block that arrived in one message (up to ``max_message_bytes`` less
        4 KiB) is a read-only ``memoryview`` of it, with no copy; a larger one
        is ``bytes`` joined from its chunks (:data:`kvstore.api.Buffer`).
        With several nodes, the owners are asked in parallel and their blocks
        merged in order up to the first miss (a down node's blocks are misses).

        ``session_id`` and ``ttl_s`` (``docs/agentic.md``): the request's agentic session, and a TTL (seconds)
        that pins the blocks returned, from now.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, too many hashes, or a bad session id or TTL.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        return self.execute(self._get_plan(namespace, block_hashes, check_session_id(session_id), check_ttl_s(ttl_s)))

    def _get_plan(self, namespace: Namespace, block_hashes: Sequence[BlockHash], session_id: str = "",
                  ttl_s: float = 0.0) -> Plan:
        check_block_hashes(namespace, block_hashes)

        def rpc(hashes: Sequence[BlockHash]) -> Rpc:
            return get_rpc(namespace, hashes, AS_BYTES, session_id, ttl_s)

        return self._per_node(block_hashes, rpc, lambda partition: partition.merge_blocks)

    def _per_node(self, block_hashes: Sequence[BlockHash], rpc: Callable[..., Rpc],
                  merge: Callable[[Partition], Callable[[list[Any]], Any]], *per_block: Sequence[Any],
                  single: Callable[[list[Any]], Any] = first) -> Plan:
        """A plan that asks each owner for its blocks: ``rpc(hashes, *per_block items)`` per node, merged."""
        if self._single:
            return Plan({0: rpc(block_hashes, *per_block)}, single)
        partition = self.router.split(block_hashes)
        return Plan({j: rpc(partition.sub_list(j, block_hashes), *(partition.sub_list(j, items) for items in per_block))
                     for j in partition.nodes_with_blocks()}, merge(partition))

    def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                    ttl_s: float | None = None) -> Any:
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
        session_id, ttl_s = check_session_id(session_id), check_ttl_s(ttl_s)

        def rpc(hashes: Sequence[BlockHash]) -> Rpc:
            return get_rpc(namespace, hashes, AS_TENSORS, session_id, ttl_s)

        return self.execute(self._per_node(block_hashes, rpc, lambda partition: partition.merge_blocks))

    def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor],
                 *, verify: bool | None = None, session_id: str | None = None, ttl_s: float | None = None) -> Any:
        """Copy the blocks of the longest cached prefix into the caller's tensors; returns how many (an int).

        The Get for a connector's staging buffer, or a pinned host tensor: block
        ``i`` of the prefix is copied into ``destinations[i]``. Same host: the
        blocks are copied once from the node's shared memory into the
        destinations, with no intermediate ``bytes``. Another host: on the
        node's bulk path each block is received straight into its destination
        (a contiguous CPU tensor; any other is copied once from a buffer of its
        own), else over gRPC, once from the received messages. The blocks past
        the prefix are left as they were, except where a bulk transfer was cut
        mid-block (the node went away): that block, which is not counted, may
        be partly written.

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
            session_id: the request's agentic session (``docs/agentic.md``).
            ttl_s: a TTL pinning the blocks read, seconds.

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
        agent, ttl = check_session_id(session_id), check_ttl_s(ttl_s)

        def rpc(hashes: Sequence[BlockHash], targets: Sequence[Any]) -> Rpc:
            return get_rpc(namespace, hashes, IntoTensors(targets, over_grpc, shared, namespace.layout), agent, ttl)

        return self.execute(self._per_node(block_hashes, rpc, lambda partition: functools.partial(merge_copied, partition),
                                        destinations, single=functools.partial(merge_copied, None)))

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
             ttl_s: float | None = None) -> Any:
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
        agent, ttl = check_session_id(session_id), check_ttl_s(ttl_s)

        def rpc(hashes: Sequence[BlockHash]) -> Rpc:
            return get_rpc(namespace, hashes, AS_LEASE, agent, ttl)

        def merge(partition: Partition) -> Callable[[list[Any]], BlockLease]:
            return lambda results: BlockLease.merge(
                partition.merge_blocks([None if r is None else r.blocks for r in results]), results)

        return self.execute(self._per_node(block_hashes, rpc, merge))

    def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
        session_id: str | None = None,
        ttl_s: float | None = None,
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
            session_id: the blocks' agentic session (``docs/agentic.md``).
            ttl_s: a TTL, seconds: the blocks are evicted only after every block without one until it runs out,
                counted from their last hit or put (the node clamps it to its maximum).

        Raises:
            InvalidArgumentError: at the call, on a namespace that is not a :class:`Namespace`,
                as many hashes as blocks not given, a hash that is not bytes-like or not
                ``namespace.hash_bytes`` long, a priority that is not an integer in ``[0, 100]``,
                or a ``retention_s`` that is not a number >= 0; from the node, on a malformed block.
            CodecError: on a tensor that does not fit the codec.
            ResourceExhaustedError: on a block over the node's ``max_block_bytes``, or no room.
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        priority, retention_s = check_put(namespace, block_hashes, blocks, priority, retention_s)
        session, ttl = check_session_id(session_id), check_ttl_s(ttl_s)
        blocks = blocks_for_put(blocks, namespace.layout)  # what encoding would refuse, refused now, before any call
        blocks = encode_for_put(blocks, namespace)  # a lossy namespace's tensors, encoded here (kvstore.blocks.encoding)

        def rpc(hashes: Sequence[BlockHash], items: Sequence[Block]) -> Rpc:
            return put_rpc(namespace, hashes, items, self._chunk_bytes, priority, retention_s, session, ttl)

        return self.execute(self._per_node(block_hashes, rpc, lambda partition: total, blocks))

    def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Any:
        """Delete blocks from every tier of their owners; returns how many were found (down nodes are skipped)."""
        check_block_hashes(namespace, block_hashes)
        ns = cached_namespace_pb(namespace)
        if self._single:
            return self.execute(Plan({0: delete_rpc(ns, block_hashes)}, first))
        partition = self.router.split(block_hashes)
        return self.execute(Plan({j: delete_rpc(ns, partition.sub_list(j, block_hashes))
                                  for j in partition.nodes_with_blocks()}, total))

    def clear(self, namespace: Namespace) -> Any:
        """Delete every block of ``namespace`` on every node; returns how many local blocks went.

        A node that is down keeps its local blocks (no error); clear again once
        it is back. The shared tier's are gone for every node at once (``docs/redis.md``).
        """
        rpc = Rpc(UNARY, stub("Clear"), pb.ClearRequest(namespace=cached_namespace_pb(namespace)),
                   lambda reply: int(reply.num_deleted))
        return self.execute(Plan(dict.fromkeys(range(len(self._channels)), rpc), total))

    def stats(self) -> Any:
        """Per-tier stats: the node's, or with several nodes the tier-by-tier sum (:func:`merge_store_stats`)
        over the nodes that answered (empty when none did)."""
        return self.execute(self._stats_plan(lambda by_node: merge_store_stats(list(by_node.values()))))

    def node_stats(self) -> Any:
        """Per-tier stats of each node that answered, by target.

        Raises:
            UnavailableError: with one target, if the node cannot be reached within the deadline.
        """
        return self.execute(self._stats_plan(lambda by_node: by_node))

    def _stats_plan(self, finish: Callable[[dict[str, StoreStats]], Any]) -> Plan:
        rpc = Rpc(UNARY, stub("Stats"), pb.StatsRequest(), stats_from_pb)
        node_ids = self.router.node_ids
        return Plan(dict.fromkeys(range(len(self._channels)), rpc),
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
        rpc = Rpc(UNARY, health_method, health_pb2.HealthCheckRequest(service=service), health_name, unknown_service)
        return self.execute(Plan(dict.fromkeys(range(len(self._channels)), rpc), merge_health))

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

    def bulk(self) -> tuple[str, ...]:
        """Per node, in router order: ``"on"`` (remote Gets and Puts move on the bulk path), ``"unknown"`` (not
        asked yet), or why it is off (``"off"`` when this client was made with ``bulk=False``)."""
        states = []
        for link in self._bulk_links:
            if link is None:
                states.append("off")
            elif link.current() is not None:
                states.append("on")
            else:
                states.append(link.reason or "unknown")
        return tuple(states)

    def _close_links(self) -> None:
        for link in self._links:
            if link is not None:
                link.close()
        for bulk_link in self._bulk_links:
            if bulk_link is not None:
                bulk_link.close()

    def nodes(self) -> tuple[NodeStatus, ...]:
        """A snapshot of each node's membership (up or down, failures, next probe), in router order."""
        with self._lock:
            return self.membership.status()

    def __repr__(self) -> str:
        targets = repr(self.target) if self._single else repr(list(self.targets))
        return f"{type(self).__name__}({targets})"

    # ------------------------------------------------------------------ the logic of a call (no I/O)

    def _call(self, plan: Plan) -> Step[Any]:
        """A whole call under one deadline and one in-flight slot: with one target its errors raise; with several,
        the nodes' parts run at once and a node that cannot be reached is marked down and is a miss."""
        deadline = time.monotonic() + self.timeout_s
        if self._closed:
            raise UnavailableError(f"the client of {', '.join(self.targets)} is closed")
        results: list[Any] = [None] * len(self._channels)
        release = yield SLOT
        try:
            if self._single:
                for node, rpc in plan.rpcs.items():
                    results[node] = yield from self._attempts(node, rpc, deadline)
                return plan.merge(results)
            with self._lock:
                due = self.membership.due_probes()
                live = [node for node in plan.rpcs if self.membership.is_up(self.router.node_ids[node])]
            for node_id in due:
                yield Probe(node_id)
            outcomes = yield Together([self._on_node(node, plan.rpcs[node], deadline) for node in live], deadline)
            for node, outcome in zip(live, outcomes):
                if isinstance(outcome, BaseException):
                    raise outcome
                results[node] = outcome
            return plan.merge(results)
        finally:
            release()

    def _attempts(self, node: int, rpc: Rpc, deadline: float) -> Step[Any]:
        """One node's part, attempted until it succeeds, under the deadline and :attr:`retry`.

        Raises:
            DeadlineExceededError: if the deadline passes.
            KVStoreError: the typed error of any other failed status.
        """
        attempt = 0
        shared_tries = 0
        make_shared, make_bulk = rpc.shared, rpc.bulk
        link = self._links[node] if make_shared is not None else None
        bulk_link = self._bulk_links[node] if make_bulk is not None else None
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise DeadlineExceededError(f"deadline of {self.timeout_s} s passed after {attempt} attempts")
            chosen, done, session = rpc, None, None
            if make_shared is not None and link is not None and shared_tries < MAX_SHARED_TRIES:
                session = yield SessionOf(link, remaining_s)
                made = None if session is None else make_shared(session)
                if made is not None:
                    chosen, done = made
            if chosen is rpc and make_bulk is not None and bulk_link is not None:  # another host, or no session:
                endpoint = yield BulkOf(bulk_link, remaining_s)  # the bulk path, if the node offers one
                if endpoint is not None:
                    chosen = make_bulk(bulk_link, endpoint)
            clear = False  # whether the attempt's outcome is known (a staged range may be reused)
            try:
                result = yield Attempt(node, chosen, remaining_s)
                clear = True
                return result
            except UseGrpc:  # the same-host or bulk path declined this call (no room now): the rest goes over gRPC
                clear, shared_tries, bulk_link = True, MAX_SHARED_TRIES, None
                continue
            except grpc.RpcError as exc:
                code = exc.code()
                clear = code not in UNCLEAR_CODES
                if chosen is not rpc and code == grpc.StatusCode.FAILED_PRECONDITION:
                    if link is not None:  # the node forgot the session: attach again
                        link.lost(session)
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
                code = exc.code()
                pause_s = self.retry.pause_s(attempt, code)
                if pause_s is None:
                    _raise_typed(exc)
                pause_s = min(pause_s, deadline - time.monotonic())
                logger.debug("retrying after %s in %.3f s (attempt %d)", code.name, pause_s, attempt + 1)
                yield Pause(max(0.0, pause_s))
                attempt += 1
            finally:
                if done is not None:
                    if clear:
                        done()
                    elif link is not None:  # the node may still be copying out of the staged range: never reuse
                        link.lost(session)  # it, nor the session

    def _on_node(self, node: int, rpc: Rpc, deadline: float) -> Step[Any]:
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

    def _probe(self, node_id: str) -> Step[None]:
        """Health-check a down node (waiting for its connection up to ``probe_timeout_s``) and report the result."""
        rpc = Rpc(UNARY, health_method, health_pb2.HealthCheckRequest(), lambda reply: reply.status, wait_for_ready=True)
        try:
            status = yield Attempt(self.router.index(node_id), rpc, self.probe_timeout_s)
            ok = status == health_pb2.HealthCheckResponse.SERVING
        except Exception as exc:  # noqa: BLE001 - a background probe reports every failure as "still down"
            logger.debug("probe of kvstore node %s failed: %s", node_id, exc)
            ok = False
        with self._lock:
            self.membership.probe_done(node_id, ok)
        if ok:
            logger.info("kvstore node %s answers SERVING again; it rejoins", node_id)
