"""The client's side of the same-host data plane: one node's session, attached on first use and again after a restart.

A :class:`SharedMemoryLink` per node decides, once, whether the node is on this
host and offers the path (``Capabilities``: the node's kernel boot id must be
this one's, and its handoff socket reachable from here); if so it opens the
session (``Attach``), redeems its grant on the handoff socket for the two
segments and maps them: the get segment read-only, the put segment read-write.
Anything that fails on the way leaves the link off, logged once, and the
client's calls to that node go over gRPC with no error. The session ends with
its ``Attach`` stream, so the node ends it, and its leases, when this process
exits, however it exits.

A :class:`SharedSession` then serves the client's calls: it stages a Put's
blocks in the put segment (this client chooses the ranges), reads a Get's
blocks where they lie under the node's lease (in the slabs of the node's shared
pool, mapped read-only as their descriptors arrive with the replies that first
name them, or in the get segment where the node copied them), copies them into
the caller's memory, and releases the lease on the ``Attach`` stream.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import grpc

from kvstore.blocks.lease import BlockLease
from kvstore.blocks.copying import (Copied, byte_view, copy_batch_into, copy_block_into, copy_into_destinations,
                               encode_batch_into, encode_into, encoded_nbytes)
from kvstore.blocks.tensors import Layout, decode_header, torch_dtype, verify_block
from kvstore.errors import KVStoreError
from kvstore.shm.allocator import RangeAllocator
from kvstore.shm.client.control import ControlChannels, channels_wanted
from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.handoff import NOT_A_HANDOFF, HandoffRefused
from kvstore.shm.host import BLOCK_ALIGNMENT, host_id
from kvstore.shm.segment import Segment, SegmentError, unsupported_reason
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 5.0
"""Longest the attaching of a session may take (capabilities, the first reply, the handoff), seconds."""
RETRY_S = (1.0, 60.0)
"""First and longest pause before a link that failed to attach tries again, seconds (doubling)."""
LEASE_MARGIN_S = 0.5
"""A Get's blocks are used only if the copy ended this long before the lease's end, by this client's clock, seconds."""
PUT_WARM_BYTES = 32 << 20
"""Put-segment pages below this offset stay resident between puts (the first-fit allocator reuses them, so a
steady stream of puts faults no new page); a put's pages above it go back to the kernel once the node has
consumed the put, so a burst leaves no resident pages behind, bytes."""
FORK_QUIESCE_S = 2.0
"""Longest a fork waits for a session's threads to leave gRPC (gRPC's fork support off), seconds."""


class UseGrpc(Exception):
    """The same-host path declined one call (the segment had no room, or the lease ran out): send it over gRPC."""


class Staged(NamedTuple):
    """A Put's blocks staged in the put segment: each one's offset and length, bytes."""

    offset: int
    offsets: list[int]
    sizes: list[int]


class MappedSlab:
    """A slab of the node's shared pool, mapped read-only here (``kvstore.shm.node.pool``).

    The mapping lives as long as this object or a view of it: a copy in flight
    holds it, so a slab the node retires is unmapped only after that copy.

    Attributes:
        segment: the mapping.
    """

    __slots__ = ("segment", "__dict__")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    @functools.cached_property
    def raw(self) -> torch.Tensor:
        """A ``uint8`` tensor over the whole slab (made on first use)."""
        return byte_view(self.segment.view)


class _Source(NamedTuple):
    """Where a Get's blocks lie: per block, the view of its bytes, a ``uint8`` tensor over the same bytes' whole
    buffer and its offset there; ``common`` is that buffer's tensor when every block lies in one (else ``None``)."""

    views: list[memoryview]
    raws: list[Any]
    offsets: list[int]
    common: Any


class SharedSession:
    """An attached session with one node: its segments, its ``Attach`` stream, and this client's put ranges.

    Thread-safe. Made by :class:`SharedMemoryLink`.

    Attributes:
        session_id: the node's name for it.
        lease_s: how long a lease lasts, seconds.
        alive: ``False`` once the session ended (the node stopped, or :meth:`retire`).
        control: the session's control channels (``kvstore.shm.client.control``), ``None`` when the node handed over none
            (its control calls then go over gRPC).
    """

    def __init__(self, session_id: int, lease_s: float, get_segment: Segment, put_segment: Segment,
                 releases: queue.SimpleQueue[pb.AttachRequest | None], call: Any, channel: grpc.Channel,
                 control: ControlChannels | None = None) -> None:
        self.control = control
        self.session_id = session_id
        self.lease_s = lease_s
        self.get_segment = get_segment
        self.put_segment = put_segment
        self._releases = releases
        self._call = call
        self._channel = channel
        self._lock = threading.Lock()
        self._put_ranges = RangeAllocator(put_segment.nbytes)
        self.slabs: dict[int, MappedSlab] = {}  # the node's pool slabs mapped here, by id
        if control is not None:  # weakly: the session owns its channels, and must go when nothing else holds it
            mapper = weakref.WeakMethod(self._map_slabs)
            control.on_descriptors = lambda reply, fds: _map_or_close(mapper, reply, fds)
        self.alive = True
        self.threads: list[threading.Thread] = []  # its stream's reader and gRPC's threads of the stream

    @functools.cached_property
    def get_bytes(self) -> torch.Tensor:
        """A ``uint8`` tensor over the whole get segment, sliced per block; made on first use (a client that
        moves only bytes never imports torch: its first call costs what its second does)."""
        return byte_view(self.get_segment.view)

    @functools.cached_property
    def put_bytes(self) -> torch.Tensor:
        """A ``uint8`` tensor over the whole put segment; made on first use, as :attr:`get_bytes`."""
        return byte_view(self.put_segment.view)

    # ------------------------------------------------------------------ Get

    @property
    def in_place(self) -> bool:
        """Whether this session reads blocks in the node's pool slabs (it has control channels for their
        descriptors); else the node copies every block into its get segment."""
        return self.control is not None

    def _map_slabs(self, reply: Any, fds: list[int]) -> None:
        """Map the slabs a reply hands over (its ``new_slabs``, one descriptor each, in order); this owns ``fds``."""
        offers = list(getattr(reply, "new_slabs", ()))
        with self._lock:
            for i, fd in enumerate(fds):
                if i >= len(offers):
                    os.close(fd)
                    continue
                try:
                    segment = Segment.attach(fd, offers[i].nbytes, writable=False)
                except SegmentError as exc:  # not a slab: the blocks in it are missing, and the call uses gRPC
                    logger.warning("kvstore node: slab %d not mapped: %s", offers[i].slab_id, exc)
                    continue
                segment.populate(offers[i].touched)  # its pages in use, in one call, not a fault each on first read
                segment.drop_descriptor()  # read through the mapping alone: nothing to reopen in /proc/<pid>/fd
                self.slabs[offers[i].slab_id] = MappedSlab(segment)

    def _sources(self, reply: pb.GetSharedResponse) -> _Source:
        """Where each block of a reply lies (its slab, or the get segment), and the slabs the node retired unmapped.

        Raises:
            UseGrpc: if a block lies in a slab that is not mapped here.
        """
        with self._lock:
            for slab_id in reply.retired_slabs:
                slab = self.slabs.pop(slab_id, None)
                if slab is not None:
                    slab.segment.close()  # unmapped with its last view: a copy in flight keeps it
            slabs = reply.slabs
            offsets, sizes = list(reply.offsets), list(reply.sizes)
            if not slabs or not any(slabs):
                view, raw = self.get_segment.view, self.get_bytes
                return _Source([view[o:o + n] for o, n in zip(offsets, sizes)], [raw] * len(offsets), offsets, raw)
            views, raws = [], []
            for slab_id, o, n in zip(slabs, offsets, sizes):
                if slab_id:
                    slab = self.slabs.get(slab_id)
                    if slab is None:
                        raise UseGrpc(f"slab {slab_id} is not mapped here")
                    views.append(slab.segment.view[o:o + n])
                    raws.append(slab.raw)
                else:
                    views.append(self.get_segment.view[o:o + n])
                    raws.append(self.get_bytes)
        common = raws[0] if all(r is raws[0] for r in raws) else None
        return _Source(views, raws, offsets, common)

    def _ranges(self, reply: pb.GetSharedResponse, started: float) -> tuple[_Source, float]:
        if reply.no_room:
            raise UseGrpc("the get segment has no room for this prefix now")
        try:
            return self._sources(reply), started + self.lease_s - LEASE_MARGIN_S
        except UseGrpc:
            self.release(reply.lease_id)
            raise

    def release(self, lease_id: int) -> None:
        """End a lease (sent on the ``Attach`` stream, not waited for); nothing once the session ended."""
        if lease_id and self.alive:
            self._releases.put(pb.AttachRequest(release_lease_ids=[lease_id]))

    def _check_lease(self, lease_id: int, deadline: float) -> None:
        if time.monotonic() > deadline:  # the node may have written another Get's blocks there: fetch again
            self.release(lease_id)
            raise UseGrpc("the lease ran out before its blocks were copied")

    def copy_into(self, reply: pb.GetSharedResponse, destinations: Sequence[torch.Tensor], verify: bool,
                  started: float) -> Copied:
        """Copy the reply's blocks from the get segment into ``destinations`` (one copy each), then release.

        Args:
            reply: the node's ``GetSharedResponse``.
            destinations: one tensor per block hash of the request.
            verify: check each block's checksum (the node wrote what it validated at put time; see
                ``docs/shared-memory.md``).
            started: ``time.monotonic()`` when the request was sent (the lease began after it).

        Raises:
            UseGrpc: if the node had no room, or the lease ran out meanwhile.
            CodecError: on a malformed block, or (with ``verify``) a corrupt one.
        """
        source, deadline = self._ranges(reply, started)
        try:
            copied = None if verify else _copy_runs(source, destinations)
            if copied is None:
                copied = copy_into_destinations(source.views, destinations, verify,
                                                [r[o:o + b.nbytes] for r, o, b in
                                                 zip(source.raws, source.offsets, source.views)])
            self._check_lease(reply.lease_id, deadline)
            return copied
        finally:
            self.release(reply.lease_id)

    def take_bytes(self, reply: pb.GetSharedResponse, started: float) -> list[bytes]:
        """The reply's blocks as ``bytes`` the caller owns (one copy each), then release."""
        source, deadline = self._ranges(reply, started)
        try:
            blocks = [bytes(view) for view in source.views]
            self._check_lease(reply.lease_id, deadline)
            return blocks
        finally:
            self.release(reply.lease_id)

    def take_tensors(self, reply: pb.GetSharedResponse, verify: bool, started: float) -> list[torch.Tensor]:
        """The reply's blocks decoded into new CPU tensors (one copy each, straight from the segment), then release."""
        import torch

        source, deadline = self._ranges(reply, started)
        try:
            tensors = []
            for block, raw, o in zip(source.views, source.raws, source.offsets):
                header = verify_block(block) if verify else decode_header(block)
                tensor = torch.empty(header.shape, dtype=torch_dtype(header.dtype))
                copy_block_into(block, tensor, verify=False, source=raw[o:o + block.nbytes])
                tensors.append(tensor)
            self._check_lease(reply.lease_id, deadline)
            return tensors
        finally:
            self.release(reply.lease_id)

    def lease(self, reply: pb.GetSharedResponse, started: float) -> BlockLease:
        """The reply's blocks in place, as read-only views under the node's lease (see :class:`BlockLease`)."""
        source, deadline = self._ranges(reply, started)
        lease_id = reply.lease_id
        return BlockLease(source.views, [lambda: self.release(lease_id)] if lease_id else [], deadline,
                          checked=True, offsets=source.offsets if source.common is not None else None)

    # ------------------------------------------------------------------ Put

    def stage(self, blocks: Sequence[Block], layout: Layout | str) -> Staged | None:
        """Write blocks encoded into a new range of the put segment (one copy of each payload, from any device):
        a batch of like tensors with one header build for all (``kvstore.blocks.copying.encode_batch_into``).

        Returns:
            Where they are, or ``None`` when the put segment has no room for them now.

        Raises:
            UnknownDtypeError, ElementCountError: on a tensor the codec cannot encode (checked beforehand by the
                client, so not in practice).
        """
        sizes = [encoded_nbytes(block) for block in blocks]
        relative, position = [], 0
        for nbytes in sizes:
            relative.append(position)
            position += -(-nbytes // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        with self._lock:
            if self._put_ranges.aligned(position) > self._put_ranges.capacity_bytes:
                return None
            offset = self._put_ranges.allocate(position)
        if offset is None:
            return None
        offsets = [offset + r for r in relative]
        try:
            view = self.put_segment.view
            raw = None if all(isinstance(b, (bytes, bytearray, memoryview)) for b in blocks) else self.put_bytes
            if raw is None or not encode_batch_into(blocks, layout, view, raw, offsets):  # like tensors: one header
                for block, start, nbytes in zip(blocks, offsets, sizes):
                    encode_into(block, layout, view[start:start + nbytes],
                                None if raw is None else raw[start:start + nbytes])
        except BaseException:
            self.unstage(Staged(offset, offsets, sizes))
            raise
        return Staged(offset, offsets, sizes)

    def unstage(self, staged: Staged) -> None:
        """Give a put's range back, once the node's reply (or its error status) has arrived; its pages past
        :data:`PUT_WARM_BYTES` go back to the kernel first (``MADV_REMOVE``: the node has copied them out)."""
        if staged.sizes:
            page = self._put_ranges.alignment  # a multiple of the page size; the range is allocated in such units
            start = max(staged.offset, PUT_WARM_BYTES)
            end = -(-(staged.offsets[-1] + staged.sizes[-1]) // page) * page
            if end > start:
                self.put_segment.release(start, end - start)  # before the range is free for another put
        with self._lock:
            self._put_ranges.free(staged.offset)

    # ------------------------------------------------------------------ life

    def retire(self) -> None:
        """Stop using this session (a call on it ended without a clear outcome, or the node forgot it): end its
        stream, so the node ends it; its mappings go once no view of them is left."""
        self.alive = False
        if self.control is not None:
            self.control.close()
        self._releases.put(None)
        self._call.cancel()
        self._channel.close()
        self.get_segment.close()  # a call still copying keeps its views: the mappings go with the last of them
        self.put_segment.close()
        with self._lock:
            slabs, self.slabs = list(self.slabs.values()), {}
        for slab in slabs:
            slab.segment.close()

    def ended(self) -> None:
        """The node ended the stream (it stopped or restarted)."""
        self.alive = False


def _copy_runs(source: _Source, destinations: Sequence[torch.Tensor]) -> Copied | None:
    """Copy a reply's blocks with one strided ``copy_`` per run of them that lies in one buffer
    (:func:`~kvstore.blocks.copying.copy_batch_into`: a prefix put in one batch lies evenly spaced in one slab); ``None``
    (nothing copied) unless every run can be copied so."""
    raws, num_blocks = source.raws, len(source.views)
    runs, start = [], 0
    for i in range(1, num_blocks + 1):
        if i == num_blocks or raws[i] is not raws[start]:
            runs.append((start, i))
            start = i
    if len(runs) > 4 or any(stop - start < 2 for start, stop in runs):
        return None
    for start, stop in runs:
        if copy_batch_into(source.views[start:stop], destinations[start:stop], raws[start],
                           source.offsets[start:stop]) is None:
            return None if start == 0 else _copied_rest(source, destinations, start)
    return Copied(num_blocks, num_blocks)


def _copied_rest(source: _Source, destinations: Sequence[torch.Tensor], start: int) -> Copied:
    """Copy blocks ``start`` on one by one (the runs before them are copied already)."""
    rest = copy_into_destinations(source.views[start:], destinations[start:], False,
                                  [r[o:o + b.nbytes] for r, o, b in
                                   zip(source.raws[start:], source.offsets[start:], source.views[start:])])
    error = rest.error
    return Copied(start + rest.num_copied, start + rest.num_found, error)


def _map_or_close(mapper: weakref.WeakMethod[Any], reply: Any, fds: list[int]) -> None:
    """Hand a reply's descriptors to its session's slab mapping, or close them if the session is gone."""
    map_slabs = mapper()
    if map_slabs is not None:
        map_slabs(reply, fds)
        return
    for fd in fds:
        os.close(fd)


def _tell_ended(session_box: list[weakref.ref[SharedSession]]) -> None:
    session = session_box[0]() if session_box else None
    if session is not None:
        session.ended()


def _requests(releases: queue.SimpleQueue[pb.AttachRequest | None]) -> Iterator[pb.AttachRequest]:
    while True:
        item = releases.get()
        if item is None:
            return
        yield item


class SharedMemoryLink:
    """One node's same-host data plane as this client sees it: off, or an attached :class:`SharedSession`.

    Args:
        target: the node's gRPC target (``host:port`` or ``unix://<path>``).
        credentials: TLS channel credentials, as the client's; ``None`` for plaintext.
        metadata: call metadata (the bearer token), as the client's.
        options: gRPC channel options, as the client's.
    """

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str | bytes]] = (), options: Sequence[tuple[str, Any]] = ()) -> None:
        self.target = target
        self._credentials = credentials
        self._metadata = tuple(metadata)
        self._options = list(options)
        self._lock = threading.Lock()
        self._session: SharedSession | None = None
        self._retry_at = 0.0
        self._retry_s = RETRY_S[0]
        self._pid = os.getpid()
        self.reason = ""
        self._closed = False
        _LINKS.add(self)

    def current(self) -> SharedSession | None:
        """The attached session if there is one now (no I/O)."""
        session = self._session
        if session is not None and session.alive and self._pid == os.getpid():
            return session
        return None

    def settled(self) -> bool:
        """Whether :meth:`ensure` would answer without I/O (attached, or off until a later retry)."""
        return self.current() is not None or self._closed or time.monotonic() < self._retry_at

    def ensure(self, timeout_s: float = ATTACH_TIMEOUT_S) -> SharedSession | None:
        """The attached session, attaching first if it is time to try; ``None``: use gRPC (blocking; thread-safe).

        Args:
            timeout_s: the longest the attaching may take (at most :data:`ATTACH_TIMEOUT_S`), seconds:
                what is left of the calling call's deadline.
        """
        session = self.current()
        if session is not None:
            return session
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's session is the parent's
                self._pid, self._session, self._retry_at = os.getpid(), None, 0.0
            session = self.current()
            if session is not None or self._closed or time.monotonic() < self._retry_at:
                return session
            if self._session is not None:  # it ended (the node stopped): close what is left of it here
                self._session.retire()
                self._session = None
            try:
                self._session = self._attach(min(ATTACH_TIMEOUT_S, timeout_s))
            except _Off as off:
                self._off(str(off), permanent=off.permanent)
                return None
            except (grpc.RpcError, OSError, KVStoreError, TimeoutError) as exc:
                self._off(_detail(exc), permanent=False)
                return None
            self._retry_s = RETRY_S[0]
            if self.reason:
                logger.info("kvstore node %s: same-host data plane attached again", self.target)
            else:
                logger.info("kvstore node %s: same-host data plane attached (session %#x)", self.target,
                            self._session.session_id)
            self.reason = ""
            return self._session

    def lost(self, session: SharedSession | None) -> None:
        """The node no longer knows ``session`` (it restarted) or a call on it ended unclearly: attach afresh."""
        with self._lock:
            if session is not None and session is self._session:
                self._session = None
                session.retire()
            self._retry_at = 0.0

    def _off(self, reason: str, *, permanent: bool) -> None:
        if reason != self.reason:
            logger.info("kvstore node %s: no same-host data plane (%s); blocks go over gRPC", self.target, reason)
        self.reason = reason
        self._retry_at = math.inf if permanent else time.monotonic() + self._retry_s
        self._retry_s = min(RETRY_S[1], self._retry_s * 2)

    def _attach(self, timeout_s: float) -> SharedSession:
        reason = unsupported_reason()
        if reason is not None:
            raise _Off(reason, permanent=True)
        if self._credentials is not None:
            channel = grpc.secure_channel(self.target, self._credentials, options=self._options)
        else:
            channel = grpc.insecure_channel(self.target, options=self._options)
        try:
            return self._attach_on(channel, timeout_s)
        except BaseException:
            channel.close()
            raise

    def _attach_on(self, channel: grpc.Channel, timeout_s: float) -> SharedSession:
        stub = pb_grpc.KVStoreStub(channel)
        deadline = time.monotonic() + timeout_s
        try:
            capabilities = stub.Capabilities(pb.CapabilitiesRequest(), timeout=max(0.01, timeout_s),
                                             metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _Off("the node predates the same-host data plane", permanent=True) from None
            raise
        if not capabilities.HasField("shared_memory"):
            raise _Off("the node offers none", permanent=True)
        offer = capabilities.shared_memory
        if not offer.host_id or offer.host_id != host_id():
            raise _Off("the node is on another host", permanent=True)
        releases: queue.SimpleQueue[pb.AttachRequest | None] = queue.SimpleQueue()
        before = set(threading.enumerate())
        call = stub.Attach(_requests(releases), metadata=self._metadata)
        first: list[Any] = []
        got_first = threading.Event()
        session_box: list[weakref.ref[SharedSession]] = []  # weak: the session goes when the link lets go of it

        def read_stream() -> None:  # the stream's one reply, then its end: the session's end
            try:
                first.append(next(call))
            except BaseException as exc:  # noqa: BLE001 - handed to the attaching thread
                first.append(exc)
            got_first.set()
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                # the call raises itself: its traceback would hold this frame, and the frame the call (a cycle)
                exc.__traceback__ = None
            _tell_ended(session_box)

        threading.Thread(target=read_stream, name=f"kvstore-shm-{self.target}", daemon=True).start()
        threads = [t for t in threading.enumerate() if t not in before]  # the reader, gRPC's polling threads
        try:
            if not got_first.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("no reply to Attach")
            reply = first[0]
            if isinstance(reply, BaseException):
                raise reply
            sizes, fds = _redeem(offer.handoff_socket, reply.grant, deadline)
            control = ControlChannels(fds[2:]) if len(fds) > 2 else None
            try:
                get_segment = Segment.attach(fds[0], sizes[0], writable=False)
            except BaseException:
                os.close(fds[1])
                if control is not None:
                    control.close()
                raise
            try:
                put_segment = Segment.attach(fds[1], sizes[1], writable=True)
            except BaseException:
                get_segment.close()
                if control is not None:
                    control.close()
                raise
        except BaseException:
            releases.put(None)
            call.cancel()
            raise
        for segment in (get_segment, put_segment):  # used through the mappings alone: no other process of this
            segment.drop_descriptor()               # uid can reopen them through /proc/<pid>/fd (docs/security.md)
        session = SharedSession(reply.session_id, reply.lease_s, get_segment, put_segment, releases, call, channel,
                                control)
        session.threads = threads
        session_box.append(weakref.ref(session))
        if not call.is_active():  # ended before the reader could tell the session
            session.ended()
        return session

    def end_for_fork(self, timeout_s: float = FORK_QUIESCE_S) -> None:
        """Before a fork with gRPC Python's fork support off: end the session, and wait for its threads to end.

        Why: the session's ``Attach`` stream is a call always in flight, and the
        thread gRPC Python polls it in is inside gRPC core at almost every moment.
        gRPC core runs its fork handlers only when no other thread is inside it
        ("Other threads are currently calling into gRPC, skipping fork()
        handlers"); skipped, the child inherits the epoll1 poller mid-poll and its
        first call can abort there ("Check failed: next_worker->state == KICKED";
        measured: 6 of 300 forks under load, 0 of 300 with this). gRPC Python's
        own fork support (``GRPC_ENABLE_FORK_SUPPORT=1``) parks that thread
        instead, but each fork then waits about 1 s for it; when it is on, the
        hook does nothing. The next call, in the parent or the child, attaches a
        new session.

        Args:
            timeout_s: the longest this waits, for the link's lock and for the threads, seconds.
        """
        if not self._lock.acquire(timeout=timeout_s):
            return  # another thread is attaching (inside gRPC whatever this does)
        try:
            session = self._session if self._pid == os.getpid() else None
            if session is not None:
                self._session, self._retry_at = None, 0.0
        finally:
            self._lock.release()
        if session is None:
            return
        logger.debug("kvstore node %s: session %#x ended before a fork (gRPC's fork support is off)",
                     self.target, session.session_id)
        session.retire()
        deadline = time.monotonic() + timeout_s
        for thread in session.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """End the session, if any; the link stays off."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
            if session is not None and self._pid == os.getpid():
                session.retire()


def _redeem(address: str, grant: bytes, deadline: float) -> tuple[tuple[int, int], list[int]]:
    """The handoff, asking for control channels; again without (version 1) if the node predates them (it refuses
    the request before it looks at the grant, so the grant is still good)."""
    channels = channels_wanted()
    try:
        return redeem_grant(address, grant, max(0.1, deadline - time.monotonic()), channels)
    except HandoffRefused as exc:
        if not channels or NOT_A_HANDOFF not in str(exc):
            raise
    return redeem_grant(address, grant, max(0.1, deadline - time.monotonic()))


_LINKS: weakref.WeakSet[SharedMemoryLink] = weakref.WeakSet()
"""This process's links, for the fork hook."""


_GRPC_FORK_SUPPORT = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").lower() in ("1", "true", "yes")
"""Whether gRPC Python's fork support is on (it parks its threads before a fork). No public gRPC call says so
(only the private ``grpc._cython.cygrpc.is_fork_support_enabled()``); gRPC reads its documented switch
``GRPC_ENABLE_FORK_SUPPORT`` (``doc/fork_support.md``) once, when ``grpc`` is imported (just above), and takes
``1``, ``true`` or ``yes`` in any case as on (checked against grpcio 1.85 for each value), so this reads it likewise,
right after that import."""


def _before_fork() -> None:
    """``os.register_at_fork`` hook: with gRPC's fork support off, end this process's sessions first
    (:meth:`SharedMemoryLink.end_for_fork`)."""
    links = list(_LINKS)
    if links and not _GRPC_FORK_SUPPORT:
        for link in links:
            link.end_for_fork()


os.register_at_fork(before=_before_fork)


class _Off(Exception):
    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.permanent = permanent


def _detail(exc: BaseException) -> str:
    """``CODE: details`` of a status, ``Type: message`` of any other error (why a link is off)."""
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
