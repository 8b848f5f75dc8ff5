"""The scope of one gRPC call on the node: its admission, its slot, its reply's charge and its status (``GrpcCall``).

Also what reads grpc.aio's log of a reply the client went away from (``REPLY_LOST``), since a call's status depends
on it. ``kvstore.server.servicer`` opens one :class:`GrpcCall` per call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING, Awaitable, NoReturn, Protocol, Sequence

import grpc

from kvstore.errors import UnavailableError
from kvstore.server.admission import Admission, Ticket
from kvstore.server.auth import Principal
from kvstore.server.budgets import ReplyBudget
from kvstore.server.metrics import ServiceMetrics
from kvstore.server.watchdog import StreamWatch, StreamWatchdog
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.api import Buffer

logger = logging.getLogger(__name__)

DEADLINE_SLACK_S = 0.05
"""A call its client ended this close to the deadline (seconds) is counted as DEADLINE_EXCEEDED, not CANCELLED.

A client whose deadline passes cancels the stream; the node's copy of that
deadline started when the request arrived, so it runs a little late and may
still show time remaining when the cancellation lands.
"""

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
"""``kvstore.v1.KVStore``: the service name for health checks and reflection."""


class ReplyLostFilter(logging.Filter):
    """Reads grpc.aio's ERROR about a reply the client went away from as what it is: a call the client ended.

    A unary handler's reply (a Get's last message, see
    :meth:`KVStoreServicer.add_to_server`) leaves with the status in grpc.aio's
    own batch, after the handler returned. When the client cancels, or its
    deadline passes, while that batch waits (a reader that stopped reading),
    grpc.aio logs ``ExecuteBatchError raised in core by servicer method [...]``
    at ERROR with a traceback, unless it already knows the client is gone. On
    this service's methods the record becomes one DEBUG line, and the call's
    task is noted in :attr:`tasks`, so that the call is counted as CANCELLED
    or DEADLINE_EXCEEDED rather than OK (``GrpcCall._finish``).
    """

    PREFIX = f"ExecuteBatchError raised in core by servicer method [/{SERVICE_NAME}/"

    def __init__(self) -> None:
        super().__init__()
        self.tasks: weakref.WeakSet[asyncio.Task[object]] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.levelno >= logging.ERROR and isinstance(record.msg, str) and record.msg.startswith(self.PREFIX)):
            return True
        try:
            task = asyncio.current_task()  # the call's: grpc.aio logs this inside it
        except RuntimeError:  # no running loop
            task = None
        if task is not None:
            self.tasks.add(task)
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.msg = f"{record.msg}: the client went away before its reply was sent"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


REPLY_LOST = ReplyLostFilter()
"""The one filter :meth:`KVStoreServicer.add_to_server` installs on grpc.aio's logger (its
:attr:`~ReplyLostFilter.tasks` are the calls whose reply was lost)."""
class ReplyCharge:
    """What a Get's reply is charged under a :class:`~kvstore.server.limits.ReplyBudget`, until the call ends."""

    __slots__ = ("budget", "peer", "tenant", "nbytes")

    def __init__(self, budget: ReplyBudget, peer: str, tenant: str, nbytes: int) -> None:
        self.budget = budget
        self.peer = peer
        self.tenant = tenant
        self.nbytes = nbytes


class CallHost(Protocol):
    """What a :class:`GrpcCall` needs of the servicer it runs in (:class:`KVStoreServicer` is one)."""

    @property
    def accepting(self) -> bool:
        """``False`` once shutdown began (new calls get UNAVAILABLE)."""
        ...

    @property
    def admission(self) -> Admission:
        """Admits each call (token, in-flight slot) and takes its slot back."""
        ...

    @property
    def metrics(self) -> ServiceMetrics | None:
        """Where each call is counted, ``None`` for nowhere."""
        ...

    async def fail(self, method: str, context: grpc.aio.ServicerContext, exc: BaseException,
                   start_s: float) -> NoReturn:
        """End a call with the status of ``exc`` (logged, counted, then ``context.abort``, which raises)."""
        ...


class GrpcCall:
    """One gRPC call, from admission to its status: ``async with servicer._call(method, context) as call``.

    On entry it refuses the call while shutting down (UNAVAILABLE) and admits it
    (``kvstore.server.admission``: token, in-flight slot); on exit it releases
    the slot, counts the call in the metrics, and turns a raised kvstore error
    into its status code (``kvstore.error_codes.status_of``) with
    ``context.abort`` (the servicer's handlers shed the abort). A call that ended on the client's side (it went away, or
    its deadline passed) is counted as CANCELLED or DEADLINE_EXCEEDED and ends
    as cancelled, however the handler finished.

    A plain class rather than ``contextlib.asynccontextmanager``: this runs on
    every call, and a generator-based manager costs a few microseconds more.

    Args:
        servicer: the servicer the call runs in (:class:`CallHost`).
        method: the call's method, as counted (``Get``).
        context: the call's grpc.aio context.

    Attributes:
        method: as given.
        context: as given.
        principal: the caller (``None`` without authentication), once admitted.
    """

    __slots__ = ("_servicer", "method", "context", "_start_s", "_ticket", "_watch", "principal", "_reply")

    def __init__(self, servicer: CallHost, method: str, context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self.method = method
        self.context = context
        self._ticket: Ticket | None = None
        self._watch: StreamWatch | None = None
        self.principal: Principal | None = None
        self._reply: ReplyCharge | None = None  # what a Get under a ReplyBudget is charged

    def peer(self) -> str:
        """The call's client connection (what per-connection limits count by)."""
        return self._ticket.peer if self._ticket is not None and self._ticket.peer else self.context.peer()

    def reply_turn(self, budget: ReplyBudget, tenant: str, num_blocks: int) -> Awaitable[None] | None:
        """Take a Get's turn under ``budget`` (``kvstore.server.budgets.ReplyBudget``): ``None`` when admitted
        now, else the wait to await; what it is charged is released when the call ends."""
        peer = self.peer()
        estimate = budget.estimate(num_blocks)
        if budget.admit(peer, tenant, estimate):
            self._reply = ReplyCharge(budget, peer, tenant, estimate)
            return None
        return self._wait_reply(budget, peer, tenant, estimate)

    async def _wait_reply(self, budget: ReplyBudget, peer: str, tenant: str, estimate: int) -> None:
        await budget.wait(peer, tenant, estimate)
        self._reply = ReplyCharge(budget, peer, tenant, estimate)

    def charge_reply(self, blocks: Sequence[Buffer]) -> None:
        """Charge the reply's real size (its blocks') instead of the estimate of :meth:`reply_turn`."""
        reply = self._reply
        if reply is not None:
            nbytes = sum(memoryview(block).nbytes for block in blocks)
            reply.budget.settle(reply.peer, reply.tenant, reply.nbytes, nbytes, len(blocks))
            reply.nbytes = nbytes

    def _end_reply(self) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            reply.budget.release(reply.peer, reply.tenant, reply.nbytes)

    def give_back_slot(self) -> None:
        """Give the call's in-flight slot back now, for the rest of a long-lived call (a same-host session's
        Attach stream, which ``shared_memory.max_sessions`` bounds instead)."""
        if self._ticket is not None:
            self._servicer.admission.release(self._ticket)
            self._ticket = self._ticket._replace(peer=None)

    def watch(self, watchdog: StreamWatchdog) -> None:
        """Put the rest of the call under ``watchdog`` (``limits.max_stream_s``), until the call leaves.

        Where the watchdog ends it, the call ends with DEADLINE_EXCEEDED. The
        same as ``async with watchdog.watch(method)`` to the end of the call,
        without a scope of its own on every Get, and started at the call's
        first wait (:meth:`StreamWatch.open_soon`), off the way to its first message.
        """
        self._watch = watchdog.watch(self.method).open_soon()

    async def __aenter__(self) -> GrpcCall:
        self._start_s = time.perf_counter()
        servicer = self._servicer
        try:
            if not servicer.accepting:
                raise UnavailableError("the server is shutting down")
            ticket = servicer.admission.admit(self.method, self.context)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes a status
            await servicer.fail(self.method, self.context, exc, self._start_s)
        self._ticket = ticket
        self.principal = ticket.principal
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: object) -> bool:
        servicer = self._servicer
        if self._watch is not None and self._watch.close(exc_type):  # the watchdog ended the stream
            exc = self._watch.error()
            exc.__suppress_context__ = True
        cancelled = isinstance(exc, asyncio.CancelledError)
        ended = cancelled or isinstance(exc, grpc.aio.InternalError) or (
            not isinstance(exc, grpc.aio.AbortError) and call_ended(self.context))
        if exc is None and not ended:
            # the reply's last message and the status go out in one batch once this returns (a unary handler's,
            # see KVStoreServicer.add_to_server): the slot is given back and the call counted when gRPC is done
            # with them, off the client's way, so a client that stops reading keeps its connection's slots. On
            # the task, not context.add_done_callback: grpc.aio never clears a context's callbacks, which made
            # every call cyclic garbage (GrpcCall -> context -> its callbacks -> GrpcCall); asyncio drops a task's
            task = asyncio.current_task()
            assert task is not None  # a call runs in its own task
            task.add_done_callback(self._finish)
            return False
        if self._ticket is not None:
            servicer.admission.release(self._ticket)
        self._end_reply()
        metrics = servicer.metrics
        if ended:
            # the client went away or its deadline passed: grpc.aio cancels the handler, or a write on the
            # finished call fails (grpc.aio.InternalError: ExecuteBatchError, before the context knows the
            # call is cancelled), or the handler ends unaware; either way the client has its status
            remaining = self.context.time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"
            logger.debug("%s %s", self.method, code)
            if metrics is not None:
                metrics.observe(self.method, code, time.perf_counter() - self._start_s)
            if cancelled or not (exc is None or isinstance(exc, Exception)):
                return False  # cancellation (or a KeyboardInterrupt) goes on
            # a call already over, whether the handler ended normally or by an error (a failed write, a deadline
            # seen inside it): the client has its status, and sending a reply or another status would fail in
            # gRPC's core (logged as an ERROR); ending as cancelled is what grpc.aio expects and logs at DEBUG
            raise asyncio.CancelledError(f"the call ended first ({code})") from exc
        if isinstance(exc, grpc.aio.AbortError) or not isinstance(exc, Exception):
            return False  # already aborted with its status; or a BaseException (KeyboardInterrupt) to propagate
        await servicer.fail(self.method, self.context, exc, self._start_s)

    def _finish(self, task: asyncio.Task[object]) -> None:
        """The end of a call that succeeded, once gRPC has sent its reply and status: its in-flight slot back, its count.

        Run (a done callback of the call's task, ``task``) when the call's task
        ends, however it ends: a reply stalled by a client that stopped reading
        holds its slot until the call's deadline or connection ends it. A reply
        lost that way counts as CANCELLED or DEADLINE_EXCEEDED when grpc.aio
        logged it (:class:`ReplyLostFilter`) or the deadline has passed. When
        grpc.aio learns of a cancellation before the batch fails, it logs
        nothing, and such a call counts as OK.
        """
        servicer = self._servicer
        context = self.context
        if self._ticket is not None:
            servicer.admission.release(self._ticket)
        self._end_reply()
        code = "OK"
        if task in REPLY_LOST.tasks or call_ended(context):  # the reply was lost: the client ended the call
            remaining = context.time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"
        if servicer.metrics is not None:
            servicer.metrics.observe(self.method, code, time.perf_counter() - self._start_s)


def call_ended(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is over from the client's side: cancelled, or past its deadline."""
    if context.cancelled():
        return True
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0

