"""The node's same-host data plane: the sessions, the handoff socket, and the copies into and out of segments.

``kvstore serve`` makes one :class:`SharedMemoryNode` when ``shared_memory.enabled``
is set and the platform has what it needs (:func:`kvstore.shm.segment.unsupported_reason`).
The servicer calls it from the ``Capabilities``, ``Attach``, ``GetShared`` and
``PutShared`` methods, after the usual admission and tenant checks; it knows no
gRPC. A Get's blocks are copied once, from the store's leased memory into a
range of the session's get segment (a worker thread copies batches of
:data:`INLINE_COPY_BYTES` or more, off the event loop); a Put's blocks are
copied once, out of the session's put segment, and the store validates each
copy (header, checksum) before anything is stored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import uuid
from typing import Any, Callable, Coroutine, Hashable, NamedTuple, Sequence

import numpy as np

from kvstore.api import Buffer
from kvstore.config import SharedMemoryConfig
from kvstore.errors import InvalidArgumentError
from kvstore.shm.handoff import HandoffServer
from kvstore.shm.segment import Segment
from kvstore.shm.sessions import Lease, Session, SessionTable, session_budgets
from kvstore.tiers.base import Framing

logger = logging.getLogger(__name__)

BLOCK_ALIGNMENT = 64
"""Alignment of each block inside a Get's range, bytes: a cache line, and every dtype's item size."""

INLINE_COPY_BYTES = 4 << 20
"""A Get whose blocks total less than this is copied on the event loop; a larger one in a worker thread, bytes."""

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``): the same for every process and container on
    one host, and different on any other host or after a reboot; ``""`` where it cannot be read."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def default_handoff_address(unix_socket: str) -> str:
    """The handoff socket of a node: beside its gRPC Unix socket (``<path>.shm``) when it has one, so that one shared
    directory carries both, else an abstract socket of a random name (no file to leave behind)."""
    if unix_socket:
        return unix_socket + ".shm"
    return f"@kvstore-shm-{uuid.uuid4().hex}"


class BlockRanges(NamedTuple):
    """Where a Get's blocks are in the session's get segment: ``lease`` is ``None`` when it had no room."""

    lease: Lease | None
    offsets: list[int]
    sizes: list[int]


class SharedMemoryNode:
    """One node's same-host data plane.

    Args:
        config: the ``shared_memory`` settings.
        handoff_address: where to listen for handoffs (:func:`default_handoff_address`).

    Attributes:
        host_id: what the node offers as its host (:func:`host_id`).
        handoff_address: as given.
        sessions: the session table (after :meth:`start`).
        serve_channel: serves one control channel of a session (``kvstore.server.shm_control``) until it ends;
            ``None`` (the default): the node hands over no control channel, and control goes over gRPC.
    """

    def __init__(self, config: SharedMemoryConfig, handoff_address: str) -> None:
        self.config = config
        self.host_id = host_id()
        self.handoff_address = handoff_address
        self.sessions: SessionTable | None = None
        self._handoff: HandoffServer | None = None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.stopping: asyncio.Event | None = None
        self.serve_channel: Callable[[Session, socket.socket], Coroutine[Any, Any, None]] | None = None
        self._channels: dict[int, list[socket.socket]] = {}  # session id -> the node's ends of its control channels
        self._channel_tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen on the handoff socket.

        Raises:
            OSError: if the socket cannot be bound (in use, or its directory cannot be made).
        """
        loop = asyncio.get_running_loop()
        config = self.config
        self.sessions = SessionTable(segment_bytes=config.segment_bytes, max_sessions=config.max_sessions,
                                     lease_s=config.lease_s, grant_s=config.grant_s, clock=loop.time,
                                     **session_budgets(config), call_at=loop.call_at)
        self.stopping = asyncio.Event()
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-shm-copy")
        self._handoff = HandoffServer(self.handoff_address, self._redeem)
        await self._handoff.start()

    # ------------------------------------------------------------------ sessions

    def open(self, principal: Hashable | None) -> Session:
        """A new session for ``principal`` (see :meth:`SessionTable.open` for errors)."""
        assert self.sessions is not None, "start() first"
        return self.sessions.open(principal)

    def session(self, session_id: int, principal: Hashable | None) -> Session:
        """The session a call names (see :meth:`SessionTable.session` for errors)."""
        assert self.sessions is not None, "start() first"
        return self.sessions.session(session_id, principal)

    def close_session(self, session: Session) -> None:
        """End a session: its leases, its grant and this side's mappings of its segments."""
        for sock in self._channels.pop(session.session_id, ()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # its task sees the end, sends the reply of a call in flight, closes it
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
        get_fd = session.get_segment.read_only_fd()
        fds = [get_fd, os.dup(session.put_segment.fd)]
        if self.serve_channel is not None and num_channels:
            loop = asyncio.get_running_loop()
            for _ in range(num_channels):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                fds.append(theirs.detach())
                self._channels.setdefault(session.session_id, []).append(ours)
                task = loop.create_task(self.serve_channel(session, ours), name="kvstore-shm-control")
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
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if self.sessions is not None:
            self.sessions.cancel_reclaim()
            self.sessions.close_all()

    # ------------------------------------------------------------------ Get: into the get segment

    async def copy_out(self, session: Session, blocks: Sequence[Buffer]) -> BlockRanges:
        """Copy a Get's blocks into a new leased range of the session's get segment.

        The caller keeps the blocks readable (a store read, open) until this
        returns. A call cancelled while a worker thread copies leaves the lease
        to end when the copy has, so no range is reused under a copy.

        Returns:
            The lease and each block's offset and length (the offsets in the
            segment, each block :data:`BLOCK_ALIGNMENT`-aligned); no lease and no
            offsets when the segment has no room for them (the client uses gRPC).
        """
        assert self.sessions is not None
        sizes = [memoryview(block).nbytes for block in blocks]
        if not sizes:
            return BlockRanges(None, [], [])
        relative, position = [], 0
        for nbytes in sizes:
            relative.append(position)
            position += -(-nbytes // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        lease = self.sessions.lease(session, position)
        if lease is None:
            return BlockRanges(None, [], sizes)
        offsets = [lease.offset + r for r in relative]
        self._schedule_expiry(lease.expires_at)
        segment = session.get_segment
        if position < INLINE_COPY_BYTES:
            view = segment.view
            for block, offset, nbytes in zip(blocks, offsets, sizes):
                view[offset:offset + nbytes] = block
            return BlockRanges(lease, offsets, sizes)
        loop = asyncio.get_running_loop()
        copy = loop.run_in_executor(self._copier, _copy_into, segment, list(blocks), offsets)
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            tables = self.sessions
            copy.add_done_callback(lambda _: tables.release(session, [lease.lease_id]))
            raise
        return BlockRanges(lease, offsets, sizes)

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

    @staticmethod
    def copy_in(session: Session, offsets: Sequence[int], sizes: Sequence[int],
                framing: Framing | None = None, check: Callable[[int, Buffer], None] | None = None) -> list[Buffer]:
        """The node's copy of each block the client staged in its put segment (memory of its own).

        What the client writes into its segment afterwards, or while this runs,
        changes nothing here but these copies, which the store validates
        (header, checksum) before it stores any of them.

        With ``framing`` (the memory tier's, ``kvstore.wire.reply_head``), each
        block is copied once, straight into its stored form: ``head || block``
        in one ``bytes``, and the copy returned is the view of its block part,
        which the heap tier keeps as it is (``kvstore.tiers.heap``) instead of
        copying it again behind its head.

        Args:
            session: the client's session.
            offsets: each block's offset in the put segment, bytes.
            sizes: each block's length, bytes.
            framing: the head stored before a block of ``n`` bytes (``None``: no head).
            check: called with each block's position and copy as soon as it is made, the copy still in cache
                (``kvstore.validation.BlockChecker.check``: the store then need not read it again); its error
                ends the copying.

        Raises:
            InvalidArgumentError: if the offsets and sizes differ in number, or a range is not inside the segment.
            Exception: what ``check`` raises.
        """
        if len(offsets) != len(sizes):
            raise InvalidArgumentError(f"{len(offsets)} offsets but {len(sizes)} sizes")
        view = session.put_segment.view
        limit = session.put_segment.nbytes
        copies: list[Buffer] = []
        heads: dict[int, bytes | None] = {}  # the framing of each block size seen (a batch has one)
        for i, (offset, nbytes) in enumerate(zip(offsets, sizes)):
            if not 0 < nbytes <= limit - offset or offset < 0:
                raise InvalidArgumentError(f"block {i}: range [{offset}, {offset + nbytes}) is not inside "
                                           f"the put segment of {limit} bytes")
            if nbytes not in heads:
                heads[nbytes] = framing(nbytes) if framing is not None else None
            head = heads[nbytes]
            if head:
                copy: Buffer = memoryview(b"".join((head, view[offset:offset + nbytes])))[len(head):]
            else:
                copy = bytes(view[offset:offset + nbytes])
            if check is not None:
                check(i, copy)
            copies.append(copy)
        return copies

    def counters(self) -> dict[str, int]:
        """Sessions, leases and their counts (``kvstore stats`` and the metrics show them as ``shm_*``)."""
        return {} if self.sessions is None else self.sessions.counters()


def _copy_into(segment: Segment, blocks: list[Buffer], offsets: list[int]) -> None:
    """Copy each block to its offset of ``segment`` (a worker thread: numpy's copy runs without the GIL)."""
    target = np.frombuffer(segment.view, dtype=np.uint8)
    for block, offset in zip(blocks, offsets):
        source = np.frombuffer(block, dtype=np.uint8)
        np.copyto(target[offset:offset + source.size], source)
