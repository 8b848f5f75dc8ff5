"""The asyncio client, :class:`AsyncKVStoreClient`: the core's calls performed on the caller's event loop."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, TypeVar

import grpc

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

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer, LookupResult, StoreStats
    from kvstore.blocks.lease import BlockLease
    from kvstore.store.explain import BlockExplanation
    from kvstore.keys import BlockHash, Namespace

_T = TypeVar("_T")


class AsyncKVStoreClient(ClientCore):
    """The asyncio client: the same methods as :class:`KVStoreClient`, each returning an awaitable, the same policies.

    Use from one event loop; the channels are opened on the first call. With
    several targets the nodes are asked concurrently on that loop, and health
    probes of down nodes run as tasks on it. Its constructor takes the same
    arguments as :class:`KVStoreClient`'s, with the same checks.
    """

    _aio = True

    if TYPE_CHECKING:  # the API's results, as awaitables (ClientCore's methods return Any): for type checkers only

        def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                   ttl_s: float | None = None, request_id: str | None = None) -> Awaitable[LookupResult]: ...

        def explain(self, namespace: Namespace | None, block_hashes: Sequence[BlockHash] = (), *,
                    request_id: str | None = None
                    ) -> Awaitable[tuple[list[BlockExplanation], Namespace | None, Namespace | None]]: ...

        def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                ttl_s: float | None = None) -> Awaitable[list[Buffer]]: ...

        def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *,
                        session_id: str | None = None, ttl_s: float | None = None) -> Awaitable[list[torch.Tensor]]: ...

        def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                     destinations: Sequence[torch.Tensor], *, verify: bool | None = None,
                     session_id: str | None = None, ttl_s: float | None = None) -> Awaitable[int]: ...

        def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                 ttl_s: float | None = None) -> Awaitable[BlockLease]: ...

        def put(self, namespace: Namespace, block_hashes: Sequence[BlockHash], blocks: Sequence[Block], *,
                priority: int | None = None, retention_s: float | None = None, session_id: str | None = None,
                ttl_s: float | None = None) -> Awaitable[int]: ...

        def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Awaitable[int]: ...

        def clear(self, namespace: Namespace) -> Awaitable[int]: ...

        def stats(self) -> Awaitable[StoreStats]: ...

        def node_stats(self) -> Awaitable[dict[str, StoreStats]]: ...

        def health(self, service: str = "") -> Awaitable[str]: ...

    def _start(self) -> None:
        self._aslots: asyncio.Semaphore | None = None
        self._slots_pid = -1
        self._probes: set[asyncio.Task[None]] = set()

    def execute(self, plan: Plan) -> Awaitable[Any]:
        """Perform ``plan`` on the running loop (:class:`~kvstore.client.plan.Transport`): an awaitable of it."""
        return self._drive(self._call(plan))

    async def _drive(self, step: Step[_T]) -> _T:
        """Perform the I/O ``step`` yields, on the running loop, until it returns."""
        outcome = Outcome()
        try:
            while (op := outcome.send_into(step)) is not RETURNED:
                try:
                    outcome.value = await self._perform(op)
                except asyncio.CancelledError:
                    raise  # the caller's cancellation is not the call's outcome
                except BaseException as exc:  # noqa: BLE001 - sent back into the step, which decides
                    outcome.error = exc
            result: _T = outcome.value
            return result
        finally:
            step.close()

    async def _perform(self, op: Any) -> Any:
        if type(op) is Attempt:
            return await self._attempt(op)
        if type(op) is SessionOf:
            link = op.link
            session = link.current()
            if session is not None or link.settled():
                return session
            return await asyncio.to_thread(link.ensure, op.timeout_s)  # attaching blocks (a handoff, a Unix socket)
        if type(op) is BulkOf:
            bulk_link = op.link
            if bulk_link.settled():
                return bulk_link.current()
            return await asyncio.to_thread(bulk_link.ensure, op.timeout_s)  # a Capabilities call, once
        if type(op) is Slot:
            return await self._acquire_slot()
        if type(op) is Pause:
            await asyncio.sleep(op.seconds)
            return None
        if type(op) is Together:
            return await asyncio.gather(*(self._drive(part) for part in op.parts), return_exceptions=True)
        task = asyncio.get_running_loop().create_task(self._drive(self._probe(op.node_id)))  # Probe
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)
        return None

    async def _attempt(self, op: Attempt) -> Any:
        """One attempt of one node's part: the asyncio transport of :class:`~kvstore.client.plan.Rpc`."""
        rpc = op.rpc
        call = rpc.method(self._channels[op.node])
        if rpc.kind == UNARY:
            if rpc.wait_for_ready:
                return rpc.read(await call(rpc.request, timeout=op.timeout_s, metadata=self.metadata,
                                           wait_for_ready=True))
            return rpc.read(await call(rpc.request, timeout=op.timeout_s, metadata=self.metadata))
        if rpc.kind == REPLY_STREAM:
            assembler = rpc.read()
            stream = call(rpc.request, timeout=op.timeout_s, metadata=self.metadata)
            try:
                async for message in stream:
                    assembler.add_reply(message)
            except BaseException:
                stream.cancel()
                raise
            return assembler.finish()
        requests = rpc.request()
        try:
            return rpc.read(await call(requests, timeout=op.timeout_s, metadata=self.metadata))
        except (asyncio.CancelledError, grpc.RpcError):  # grpc.aio cancels the call when the stream fails
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # a cancellation of the caller's task stays one
                requests.raise_error()
            raise

    async def _acquire_slot(self) -> Callable[[], None]:
        if self._aslots is None or self._slots_pid != os.getpid():
            self._aslots, self._slots_pid = asyncio.Semaphore(self.max_inflight), os.getpid()
        slots = self._aslots
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(
                f"no free slot of max_inflight={self.max_inflight} within {self.timeout_s} s"
            ) from None
        return slots.release

    async def close(self) -> None:
        """Cancel running health probes and close the channels; idempotent."""
        self._closed = True
        probes = list(self._probes)
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._close_links()
        for channel in self._channels:
            await channel.aclose()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
