"""Clients of a ``kvstore serve`` node: ``KVStoreClient`` (synchronous) and ``AsyncKVStoreClient`` (asyncio).

Both implement :class:`kvstore.api.BlockClient`, so a connector takes either
or the embedded store. Every call has a deadline (``timeout_s``, covering all
its retries), the number of calls in flight is bounded (``max_inflight``), and
calls that are safe to repeat are retried on UNAVAILABLE with exponential
backoff and full jitter (the AWS Architecture Blog's "Exponential Backoff and
Jitter"). Status errors are raised as kvstore's typed errors through the one
mapping in ``kvstore.server.errors``.

Retried calls: lookup, get, delete, clear, stats, health and put. Put is
idempotent because a block hash names its content (the chained hash of the
prefix in the namespace) and a put of a key already stored is a no-op; a put
retried after a lost reply may therefore report fewer blocks as newly stored.

Fork safety: gRPC channels must not cross ``fork``. Each client remembers the
process id that opened its channel; in a forked child the first call opens a
fresh channel (with its own subchannel pool, so no connection of the parent is
reused) and leaves the parent's untouched. gRPC's core fork handling must be
on, which it is unless ``GRPC_ENABLE_FORK_SUPPORT`` is set false; then a child
gets :class:`UnavailableError` at once instead of a hang.

Example::

    from kvstore import Namespace, hash_blocks
    from kvstore.client import KVStoreClient

    with KVStoreClient("127.0.0.1:50051") as client:
        ns = Namespace(model="my-llama", dtype="float16", block_size=16)
        hashes = hash_blocks(ns, token_ids)
        client.put(ns, hashes, tensors)            # [L, 2, H, 16, D] each
        hit = client.lookup(ns, hashes).num_blocks
        tensors = client.get_tensors(ns, hashes[:hit])
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.api import Block, LookupResult, StoreStats
from kvstore.codec import decode_block
from kvstore.embedded import encode_blocks
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import BlockHash, Namespace
from kvstore.server.errors import RETRYABLE_CODES, DeadlineExceededError, error_of
from kvstore.server.wire import (
    GET_METHOD,
    PUT_METHOD,
    BlockAssembler,
    channel_options,
    chunk_bytes_for,
    decode_block_chunk,
    identity,
    lookup_from_pb,
    namespace_to_pb,
    put_requests,
    stats_from_pb,
)
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

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
_FALSE = ("0", "false", "no", "off")
_NO_BLOCK_LIMIT = sys.maxsize


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter, ``uniform(0, min(cap, base * 2^attempt))``."""
    return random.uniform(0.0, min(cap_s, base_s * (2**attempt)))


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
            *channel_options(max_message_bytes),
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
        # the data path: block bytes are (de)serialized by kvstore.server.wire, not copied through protobuf
        self._get = channel.unary_stream(GET_METHOD, request_serializer=pb.GetRequest.SerializeToString,
                                         response_deserializer=identity)
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
        """The Get multicallable of the data path: ``GetRequest`` in, serialized ``BlockChunk`` s out."""
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


def _get_request(namespace: Namespace, block_hashes: Sequence[BlockHash]) -> pb.GetRequest:
    return pb.GetRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in block_hashes])


def _check_put(block_hashes: Sequence[BlockHash], blocks: Sequence[Block]) -> None:
    if len(block_hashes) != len(blocks):
        raise InvalidArgumentError(f"{len(block_hashes)} hashes but {len(blocks)} blocks")


def _assembler(num_blocks: int) -> BlockAssembler:
    return BlockAssembler(_NO_BLOCK_LIMIT, max(1, num_blocks))


class KVStoreClient:
    """A synchronous, thread-safe client of one kvstore node; a :class:`~kvstore.api.BlockClient`.

    Args:
        target: ``host:port`` of the node.
        timeout_s: deadline of every call, seconds, covering its retries.
        max_inflight: calls in flight at once across threads; more wait (within
            their deadline) for a slot.
        retries: retries of an idempotent call on UNAVAILABLE (0 for none).
        backoff_s: base of the exponential backoff, seconds.
        max_backoff_s: cap of one backoff, seconds.
        max_message_bytes: largest gRPC message, bytes; must match the server's
            ``server.max_message_bytes`` (blocks are chunked to fit).
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``); ``None`` for plaintext.
        metadata: ``(key, value)`` pairs sent with every call (e.g. ``authorization``).
        channel_options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if timeout_s <= 0 or max_inflight <= 0 or retries < 0:
            raise InvalidArgumentError("timeout_s and max_inflight must be > 0 and retries >= 0")
        self.target = target
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.metadata = tuple(metadata)
        self._chunk_bytes = chunk_bytes_for(max_message_bytes)
        self._channel = TargetChannel(
            target, max_message_bytes=max_message_bytes, credentials=credentials, options=channel_options
        )
        self._pid = os.getpid()
        self._slots = threading.BoundedSemaphore(max_inflight)

    # ------------------------------------------------------------------ plumbing

    def _call(self, fn: Callable[[float], _T], *, idempotent: bool = True) -> _T:
        """Run ``fn(timeout_s)`` under the deadline, an in-flight slot and the retry policy.

        Raises:
            DeadlineExceededError: if the deadline passes (also while waiting for a slot).
            KVStoreError: the typed error of any other failed status.
        """
        if self._pid != os.getpid():  # a parent's thread may have held slots at fork time
            self._pid, self._slots = os.getpid(), threading.BoundedSemaphore(self.max_inflight)
        deadline = time.monotonic() + self.timeout_s
        slots = self._slots
        if not slots.acquire(timeout=self.timeout_s):
            raise DeadlineExceededError(f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s")
        try:
            attempt = 0
            while True:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise DeadlineExceededError(f"deadline of {self.timeout_s} s passed after {attempt} attempts")
                try:
                    return fn(remaining_s)
                except grpc.RpcError as exc:
                    code = exc.code()  # type: ignore[attr-defined]
                    if not (idempotent and code in RETRYABLE_CODES and attempt < self.retries):
                        _raise_typed(exc)
                    pause_s = min(backoff_s(attempt, self.backoff_s, self.max_backoff_s), deadline - time.monotonic())
                    logger.debug("retrying after %s in %.3f s (attempt %d)", code.name, pause_s, attempt + 1)
                    time.sleep(max(0.0, pause_s))
                    attempt += 1
        finally:
            slots.release()

    # ------------------------------------------------------------------ API

    def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` and the tier of each of its blocks.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, or too many hashes.
            UnavailableError: if the node cannot be reached within the deadline.
        """
        request = pb.LookupRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in block_hashes])
        return self._call(lambda t: lookup_from_pb(
            self._channel.stub.Lookup(request, timeout=t, metadata=self.metadata)))

    def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix, in order; stops at the first miss.

        Raises:
            InvalidArgumentError: on a malformed hash or namespace, or too many hashes.
            UnavailableError: if the node cannot be reached within the deadline.
        """
        request = _get_request(namespace, block_hashes)

        def attempt(timeout_s: float) -> list[bytes]:
            assembler = _assembler(len(block_hashes))
            stream = self._channel.get_call(request, timeout=timeout_s, metadata=self.metadata)
            try:
                for raw in stream:
                    chunk, data = decode_block_chunk(raw)
                    if chunk.offset == 0:
                        assembler.begin(chunk.block_index, chunk.total_bytes)
                    assembler.add(chunk.block_index, chunk.offset, data)
            finally:
                stream.cancel()  # no-op once the stream ended; frees it on an error
            return assembler.finish()

        return self._call(attempt)

    def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor]:
        """Like :meth:`get`, decoded (checksums verified) into CPU tensors that view the received bytes.

        Each is ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or
        ``[num_layers, 1, block_size, latent_dim]`` (``mla``); read-only: clone before writing.

        Raises:
            CodecError: if a received block fails to decode.
        """
        return [decode_block(b) for b in self.get(namespace, block_hashes)]

    def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store blocks (encoded bytes or tensors); returns how many were newly stored.

        The blocks stream to the node in chunks; it stores them only once the
        whole stream has arrived and validated, so a failed put stores nothing.

        Args:
            namespace: namespace of the blocks.
            block_hashes: one chained hash per block.
            blocks: encoded blocks, or tensors of the namespace's layout
                (``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for ``kv``).
            priority: retention priority in ``[0, 100]``; the node's default when ``None``.
            retention_s: seconds the priority holds before it reverts to the default.

        Raises:
            InvalidArgumentError: on a malformed hash, namespace or block, or a bad priority.
            ResourceExhaustedError: on a block over the node's ``max_block_bytes``, or no room.
            UnavailableError: if the node cannot be reached within the deadline.
        """
        _check_put(block_hashes, blocks)
        encoded = encode_blocks(namespace, blocks)

        def attempt(timeout_s: float) -> int:
            requests = put_requests(namespace, block_hashes, encoded, self._chunk_bytes,
                                    priority=priority, retention_s=retention_s)
            reply = self._channel.put_call(requests, timeout=timeout_s, metadata=self.metadata)
            return int(reply.num_stored)

        return self._call(attempt)

    def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier of the node; returns how many were found."""
        request = pb.DeleteRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in block_hashes])
        return self._call(lambda t: int(
            self._channel.stub.Delete(request, timeout=t, metadata=self.metadata).num_deleted))

    def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace`` on the node; returns how many local blocks went."""
        request = pb.ClearRequest(namespace=namespace_to_pb(namespace))
        return self._call(lambda t: int(
            self._channel.stub.Clear(request, timeout=t, metadata=self.metadata).num_deleted))

    def stats(self) -> StoreStats:
        """Per-tier stats of the node."""
        return self._call(lambda t: stats_from_pb(
            self._channel.stub.Stats(pb.StatsRequest(), timeout=t, metadata=self.metadata)))

    def health(self, service: str = "") -> str:
        """The node's ``grpc.health.v1`` status: ``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or ``UNKNOWN``.

        Args:
            service: ``""`` for the whole server, or ``kvstore.v1.KVStore``.

        Raises:
            UnavailableError: if the node cannot be reached within the deadline.
        """
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._call(lambda t: self._channel.health_stub.Check(request, timeout=t, metadata=self.metadata))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        """Close the channel; idempotent. In a forked child this leaves the parent's connection alone."""
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVStoreClient({self.target!r})"


class AsyncKVStoreClient:
    """The asyncio twin of :class:`KVStoreClient`: the same methods as coroutines, the same policies.

    Use from one event loop; the channel is opened on the first call.

    Args:
        target: ``host:port`` of the node.
        timeout_s: deadline of every call, seconds, covering its retries.
        max_inflight: calls in flight at once; more wait (within their deadline) for a slot.
        retries: retries of an idempotent call on UNAVAILABLE (0 for none).
        backoff_s: base of the exponential backoff, seconds.
        max_backoff_s: cap of one backoff, seconds.
        max_message_bytes: largest gRPC message, bytes; must match the server's.
        credentials: TLS channel credentials; ``None`` for plaintext.
        metadata: ``(key, value)`` pairs sent with every call.
        channel_options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if timeout_s <= 0 or max_inflight <= 0 or retries < 0:
            raise InvalidArgumentError("timeout_s and max_inflight must be > 0 and retries >= 0")
        self.target = target
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.metadata = tuple(metadata)
        self._chunk_bytes = chunk_bytes_for(max_message_bytes)
        self._channel = TargetChannel(
            target, aio=True, max_message_bytes=max_message_bytes, credentials=credentials, options=channel_options
        )
        self._slots: asyncio.Semaphore | None = None
        self._slots_pid = -1

    async def _call(self, fn: Callable[[float], Awaitable[_T]], *, idempotent: bool = True) -> _T:
        """Await ``fn(timeout_s)`` under the deadline, an in-flight slot and the retry policy.

        Raises:
            DeadlineExceededError: if the deadline passes (also while waiting for a slot).
            KVStoreError: the typed error of any other failed status.
        """
        if self._slots is None or self._slots_pid != os.getpid():
            self._slots, self._slots_pid = asyncio.Semaphore(self.max_inflight), os.getpid()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        slots = self._slots
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(
                f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s"
            ) from None
        try:
            attempt = 0
            while True:
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    raise DeadlineExceededError(f"deadline of {self.timeout_s} s passed after {attempt} attempts")
                try:
                    return await fn(remaining_s)
                except grpc.RpcError as exc:
                    code = exc.code()  # type: ignore[attr-defined]
                    if not (idempotent and code in RETRYABLE_CODES and attempt < self.retries):
                        _raise_typed(exc)
                    pause_s = min(backoff_s(attempt, self.backoff_s, self.max_backoff_s), deadline - loop.time())
                    logger.debug("retrying after %s in %.3f s (attempt %d)", code.name, pause_s, attempt + 1)
                    await asyncio.sleep(max(0.0, pause_s))
                    attempt += 1
        finally:
            slots.release()

    async def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` (see :meth:`KVStoreClient.lookup`)."""
        request = pb.LookupRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in block_hashes])

        async def attempt(timeout_s: float) -> LookupResult:
            reply = await self._channel.stub.Lookup(request, timeout=timeout_s, metadata=self.metadata)
            return lookup_from_pb(reply)

        return await self._call(attempt)

    async def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix (see :meth:`KVStoreClient.get`)."""
        request = _get_request(namespace, block_hashes)

        async def attempt(timeout_s: float) -> list[bytes]:
            assembler = _assembler(len(block_hashes))
            stream = self._channel.get_call(request, timeout=timeout_s, metadata=self.metadata)
            try:
                async for raw in stream:
                    chunk, data = decode_block_chunk(raw)
                    if chunk.offset == 0:
                        assembler.begin(chunk.block_index, chunk.total_bytes)
                    assembler.add(chunk.block_index, chunk.offset, data)
            finally:
                stream.cancel()
            return assembler.finish()

        return await self._call(attempt)

    async def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor]:
        """Like :meth:`get`, decoded (checksums verified) into read-only CPU tensors (see :meth:`KVStoreClient.get_tensors`)."""
        return [decode_block(b) for b in await self.get(namespace, block_hashes)]

    async def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store blocks (bytes or tensors); returns how many were newly stored (see :meth:`KVStoreClient.put`)."""
        _check_put(block_hashes, blocks)
        encoded = encode_blocks(namespace, blocks)

        async def attempt(timeout_s: float) -> int:
            requests: Iterable[bytes] = put_requests(
                namespace, block_hashes, encoded, self._chunk_bytes, priority=priority, retention_s=retention_s
            )
            reply = await self._channel.put_call(requests, timeout=timeout_s, metadata=self.metadata)
            return int(reply.num_stored)

        return await self._call(attempt)

    async def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier of the node; returns how many were found."""
        request = pb.DeleteRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in block_hashes])

        async def attempt(timeout_s: float) -> int:
            reply = await self._channel.stub.Delete(request, timeout=timeout_s, metadata=self.metadata)
            return int(reply.num_deleted)

        return await self._call(attempt)

    async def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace`` on the node; returns how many local blocks went."""
        request = pb.ClearRequest(namespace=namespace_to_pb(namespace))

        async def attempt(timeout_s: float) -> int:
            reply = await self._channel.stub.Clear(request, timeout=timeout_s, metadata=self.metadata)
            return int(reply.num_deleted)

        return await self._call(attempt)

    async def stats(self) -> StoreStats:
        """Per-tier stats of the node."""

        async def attempt(timeout_s: float) -> StoreStats:
            reply = await self._channel.stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self.metadata)
            return stats_from_pb(reply)

        return await self._call(attempt)

    async def health(self, service: str = "") -> str:
        """The node's ``grpc.health.v1`` status name (see :meth:`KVStoreClient.health`)."""
        request = health_pb2.HealthCheckRequest(service=service)

        async def attempt(timeout_s: float) -> str:
            reply = await self._channel.health_stub.Check(request, timeout=timeout_s, metadata=self.metadata)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

        return await self._call(attempt)

    async def close(self) -> None:
        """Close the channel; idempotent."""
        await self._channel.aclose()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncKVStoreClient({self.target!r})"
