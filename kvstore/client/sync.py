"""The synchronous client, :class:`KVStoreClient`: the core's calls performed in the calling thread and worker threads."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import grpc

from kvstore.errors import UnavailableError
from kvstore.error_codes import DeadlineExceededError
from kvstore.client.plan import (
    REPLY_STREAM,
    RETURNED,
    UNARY,
    Attempt,
    BulkOf,
    Outcome,
    Pause,
    Plan,
    SessionOf,
    Slot,
    Step,
    Together,
)
from kvstore.client.core import ClientCore
from kvstore.client.retry import InflightSlots

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer, LookupResult, StoreStats
    from kvstore.blocks.lease import BlockLease
    from kvstore.store.explain import BlockExplanation
    from kvstore.keys import BlockHash, Namespace

_T = TypeVar("_T")

_MAX_WORKERS = 256
"""Most worker threads of a synchronous client of several nodes (created as calls need them)."""
_GRACE_S = 0.5
"""How long past a call's deadline its caller waits for a node's part to finish, seconds (each part has the deadline itself)."""


class KVStoreClient(ClientCore):
    """A synchronous, thread-safe client of one kvstore node or several; a :class:`~kvstore.api.BlockClient`.

    With several targets, blocks are spread over the nodes by rendezvous hashing
    and an unreachable node is a miss, not an error (see the module docstring).
    Its transport runs a call in the calling thread, and the parts of a call
    fanned out to several nodes in worker threads (started as calls need them).

    Args:
        target: ``host:port`` of the node, or a sequence of them (one per node).
        targets: the nodes' ``host:port``, as a keyword (instead of ``target``).
        timeout_s: deadline of every call, seconds, covering its retries and its fan-out.
        max_inflight: calls in flight at once across threads; more wait (within
            their deadline) for a slot. A call fanned out to several nodes is one call.
        retries: retries of an idempotent call on UNAVAILABLE, per node (0 for none).
        backoff_s: base of the exponential backoff, seconds (:class:`Backoff`).
        max_backoff_s: cap of one backoff, seconds.
        max_message_bytes: largest gRPC message, bytes; must match the server's
            ``server.max_message_bytes`` (blocks are chunked to fit).
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``), for every target;
            ``None`` for plaintext.
        metadata: ``(key, value)`` pairs sent with every call to every target (e.g. ``authorization``).
        channel_options: extra gRPC channel options, for every target.
        probe_timeout_s: deadline of one health probe of a down node, seconds (capped at ``timeout_s``).
        down_backoff_s: how long a node stays down after its first failure before it is probed, seconds.
        max_down_backoff_s: cap of that backoff, which doubles per consecutive failure, seconds.
        shared_memory: use a node's same-host data plane when it is on this host (``docs/shared-memory.md``);
            ``None``: on unless ``KVSTORE_SHARED_MEMORY`` is a false word.
        bulk: move Get and Put bytes on a node's bulk path when it offers one and the same-host plane does not
            carry the call (``docs/scaleout.md``); ``None``: on unless ``KVSTORE_BULK`` is a false word.
        bulk_ssl_context: the TLS context for a node whose bulk listener speaks TLS (``ssl.create_default_context
            (cafile=...)``, with ``load_cert_chain`` for mutual TLS); without one such a node's calls use gRPC.

    Raises:
        InvalidArgumentError: on no target, both ``target`` and ``targets``, or an empty target;
            on ``timeout_s`` or ``probe_timeout_s`` not a number in ``(0, MAX_TIMEOUT_S]``; on ``backoff_s``,
            ``max_backoff_s`` or ``down_backoff_s`` not a finite number >= 0, or
            ``max_down_backoff_s`` not a finite number >= ``down_backoff_s``; on
            ``max_inflight`` not an integer >= 1 or ``retries`` not one >= 0. The
            message names the argument.
    """

    _aio = False

    if TYPE_CHECKING:  # the API's results (ClientCore's methods return Any): for type checkers only

        def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                   ttl_s: float | None = None, request_id: str | None = None) -> LookupResult: ...

        def explain(self, namespace: Namespace | None, block_hashes: Sequence[BlockHash] = (), *,
                    request_id: str | None = None
                    ) -> tuple[list[BlockExplanation], Namespace | None, Namespace | None]: ...

        def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                ttl_s: float | None = None) -> list[Buffer]: ...

        def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *,
                        session_id: str | None = None, ttl_s: float | None = None) -> list[torch.Tensor]: ...

        def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                     destinations: Sequence[torch.Tensor], *, verify: bool | None = None,
                     session_id: str | None = None, ttl_s: float | None = None) -> int: ...

        def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                 ttl_s: float | None = None) -> BlockLease: ...

        def put(self, namespace: Namespace, block_hashes: Sequence[BlockHash], blocks: Sequence[Block], *,
                priority: int | None = None, retention_s: float | None = None, session_id: str | None = None,
                ttl_s: float | None = None) -> int: ...

        def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int: ...

        def clear(self, namespace: Namespace) -> int: ...

        def stats(self) -> StoreStats: ...

        def node_stats(self) -> dict[str, StoreStats]: ...

        def health(self, service: str = "") -> str: ...

    def _start(self) -> None:
        self._pid = os.getpid()
        self._slots = InflightSlots(self.max_inflight)
        self._executor: ThreadPoolExecutor | None = None

    def execute(self, plan: Plan) -> Any:
        """Perform ``plan`` in this thread and worker threads (:class:`~kvstore.client.plan.Transport`); its result."""
        return self._drive(self._call(plan))

    def _drive(self, step: Step[_T]) -> _T:
        """Perform the I/O ``step`` yields, in this thread, until it returns."""
        outcome = Outcome()
        try:
            while (op := outcome.send_into(step)) is not RETURNED:
                try:
                    outcome.value = self._perform(op)
                except BaseException as exc:  # noqa: BLE001 - sent back into the step, which decides
                    outcome.error = exc
            result: _T = outcome.value
            return result
        finally:
            step.close()

    def _perform(self, op: Any) -> Any:
        if type(op) is Attempt:
            return self._attempt(op)
        if type(op) is SessionOf or type(op) is BulkOf:
            return op.link.ensure(op.timeout_s)
        if type(op) is Slot:
            return self._acquire_slot()
        if type(op) is Pause:
            time.sleep(op.seconds)
            return None
        if type(op) is Together:
            return self._together(op.parts, op.deadline)
        self._pool().submit(self._drive, self._probe(op.node_id))  # Probe
        return None

    def _attempt(self, op: Attempt) -> Any:
        """One attempt of one node's part: the synchronous transport of :class:`~kvstore.client.plan.Rpc`."""
        rpc = op.rpc
        call = rpc.method(self._channels[op.node])
        if rpc.kind == UNARY:
            if rpc.wait_for_ready:
                return rpc.read(call(rpc.request, timeout=op.timeout_s, metadata=self.metadata, wait_for_ready=True))
            return rpc.read(call(rpc.request, timeout=op.timeout_s, metadata=self.metadata))
        if rpc.kind == REPLY_STREAM:
            assembler = rpc.read()
            stream = call(rpc.request, timeout=op.timeout_s, metadata=self.metadata)
            try:
                for message in stream:
                    assembler.add_reply(message)
            except BaseException:
                stream.cancel()  # frees the call on an error (a stream that ended needs nothing)
                raise
            return assembler.finish()
        requests = rpc.request()
        try:
            return rpc.read(call(requests, timeout=op.timeout_s, metadata=self.metadata))
        except grpc.RpcError:  # UNKNOWN: "Exception iterating requests!"
            requests.raise_error()
            raise

    def _after_fork(self) -> None:
        """In a forked child: fresh slots, lock and worker threads (a parent's thread may have held them)."""
        if self._pid != os.getpid():
            self._pid, self._slots = os.getpid(), InflightSlots(self.max_inflight)
            self._lock, self._executor = threading.Lock(), None

    def _acquire_slot(self) -> Callable[[], None]:
        self._after_fork()
        slots = self._slots
        if not slots.acquire(self.timeout_s):
            raise DeadlineExceededError(f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s")
        return slots.release

    def _pool(self) -> ThreadPoolExecutor:
        """The worker threads of this process (started on first use), for the nodes' parts and the probes.

        Raises:
            UnavailableError: if the client is closed.
        """
        with self._lock:
            if self._closed:
                raise UnavailableError(f"the client of {', '.join(self.targets)} is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=min(_MAX_WORKERS, len(self._channels) * self.max_inflight),
                    thread_name_prefix="kvstore-client",
                )
            return self._executor

    def _together(self, parts: list[Step[Any]], deadline: float) -> list[Any]:
        """Run the parts at once: the first in this thread, the rest in worker threads; each one's result or
        exception, in order. A part still queued behind busy workers when the deadline has passed is a miss."""
        if not parts:
            return []
        futures = [self._pool().submit(self._outcome, part) for part in parts[1:]]
        outcomes = [self._outcome(parts[0])]
        if futures:
            futures_wait(futures, timeout=max(0.0, deadline - time.monotonic()) + _GRACE_S)
            for future in futures:
                if future.done():
                    outcomes.append(future.result())
                else:  # queued behind busy workers until the deadline: a miss, not the node's fault
                    future.cancel()
                    outcomes.append(None)
        return outcomes

    def _outcome(self, part: Step[Any]) -> Any:
        try:
            return self._drive(part)
        except BaseException as exc:  # noqa: BLE001 - returned, and raised by the call that gathers it
            return exc

    def close(self) -> None:
        """Close the channels, then wait for the worker threads to end; idempotent.

        Closing a channel cancels its calls in flight (a health probe too; their
        callers get :class:`UnavailableError`), so the wait is short, and no thread of the client is left inside gRPC
        afterwards (which matters to a process that forks next). In a forked
        child this leaves the parent's connections alone.
        """
        self._closed = True
        self._close_links()
        for channel in self._channels:
            channel.close()
        executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
