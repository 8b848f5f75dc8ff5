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

Everything here runs on the node's event loop and takes its clock from outside,
so the expiry of leases is tested as logic, with no waiting.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import secrets
from dataclasses import dataclass, field
from typing import Callable, Hashable

from kvstore.errors import ResourceExhaustedError
from kvstore.shm.allocator import RangeAllocator
from kvstore.shm.segment import Segment
from kvstore.status import FailedPreconditionError, PermissionDeniedError

logger = logging.getLogger(__name__)

GRANT_BYTES = 32
"""Length of a grant, bytes (256 random bits: ``secrets.token_bytes``)."""


class UnknownSessionError(FailedPreconditionError):
    """A call names a session the node does not have (it ended, or the node restarted): the client attaches again."""


@dataclass(slots=True)
class Lease:
    """A range of a session's get segment that holds a Get's blocks until released or expired.

    Attributes:
        lease_id: its number, unique on the node.
        offset: start of the range in the get segment, bytes.
        nbytes: length of the range, bytes.
        expires_at: when it ends unless released first (the table's clock, seconds).
    """

    lease_id: int
    offset: int
    nbytes: int
    expires_at: float


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


class SessionTable:
    """Every same-host session of one node, and their leases.

    Args:
        segment_bytes: size of each session's get and put segments, bytes.
        max_sessions: sessions open at once; more are refused.
        lease_s: seconds a lease lasts unless released first.
        grant_s: seconds a grant may be redeemed in.
        clock: the loop's clock, seconds (``loop.time``).
        make_segment: ``(name, nbytes, writable) -> Segment`` (``Segment.create``; tests may count them).

    Raises:
        ValueError: on a size, count or duration out of range.
    """

    def __init__(self, *, segment_bytes: int, max_sessions: int, lease_s: float, grant_s: float,
                 clock: Callable[[], float],
                 make_segment: Callable[[str, int, bool], Segment] | None = None) -> None:
        if segment_bytes <= 0 or max_sessions <= 0 or not lease_s > 0 or not grant_s > 0:
            raise ValueError("segment_bytes, max_sessions, lease_s and grant_s must be > 0")
        self.segment_bytes = segment_bytes
        self.max_sessions = max_sessions
        self.lease_s = lease_s
        self.grant_s = grant_s
        self._clock = clock
        self._make_segment = make_segment or (lambda name, nbytes, writable: Segment.create(
            name, nbytes, writable=writable))
        self._sessions: dict[int, Session] = {}
        self._grants: dict[bytes, Session] = {}
        self._expiry: list[tuple[float, int, int]] = []  # (expires_at, lease_id, session_id), lazily pruned
        self._next_lease = 1
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
        self._sessions.pop(session.session_id, None)
        if session.grant is not None:
            self._grants.pop(session.grant, None)
            session.grant = None
        self.counts.leases_ended_with_session += len(session.leases)
        session.leases.clear()
        session.get_segment.close()
        session.put_segment.close()

    def close_all(self) -> None:
        """End every session (the node is stopping)."""
        for session in list(self._sessions.values()):
            self.close(session)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._sessions.values()))

    # ------------------------------------------------------------------ leases

    def lease(self, session: Session, nbytes: int) -> Lease | None:
        """A lease on a new range of ``nbytes`` of the session's get segment; ``None`` when it has no room now
        (its other leases hold it), or ever (``nbytes`` is more than the segment holds): the client uses gRPC."""
        offset = session.allocator.allocate(nbytes)
        if offset is None:
            self.counts.no_room += 1
            return None
        lease = Lease(self._next_lease, offset, nbytes, self._clock() + self.lease_s)
        self._next_lease += 1
        session.leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id, session.session_id))
        self.counts.leases_granted += 1
        return lease

    def release(self, session: Session, lease_ids: list[int] | tuple[int, ...]) -> int:
        """End the session's leases ``lease_ids`` (ids it does not hold are ignored); returns how many ended."""
        num_released = 0
        for lease_id in lease_ids:
            lease = session.leases.pop(lease_id, None)
            if lease is not None:
                session.allocator.free(lease.offset)
                num_released += 1
        self.counts.leases_released += num_released
        return num_released

    def expire(self) -> int:
        """End every lease whose time is up (by the clock); returns how many ended."""
        now = self._clock()
        num_expired = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id, session_id = heapq.heappop(self._expiry)
            session = self._sessions.get(session_id)
            lease = session.leases.pop(lease_id, None) if session is not None else None
            if lease is not None:
                session.allocator.free(lease.offset)  # type: ignore[union-attr]
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
        """Bytes of get segments under leases, over every session."""
        return sum(session.allocator.used_bytes for session in self._sessions.values())

    def num_leases(self) -> int:
        """Leases in force, over every session."""
        return sum(len(session.leases) for session in self._sessions.values())

    def counters(self) -> dict[str, int]:
        """The counts, the sessions open and the leases in force, by name (``shm_`` prefixed in stats)."""
        return {**dataclasses.asdict(self.counts), "sessions": len(self._sessions), "leases": self.num_leases(),
                "leased_bytes": self.leased_bytes()}
