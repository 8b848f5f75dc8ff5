"""The node's same-host data plane: the sessions, the handoff socket, the control channels, and the bytes.

``kvstore serve`` makes one :class:`SharedMemoryNode` when ``shared_memory.enabled``
is set and the platform has what it needs (:func:`kvstore.shm.segment.unsupported_reason`).
The same-host operations (``kvstore.shm.node.operations``) call it after the
node's checks; it knows no gRPC.

A Get's blocks that lie in the node's shared pool (``kvstore.shm.node.pool``, the
memory tier of ``kvstore serve``) are leased to the client where they lie: the
node copies nothing, and sends each slab's descriptor once per session, with
the first reply that names it. Any other block of a Get (read from disk or
Redis) is copied once into a range of the session's get segment. A Put's
blocks are copied once, out of the session's put segment, straight into
ranges of the pool (or into memory of the node's own where the pool has no
room), and each copy is checked as soon as it is made; a worker thread copies
a batch of :data:`INLINE_COPY_BYTES` or more, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import resource
import socket
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np

from kvstore.api import Buffer
from kvstore.config import SharedMemoryConfig
from kvstore.errors import InvalidArgumentError
from kvstore.store.reads import BlockRead
from kvstore.errors import ResourceExhaustedError
from kvstore.shm.frames import MAX_CHANNELS, MAX_REPLY_DESCRIPTORS
from kvstore.shm.host import BLOCK_ALIGNMENT, host_id
from kvstore.shm.node.control import ControlServer, Dispatch
from kvstore.shm.node.handoff import HandoffServer
from kvstore.shm.node.pool import SharedPool
from kvstore.shm.node.sessions import Session, SessionTable, session_budgets
from kvstore.shm.segment import SegmentError
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

INLINE_COPY_BYTES = 4 << 20
"""A batch whose blocks total less than this is copied on the event loop; a larger one in worker threads, bytes."""

FDS_PER_SESSION = 1 + MAX_CHANNELS
"""File descriptors a session may hold on the node: its get segment's, and one per control channel (its put
segment's is closed once handed over)."""
RESERVED_FDS = 512
"""File descriptors kept for everything else of the node: listeners, connections, LMDB, Redis, pool slabs, logs."""


class SessionLimits(NamedTuple):
    """How many same-host sessions the node's file descriptors allow (:func:`session_limits`)."""

    max_sessions: int
    max_sessions_per_tenant: int
    fd_limit: int


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (the most it may); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def session_limits(config: SharedMemoryConfig, fd_limit: int) -> SessionLimits:
    """The session caps ``config`` asks for, lowered to what ``fd_limit`` descriptors allow.

    Each session may hold :data:`FDS_PER_SESSION` descriptors, and :data:`RESERVED_FDS` are kept for the rest of
    the node; one tenant may then take at most half of the sessions, so that another can still attach.
    """
    by_fds = max(1, (fd_limit - RESERVED_FDS) // FDS_PER_SESSION)
    max_sessions = min(config.max_sessions, by_fds)
    per_tenant = config.max_sessions_per_tenant
    if max_sessions < config.max_sessions:  # lowered: keep room for another tenant
        per_tenant = min(per_tenant, max(1, max_sessions // 2))
    return SessionLimits(max_sessions, min(per_tenant, max_sessions), fd_limit)


class Copies(NamedTuple):
    """The node's copies of a Put's blocks: ``blocks`` to give the store, and ``close`` to call once the store's put
    has ended (it frees the pool ranges the store did not take)."""

    blocks: Sequence[Buffer]
    close: Callable[[], None]


class SharedMemoryNode:
    """One node's same-host data plane.

    Args:
        config: the ``shared_memory`` settings.
        handoff_address: where to listen for handoffs (``kvstore.shm.host.default_handoff_address``).
        pool: the store's memory tier when it is the shared pool (Gets are then read in place, Puts copied straight
            into it); ``None``: every Get is copied into the session's get segment.
        max_request_bytes: the largest control request body, bytes (``server.max_message_bytes``).

    Attributes:
        host_id: what the node offers as its host (``kvstore.shm.host.host_id``).
        handoff_address: as given.
        pool: as given.
        sessions: the session table (after :meth:`start`).
        serve_frame: serves one control-channel request (``SameHostOperations.dispatch``); ``None`` (the
            default): the node hands over no control channel, and control goes over gRPC.
        stopping: set once the node begins to shut down (after :meth:`start`).
    """

    def __init__(self, config: SharedMemoryConfig, handoff_address: str, pool: SharedPool | None = None,
                 max_request_bytes: int = 4 << 20) -> None:
        self.config = config
        self.host_id = host_id()
        self.handoff_address = handoff_address
        self.pool = pool
        self.sessions: SessionTable | None = None
        self.serve_frame: Dispatch | None = None
        self.stopping: asyncio.Event | None = None
        self._max_request_bytes = max_request_bytes
        self._control: ControlServer | None = None
        self._handoff: HandoffServer | None = None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._channels: dict[int, list[socket.socket]] = {}  # session id -> the node's ends of its control channels
        self._channel_tasks: set[asyncio.Task[None]] = set()
        self._slabs_sent: dict[int, set[int]] = {}  # session id -> the pool slabs whose descriptors it has

    async def start(self) -> None:
        """Listen on the handoff socket.

        Raises:
            OSError: if the socket cannot be bound (in use, or its directory cannot be made).
        """
        loop = asyncio.get_running_loop()
        config = self.config
        limits = session_limits(config, raise_fd_limit())
        if limits.max_sessions < config.max_sessions:
            logger.warning("RLIMIT_NOFILE=%d allows %d same-host sessions of up to %d descriptors each: "
                           "shared_memory.max_sessions=%d lowered to %d, max_sessions_per_tenant to %d; raise the "
                           "open-files limit (ulimit -n, compose ulimits.nofile, the pod's runtime) for more",
                           limits.fd_limit, limits.max_sessions, FDS_PER_SESSION, config.max_sessions,
                           limits.max_sessions, limits.max_sessions_per_tenant)
        else:
            logger.info("same-host data plane: up to %d sessions (%d per tenant), RLIMIT_NOFILE=%d",
                        limits.max_sessions, limits.max_sessions_per_tenant, limits.fd_limit)
        budgets = {**session_budgets(config), "max_sessions_per_tenant": limits.max_sessions_per_tenant}
        self.sessions = SessionTable(segment_bytes=config.segment_bytes, max_sessions=limits.max_sessions,
                                     lease_s=config.lease_s, grant_s=config.grant_s, clock=loop.time,
                                     **budgets, call_at=loop.call_at)
        self.stopping = asyncio.Event()
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-shm-copy")
        self._handoff = HandoffServer(self.handoff_address, self._redeem)
        await self._handoff.start()

    # ------------------------------------------------------------------ sessions

    def open(self, principal: Hashable | None) -> Session:
        """A new session for ``principal`` (see :meth:`SessionTable.open` for errors).

        Raises:
            ResourceExhaustedError: also when the node is out of file descriptors (logged).
        """
        assert self.sessions is not None, "start() first"
        try:
            return self.sessions.open(principal)
        except (OSError, SegmentError) as exc:
            if not _out_of_descriptors(exc):
                raise
            logger.warning("a same-host session was refused: the node is out of file descriptors (%s); raise "
                           "RLIMIT_NOFILE or lower shared_memory.max_sessions", exc)
            raise ResourceExhaustedError("the node is out of file descriptors for another same-host session; "
                                         "use the gRPC data path") from None

    def session(self, session_id: int, principal: Hashable | None) -> Session:
        """The session a call names (see :meth:`SessionTable.session` for errors)."""
        assert self.sessions is not None, "start() first"
        return self.sessions.session(session_id, principal)

    def close_session(self, session: Session) -> None:
        """End a session: its leases (and the pool blocks they hold), its grant, its channels, its segments."""
        for sock in self._channels.pop(session.session_id, ()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # its task sees the end, sends the reply of a call in flight, closes it
        self._slabs_sent.pop(session.session_id, None)
        if self.sessions is not None:
            self.sessions.close(session)

    def release(self, session: Session, lease_ids: Sequence[int]) -> int:
        """End leases the client is done with; returns how many ended."""
        assert self.sessions is not None
        return self.sessions.release(session, list(lease_ids))

    def _redeem(self, grant: bytes, num_channels: int = 0) -> tuple[tuple[int, int], list[int]] | None:
        assert self.sessions is not None
        session = self.sessions.redeem(grant)
        if session is None:
            return None
        fds = [session.get_segment.read_only_fd(), os.dup(session.put_segment.fd)]
        session.put_segment.drop_descriptor()  # handed over: from now on only the client's mapping can write it
        if self.serve_frame is not None and num_channels:
            if self._control is None:
                self._control = ControlServer(self.serve_frame, self._max_request_bytes)
            loop = asyncio.get_running_loop()
            for _ in range(num_channels):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                fds.append(theirs.detach())
                self._channels.setdefault(session.session_id, []).append(ours)
                task = loop.create_task(self._control.serve(session, ours), name="kvstore-shm-control")
                self._channel_tasks.add(task)
                task.add_done_callback(self._channel_tasks.discard)
        return (session.get_segment.nbytes, session.put_segment.nbytes), fds

    def begin_shutdown(self) -> None:
        """End every session's ``Attach`` stream, so that clients detach and use gRPC while the node drains."""
        if self.stopping is not None:
            self.stopping.set()

    async def close(self) -> None:
        """Stop the handoff socket and end every session."""
        self.begin_shutdown()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._handoff is not None:
            await self._handoff.close()
            self._handoff = None
        for task in list(self._channel_tasks):
            task.cancel()
        for task in list(self._channel_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._channels.clear()
        self._slabs_sent.clear()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if self.sessions is not None:
            self.sessions.cancel_reclaim()
            self.sessions.close_all()

    # ------------------------------------------------------------------ Get: in place, or into the get segment

    async def lease_blocks(self, session: Session, read: BlockRead, blocks: Sequence[Buffer],
                           fds: list[int] | None) -> pb.GetSharedResponse:
        """Lease an opened read's blocks to ``session``: the reply naming where each lies, until the lease ends.

        Blocks of the pool are named in place when ``fds`` is a list (the
        transport carries descriptors): a slab the session has not seen yet
        gets a read-only descriptor in ``fds`` and an entry in ``new_slabs``
        (at most :data:`~kvstore.shm.frames.MAX_REPLY_DESCRIPTORS` a reply;
        beyond them, blocks are copied). Every other block is copied into a
        new range of the session's get segment. The read stays open (its
        blocks held, so no range is reused) until the lease ends, which closes
        it: the client releases it, ``lease_s`` passes, or the session ends.
        A call cancelled while a worker thread copies leaves the lease to end
        when the copy has.

        Returns:
            The reply: ``no_room`` (and no lease: the read is closed) when the get segment or a leased-bytes
            budget has no room for the prefix (the client uses gRPC); an empty reply for an empty prefix.
        """
        assert self.sessions is not None
        sizes = [memoryview(block).nbytes for block in blocks]
        if not sizes:
            read.close()
            return pb.GetSharedResponse()
        pool, places = self.pool, read.places
        if fds is None or pool is None or places is None:
            places = [None] * len(sizes)
        sent = self._slabs_sent.setdefault(session.session_id, set())
        new: list[int] = []
        slabs, offsets, copied, pooled_bytes = [0] * len(sizes), [0] * len(sizes), [], 0
        for i, place in enumerate(places):
            slab = pool.slab(place.slab_id) if place is not None and pool is not None else None
            if slab is not None and (slab.slab_id in sent or slab.slab_id in new
                                     or len(new) < MAX_REPLY_DESCRIPTORS):
                if slab.slab_id not in sent and slab.slab_id not in new:
                    new.append(slab.slab_id)
                slabs[i], offsets[i] = slab.slab_id, place.offset
                pooled_bytes += sizes[i]
            else:
                copied.append(i)
        position = 0
        for i in copied:
            offsets[i] = position
            position += -(-sizes[i] // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        lease = self.sessions.lease(session, position, pooled_bytes=pooled_bytes, on_end=read.close)
        if lease is None:
            read.close()
            return pb.GetSharedResponse(no_room=True)
        self._schedule_expiry(lease.expires_at)
        for i in copied:
            offsets[i] += lease.offset
        if copied:
            await self._copy_out(session, lease.lease_id, [blocks[i] for i in copied], [offsets[i] for i in copied])
        if not pooled_bytes:  # every block was copied: nothing of the store's is held for the lease
            lease.on_end = None
            read.close()
        else:
            read.settle()  # counted, its blocks let go and promotions offered now: the pool keeps their ranges leased
        reply = pb.GetSharedResponse(lease_id=lease.lease_id, offsets=offsets, sizes=sizes)
        if pooled_bytes:
            reply.slabs.extend(slabs)
        if fds is not None and pool is not None:
            for slab_id in new:
                slab = pool.slab(slab_id)
                assert slab is not None  # held by this lease's blocks
                fds.append(slab.read_only_fd())
                reply.new_slabs.add(slab_id=slab_id, nbytes=slab.nbytes, touched=slab.touched)
                sent.add(slab_id)
            retired = [slab_id for slab_id in sent if pool.slab(slab_id) is None]
            if retired:
                sent.difference_update(retired)
                reply.retired_slabs.extend(retired)
        return reply

    async def _copy_out(self, session: Session, lease_id: int, blocks: list[Buffer], offsets: list[int]) -> None:
        """Copy blocks to their offsets of the session's get segment (in worker threads for a large batch)."""
        segment = session.get_segment
        if sum(memoryview(b).nbytes for b in blocks) < INLINE_COPY_BYTES:
            view = segment.view
            for block, offset in zip(blocks, offsets):
                view[offset:offset + memoryview(block).nbytes] = block
            return
        target = np.frombuffer(segment.view, dtype=np.uint8)
        copy = self._in_threads(lambda i: np.copyto(target[offsets[i]:offsets[i] + memoryview(blocks[i]).nbytes],
                                                    np.frombuffer(blocks[i], dtype=np.uint8)), len(blocks))
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            tables = self.sessions
            assert tables is not None
            copy.add_done_callback(lambda _: tables.release(session, [lease_id]))
            raise

    def _in_threads(self, work: Callable[[int], Any], count: int) -> asyncio.Future[None]:
        """Run ``work(i)`` for ``i`` in ``range(count)``, split over the copier's two threads (numpy's copies
        and xxhash's digests release the GIL): a future that ends once both halves have, with the first error."""
        loop = asyncio.get_running_loop()
        half = (count + 1) // 2

        def run(start: int, stop: int) -> None:
            for i in range(start, stop):
                work(i)

        async def both() -> None:
            parts = [loop.run_in_executor(self._copier, run, 0, half)]
            if half < count:
                parts.append(loop.run_in_executor(self._copier, run, half, count))
            for outcome in await asyncio.gather(*parts, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome

        return asyncio.ensure_future(both())

    def _schedule_expiry(self, expires_at: float) -> None:
        """Run :meth:`_expire` once the earliest lease in force is due (one timer for the node)."""
        if self._timer is not None and self._timer_at <= expires_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = expires_at
        self._timer = asyncio.get_running_loop().call_at(expires_at, self._expire)

    def _expire(self) -> None:
        self._timer = None
        assert self.sessions is not None
        self.sessions.expire()
        due = self.sessions.next_expiry()
        if due is not None:
            self._schedule_expiry(due)

    # ------------------------------------------------------------------ Put: out of the put segment

    async def copy_in(self, session: Session, tag: bytes, offsets: Sequence[int], sizes: Sequence[int],
                      check: Callable[[int, Buffer], None]) -> Copies:
        """The node's copy of each block the client staged in its put segment: one copy, into the pool where it
        has room (ranges the store then takes as they are), else into ``bytes`` of the node's own.

        What the client writes into its segment afterwards, or while this
        runs, changes nothing here but these copies, each of which ``check``
        validates right after it is made, while it is in cache (header,
        checksum: ``kvstore.validation.BlockChecker.check``), so the store need
        not read it again.

        Args:
            session: the client's session.
            tag: the put's namespace tag (the pool keeps one namespace per slab).
            offsets: each block's offset in the put segment, bytes.
            sizes: each block's length, bytes.
            check: called with each block's position and copy; its error ends the copying.

        Raises:
            InvalidArgumentError: if the offsets and sizes differ in number, or a range is not inside the segment.
            Exception: what ``check`` raises (nothing is kept).
        """
        if len(offsets) != len(sizes):
            raise InvalidArgumentError(f"{len(offsets)} offsets but {len(sizes)} sizes")
        limit = session.put_segment.nbytes
        for i, (offset, nbytes) in enumerate(zip(offsets, sizes)):
            if not 0 < nbytes <= limit - offset or offset < 0:
                raise InvalidArgumentError(f"block {i}: range [{offset}, {offset + nbytes}) is not inside "
                                           f"the put segment of {limit} bytes")
        source = np.frombuffer(session.put_segment.view, dtype=np.uint8)
        staging = self.pool.stage(tag, sizes) if self.pool is not None else None
        if staging is not None:
            blocks = staging.blocks
            targets = staging.targets
            close = staging.close
        else:
            owned = [bytearray(nbytes) for nbytes in sizes]
            targets = [np.frombuffer(b, dtype=np.uint8) for b in owned]
            blocks = [memoryview(b).toreadonly() for b in owned]
            close = _nothing

        def copy_and_check(i: int) -> None:
            np.copyto(targets[i], source[offsets[i]:offsets[i] + sizes[i]])
            check(i, blocks[i])

        try:
            if sum(sizes) < INLINE_COPY_BYTES:
                for i in range(len(sizes)):
                    copy_and_check(i)
            else:
                copy = self._in_threads(copy_and_check, len(sizes))
                try:
                    await asyncio.shield(copy)
                except asyncio.CancelledError:
                    copy.add_done_callback(lambda _: close())
                    raise
        except asyncio.CancelledError:
            raise
        except BaseException:
            close()
            raise
        return Copies(blocks, close)

    def counters(self) -> dict[str, int]:
        """Sessions, leases and their counts (``kvstore stats`` and the metrics show them as ``shm_*``)."""
        if self.sessions is None:
            return {}
        counts = self.sessions.counters()
        if self._handoff is not None:
            counts["handoff_dropped"] = self._handoff.dropped
        if self._control is not None:
            counts["control_bodies_refused"] = self._control.budget.refused
        return counts


def _out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` (or the ``OSError`` it was raised from) is ``EMFILE`` or ``ENFILE``."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE)


def _nothing() -> None:
    """The close of copies that are the node's own ``bytes``: nothing to free."""
