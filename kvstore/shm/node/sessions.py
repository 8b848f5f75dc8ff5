"""The node's same-host sessions: per client, two segments, a grant to redeem them, and the leases of its reads.

A session belongs to the principal that opened it (its bearer token's, or no one
without authentication) and to the client that holds its ``Attach`` stream; it
ends when that stream does (the client closed it, or died and the kernel closed
its connection). It owns two segments (:mod:`kvstore.shm.segment`), each
written by one side only:

* the **get segment**: the node writes a Get's blocks into a range of it and
  leases that range to the client, which maps the segment read-only. The range
  is not reused until the client releases the lease, the lease expires
  (``lease_s``), or the session ends;
* the **put segment**: the client stages a Put's blocks in it (the client
  chooses the ranges), and the node, which maps it read-only, copies each
  block out and validates its copy before anything is stored.

Memory is bounded three ways. Sessions per tenant (the principal that opened
them) are capped below the node's cap, so one tenant cannot take every session.
Leased bytes count against a per-tenant and a node-wide budget: a Get that would
take either over gets no lease, and the client reads it over gRPC. And pages of
a get segment that no lease holds any more are given back to the kernel
(:meth:`kvstore.shm.segment.Segment.release`) ``release_after_s`` after their
lease ended (released, expired, or its session closed), so a client reading one
batch after another reuses warm pages, while a tenant that fills its segments
and goes idle leaves nothing resident (:meth:`SessionTable.reclaim`).

Everything here runs on the node's event loop and takes its clock from outside,
so the expiry of leases and the reclaiming of pages are tested as logic, with no waiting.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from kvstore.errors import ResourceExhaustedError
from kvstore.shm.allocator import RangeAllocator
from kvstore.shm.segment import Segment
from kvstore.error_codes import FailedPreconditionError, PermissionDeniedError

logger = logging.getLogger(__name__)

GRANT_BYTES = 32
"""Length of a grant, bytes (256 random bits: ``secrets.token_bytes``)."""


class UnknownSessionError(FailedPreconditionError):
    """A call names a session the node does not have (it ended, or the node restarted): the client attaches again."""


@dataclass(slots=True)
class Lease:
    """A Get's blocks held for a client until released or expired: blocks of the shared pool read in place
    (``kvstore.shm.node.pool``), and a range of the session's get segment holding those the node copied there.

    Attributes:
        lease_id: its number, unique on the node.
        offset: start of the range in the get segment, bytes; -1 when the lease holds no range.
        nbytes: length of the range, bytes (0 for none).
        expires_at: when it ends unless released first (the table's clock, seconds).
        nbytes_held: what the lease counts against the leased-bytes budgets: its range as allocated
            (``nbytes`` rounded up to a page) and the pool bytes it holds, bytes.
        range_bytes: the range's size as allocated, bytes (0 for none).
        on_end: called once when the lease ends, however it ends (the node gives back the pool blocks it held).
    """

    lease_id: int
    offset: int
    nbytes: int
    expires_at: float
    nbytes_held: int = 0
    range_bytes: int = 0
    on_end: Callable[[], None] | None = None


@dataclass(slots=True)
class Session:
    """One client's same-host session.

    Attributes:
        session_id: random 63-bit number naming it in calls.
        principal: who opened it (a :class:`kvstore.server.auth.Principal`, or ``None`` without authentication);
            only calls by the same principal may use it.
        get_segment: the segment the node writes Get replies into.
        put_segment: the segment the client stages Put blocks in (mapped read-only here).
        allocator: ranges of the get segment.
        leases: the leases in force, by id.
        grant: the token that redeems the segments once on the handoff socket (``None`` once redeemed or expired).
        grant_expires_at: when the grant lapses (the table's clock, seconds).
        dirty_bytes: offset below which freed ranges of the get segment may still hold pages (see
            :meth:`SessionTable.reclaim`).
    """

    session_id: int
    principal: Hashable | None
    get_segment: Segment
    put_segment: Segment
    allocator: RangeAllocator
    leases: dict[int, Lease] = field(default_factory=dict)
    grant: bytes | None = None
    grant_expires_at: float = 0.0
    closed: bool = False
    dirty_bytes: int = 0  # the get segment's pages below this offset may be resident though no lease holds them


@dataclass(slots=True)
class SessionCounts:
    """Counts of a node's sessions since start (pulled by the server's metrics)."""

    sessions_opened: int = 0
    sessions_refused: int = 0
    grants_redeemed: int = 0
    grants_refused: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_ended_with_session: int = 0
    no_room: int = 0
    tenant_budget_no_room: int = 0
    node_budget_no_room: int = 0
    sessions_refused_per_tenant: int = 0
    released_bytes: int = 0


class SessionTable:
    """Every same-host session of one node, and their leases.

    Args:
        segment_bytes: size of each session's get and put segments, bytes.
        max_sessions: sessions open at once; more are refused.
        lease_s: seconds a lease lasts unless released first.
        grant_s: seconds a grant may be redeemed in.
        clock: the loop's clock, seconds (``loop.time``).
        make_segment: ``(name, nbytes, writable) -> Segment`` (by default ``Segment.create``, the get segment
            read-only to others and, with ``seal_get_segments``, sealed against writes; tests may count them).
        max_sessions_per_tenant: sessions one principal (tenant) may have open at once; ``None``: ``max_sessions``.
        tenant_leased_bytes: bytes of get segments one principal's leases may hold at once; ``None``: no bound.
        max_leased_bytes: bytes of get segments every lease together may hold; ``None``: no bound.
        release_after_s: seconds after a lease ends before the pages it held are given back (:meth:`reclaim`).
        seal_get_segments: seal get segments with ``F_SEAL_FUTURE_WRITE`` (their pages then stay until
            the session closes; ``docs/shared-memory.md``).
        call_at: ``loop.call_at``, to run :meth:`reclaim` when it is due; ``None``: the caller runs it.

    Raises:
        ValueError: on a size, count or duration out of range.
    """

    def __init__(self, *, segment_bytes: int, max_sessions: int, lease_s: float, grant_s: float,
                 clock: Callable[[], float],
                 make_segment: Callable[[str, int, bool], Segment] | None = None,
                 max_sessions_per_tenant: int | None = None, tenant_leased_bytes: int | None = None,
                 max_leased_bytes: int | None = None, release_after_s: float = 1.0,
                 seal_get_segments: bool = False, call_at: Callable[..., Any] | None = None) -> None:
        if segment_bytes <= 0 or max_sessions <= 0 or not lease_s > 0 or not grant_s > 0:
            raise ValueError("segment_bytes, max_sessions, lease_s and grant_s must be > 0")
        if not release_after_s >= 0 or (max_sessions_per_tenant or 1) <= 0:
            raise ValueError("release_after_s must be >= 0 and max_sessions_per_tenant > 0")
        self.segment_bytes = segment_bytes
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant or max_sessions
        self.tenant_leased_bytes = tenant_leased_bytes
        self.max_leased_bytes = max_leased_bytes
        self.release_after_s = release_after_s
        self.lease_s = lease_s
        self.grant_s = grant_s
        self._clock = clock
        self._call_at = call_at
        self._make_segment = make_segment or (lambda name, nbytes, writable: Segment.create(
            name, nbytes, writable=writable, read_only_to_others=writable, seal_writes=seal_get_segments))
        self._sessions: dict[int, Session] = {}
        self._grants: dict[bytes, Session] = {}
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, lease_id, session_id), lazily pruned
        self._next_lease = 1
        self._per_tenant: dict[Hashable | None, int] = {}  # principal -> sessions open
        self._tenant_leased: dict[Hashable | None, int] = {}  # principal -> bytes its leases hold
        self._leased_bytes = 0
        self._dirty: dict[int, float] = {}  # session id -> when its first lease ended since its last reclaim
        self._reclaim_timer: Any = None
        self.counts = SessionCounts()

    # ------------------------------------------------------------------ sessions

    def open(self, principal: Hashable | None) -> Session:
        """A new session of ``principal``, with its two segments and a fresh grant.

        Raises:
            ResourceExhaustedError: if ``max_sessions`` are open.
            SegmentError: if the segments cannot be made.
        """
        if len(self._sessions) >= self.max_sessions:
            self.counts.sessions_refused += 1
            raise ResourceExhaustedError(f"{len(self._sessions)} same-host sessions are open "
                                         f"(shared_memory.max_sessions); use the gRPC data path")
        num_own = self._per_tenant.get(principal, 0)
        if num_own >= self.max_sessions_per_tenant:
            self.counts.sessions_refused += 1
            self.counts.sessions_refused_per_tenant += 1
            raise ResourceExhaustedError(
                f"{_tenant_name(principal)} has {num_own} same-host sessions open, the limit is "
                f"shared_memory.max_sessions_per_tenant={self.max_sessions_per_tenant}; close one, "
                f"or use the gRPC data path")
        session_id = secrets.randbits(63) or 1
        while session_id in self._sessions:
            session_id = secrets.randbits(63) or 1
        get_segment = self._make_segment(f"kvstore-get-{session_id:x}", self.segment_bytes, True)
        try:
            put_segment = self._make_segment(f"kvstore-put-{session_id:x}", self.segment_bytes, False)
        except BaseException:
            get_segment.close()
            raise
        grant = secrets.token_bytes(GRANT_BYTES)
        session = Session(session_id, principal, get_segment, put_segment, RangeAllocator(self.segment_bytes),
                          grant=grant, grant_expires_at=self._clock() + self.grant_s)
        self._sessions[session_id] = session
        self._grants[grant] = session
        self._per_tenant[principal] = num_own + 1
        self.counts.sessions_opened += 1
        return session

    def redeem(self, grant: bytes) -> Session | None:
        """The session a grant opens, once: ``None`` for a grant unknown, used already, or lapsed."""
        session = self._grants.pop(grant, None)
        if session is None or session.closed or self._clock() > session.grant_expires_at:
            self.counts.grants_refused += 1
            if session is not None:
                session.grant = None
            return None
        session.grant = None
        self.counts.grants_redeemed += 1
        return session

    def session(self, session_id: int, principal: Hashable | None) -> Session:
        """The open session ``session_id``, if ``principal`` opened it.

        Raises:
            UnknownSessionError: if there is no such session (it ended, or the node restarted).
            PermissionDeniedError: if another principal opened it.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(f"no same-host session {session_id:#x} on this node (it ended); attach again")
        if session.principal != principal:
            raise PermissionDeniedError(f"same-host session {session_id:#x} belongs to another client")
        return session

    def close(self, session: Session) -> None:
        """End a session: its leases end, its grant lapses, and its segments are unmapped and closed here."""
        if session.closed:
            return
        session.closed = True
        if self._sessions.pop(session.session_id, None) is not None:
            num_own = self._per_tenant.pop(session.principal, 1) - 1
            if num_own:
                self._per_tenant[session.principal] = num_own
        if session.grant is not None:
            self._grants.pop(session.grant, None)
            session.grant = None
        self.counts.leases_ended_with_session += len(session.leases)
        for lease in session.leases.values():
            self._uncharge(session, lease.nbytes_held)
            _run_on_end(lease)
        session.leases.clear()
        self._dirty.pop(session.session_id, None)
        session.get_segment.close()  # its pages go once the client unmaps it too
        session.put_segment.close()

    def close_all(self) -> None:
        """End every session (the node is stopping)."""
        for session in list(self._sessions.values()):
            self.close(session)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    # ------------------------------------------------------------------ leases

    def lease(self, session: Session, nbytes: int, *, pooled_bytes: int = 0,
              on_end: Callable[[], None] | None = None) -> Lease | None:
        """A lease on a new range of ``nbytes`` of the session's get segment and on ``pooled_bytes`` of pool
        blocks read in place; ``None`` when either budget, or the segment, has no room now (or ever: ``nbytes``
        is more than the segment holds): the client uses gRPC, and ``on_end`` is not called.

        Args:
            session: the client's session.
            nbytes: bytes of the get segment to hold (0: no range).
            pooled_bytes: bytes of pool blocks the lease holds (counted against the budgets too).
            on_end: called once when the lease ends (released, expired, or its session closed).
        """
        range_bytes = session.allocator.aligned(nbytes) if nbytes else 0
        held = range_bytes + pooled_bytes
        tenant = session.principal
        if self.tenant_leased_bytes is not None and self._tenant_leased.get(tenant, 0) + held > self.tenant_leased_bytes:
            self.counts.no_room += 1
            self.counts.tenant_budget_no_room += 1
            return None
        if self.max_leased_bytes is not None and self._leased_bytes + held > self.max_leased_bytes:
            self.counts.no_room += 1
            self.counts.node_budget_no_room += 1
            return None
        offset = session.allocator.allocate(nbytes) if nbytes else -1
        if offset is None:
            self.counts.no_room += 1
            return None
        lease = Lease(self._next_lease, offset, nbytes, self._clock() + self.lease_s, held, range_bytes, on_end)
        self._next_lease += 1
        session.leases[lease.lease_id] = lease
        self._tenant_leased[tenant] = self._tenant_leased.get(tenant, 0) + held
        self._leased_bytes += held
        if range_bytes:
            session.dirty_bytes = max(session.dirty_bytes, offset + range_bytes)
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id, session.session_id))
        self.counts.leases_granted += 1
        return lease

    def release(self, session: Session, lease_ids: list[int] | tuple[int, ...]) -> int:
        """End the session's leases ``lease_ids`` (ids it does not hold are ignored); returns how many ended."""
        num_released = 0
        for lease_id in lease_ids:
            lease = session.leases.pop(lease_id, None)
            if lease is not None:
                self._end(session, lease)
                num_released += 1
        self.counts.leases_released += num_released
        return num_released

    def _end(self, session: Session, lease: Lease) -> None:
        """Free a lease's range, uncount its bytes, give back what it held, and have the range's pages given
        back in ``release_after_s``."""
        self._uncharge(session, lease.nbytes_held)
        _run_on_end(lease)
        if lease.range_bytes:
            session.allocator.free(lease.offset)
            if session.session_id not in self._dirty:
                self._dirty[session.session_id] = self._clock()
                self._schedule_reclaim()

    def _uncharge(self, session: Session, held: int) -> None:
        left = self._tenant_leased.get(session.principal, 0) - held
        if left > 0:
            self._tenant_leased[session.principal] = left
        else:
            self._tenant_leased.pop(session.principal, None)
        self._leased_bytes -= held

    def _schedule_reclaim(self) -> None:
        if self._call_at is None or self._reclaim_timer is not None or not self._dirty:
            return
        due = min(self._dirty.values()) + self.release_after_s
        self._reclaim_timer = self._call_at(due, self._run_reclaim)

    def _run_reclaim(self) -> None:
        self._reclaim_timer = None
        self.reclaim()
        self._schedule_reclaim()

    def reclaim(self) -> int:
        """Give back the pages of every free range of a get segment whose lease ended ``release_after_s`` ago.

        Per session, every free range below its :attr:`Session.dirty_bytes` is
        given back at once (one ``madvise`` each; ranges already given back cost
        nothing), and ``dirty_bytes`` falls to the end of its highest live
        lease. A sealed segment gives nothing back (its pages go with the session).

        Returns:
            Bytes of ranges given back (their pages, where written, no longer take memory).
        """
        now = self._clock()
        released = 0
        for session_id, since in list(self._dirty.items()):
            if since + self.release_after_s > now:
                continue
            del self._dirty[session_id]
            session = self._sessions.get(session_id)
            if session is None:
                continue
            segment, limit = session.get_segment, session.dirty_bytes
            for offset, size in session.allocator.free_ranges():
                if offset >= limit:
                    break
                size = min(size, limit - offset)
                if segment.release(offset, size):
                    released += size
            session.dirty_bytes = max((lease.offset + lease.range_bytes for lease in session.leases.values()
                                       if lease.range_bytes), default=0)
        self.counts.released_bytes += released
        return released

    def cancel_reclaim(self) -> None:
        """Stop the reclaim timer (the node is stopping)."""
        if self._reclaim_timer is not None:
            self._reclaim_timer.cancel()
            self._reclaim_timer = None

    def expire(self) -> int:
        """End every lease whose time is up (by the clock); returns how many ended."""
        now = self._clock()
        num_expired = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id, session_id = heapq.heappop(self._expiry)
            session = self._sessions.get(session_id)
            lease = session.leases.pop(lease_id, None) if session is not None else None
            if session is not None and lease is not None:
                self._end(session, lease)
                num_expired += 1
        if num_expired:
            logger.debug("%d same-host leases expired", num_expired)
        self.counts.leases_expired += num_expired
        return num_expired

    def next_expiry(self) -> float | None:
        """When the earliest lease in force ends (the clock's time), ``None`` when none is; prunes ended ones."""
        while self._expiry:
            expires_at, lease_id, session_id = self._expiry[0]
            session = self._sessions.get(session_id)
            if session is not None and lease_id in session.leases:
                return expires_at
            heapq.heappop(self._expiry)
        return None

    def leased_bytes(self) -> int:
        """Bytes of get segments under leases, over every session (each range as allocated)."""
        return self._leased_bytes

    def leased_bytes_of(self, principal: Hashable | None) -> int:
        """Bytes of get segments under the leases of ``principal``'s sessions."""
        return self._tenant_leased.get(principal, 0)

    def resident_bytes(self) -> int:
        """Bytes of memory the get segments' pages take now (``st_blocks``; what the node wrote and has not given back)."""
        return sum(session.get_segment.resident_bytes() for session in list(self._sessions.values()))

    def sessions_of(self, principal: Hashable | None) -> int:
        """Sessions ``principal`` has open."""
        return self._per_tenant.get(principal, 0)

    def num_leases(self) -> int:
        """Leases in force, over every session."""
        return sum(len(session.leases) for session in list(self._sessions.values()))

    def counters(self) -> dict[str, int]:
        """The counts, the sessions open and the leases in force, by name (``shm_`` prefixed in stats).

        Safe from another thread (the metrics collector's): the sums run over a snapshot of the sessions
        (``list`` of a dict's values is one step under the GIL), so a session opened or closed on the
        loop meanwhile cannot end the iteration with "dictionary changed size".
        """
        return {**dataclasses.asdict(self.counts), "sessions": len(self._sessions), "leases": self.num_leases(),
                "leased_bytes": self.leased_bytes(), "resident_bytes": self.resident_bytes()}


def _run_on_end(lease: Lease) -> None:
    """Run a lease's ``on_end`` once; an error there is logged, never raised into the table's bookkeeping."""
    on_end, lease.on_end = lease.on_end, None
    if on_end is not None:
        try:
            on_end()
        except Exception:  # noqa: BLE001 - a release that fails must not stop the others
            logger.exception("ending same-host lease %d failed", lease.lease_id)


def session_budgets(config: Any) -> dict[str, Any]:
    """The :class:`SessionTable` arguments of a ``SharedMemoryConfig``'s budgets (0 there is ``None``, no bound)."""
    return {"max_sessions_per_tenant": config.max_sessions_per_tenant,
            "tenant_leased_bytes": config.tenant_leased_bytes or None,
            "max_leased_bytes": config.max_leased_bytes or None,
            "release_after_s": config.release_after_s, "seal_get_segments": config.seal_get_segments}


def _tenant_name(principal: Hashable | None) -> str:
    """How an error names a session's owner: its token's name, or the anonymous client of a node without tokens."""
    name = getattr(principal, "name", None)
    return f"token {name!r}" if name is not None else "the anonymous tenant (authentication is off)"
