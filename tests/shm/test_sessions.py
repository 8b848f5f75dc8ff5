"""The node's session table as logic, on a clock of the test's: grants, principals, leases, expiry, the end."""

from __future__ import annotations

import pytest

from kvstore.errors import ResourceExhaustedError
from kvstore.shm.segment import Segment
from kvstore.shm.node.sessions import SessionTable, UnknownSessionError
from kvstore.error_codes import PermissionDeniedError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Segments:
    """Counts the segments a table makes, and which it has closed."""

    def __init__(self) -> None:
        self.made: list[Segment] = []

    def __call__(self, name: str, nbytes: int, writable: bool) -> Segment:
        segment = Segment.create(name, nbytes, writable=writable)
        self.made.append(segment)
        return segment

    @property
    def open(self) -> int:
        return sum(not s.closed for s in self.made)


def table(clock: Clock, segments: Segments, **kwargs: object) -> SessionTable:
    settings = {"segment_bytes": 64 * 4096, "max_sessions": 4, "lease_s": 10.0, "grant_s": 5.0, **kwargs}
    return SessionTable(clock=clock, make_segment=segments, **settings)  # type: ignore[arg-type]


def test_a_grant_opens_its_session_once_and_only_in_time() -> None:
    clock, segments = Clock(), Segments()
    sessions = table(clock, segments)
    a, b = sessions.open("a"), sessions.open("b")
    assert sessions.redeem(a.grant) is a  # type: ignore[arg-type]
    grant_a = b"x" * 32
    assert sessions.redeem(grant_a) is None
    used = a.grant
    assert used is None  # redeemed: gone
    grant_b = b.grant
    clock.now += 5.01
    assert sessions.redeem(grant_b) is None  # type: ignore[arg-type]  # lapsed
    assert sessions.counts.grants_redeemed == 1 and sessions.counts.grants_refused == 2


def test_only_the_principal_that_opened_a_session_may_use_it() -> None:
    sessions = table(Clock(), Segments())
    session = sessions.open("tenant-a")
    assert sessions.session(session.session_id, "tenant-a") is session
    with pytest.raises(PermissionDeniedError):
        sessions.session(session.session_id, "tenant-b")
    with pytest.raises(UnknownSessionError):
        sessions.session(session.session_id ^ 1, "tenant-a")


def test_sessions_beyond_the_limit_are_refused() -> None:
    segments = Segments()
    sessions = table(Clock(), segments, max_sessions=2)
    sessions.open(None), sessions.open(None)
    with pytest.raises(ResourceExhaustedError):
        sessions.open(None)
    assert len(segments.made) == 4 and sessions.counts.sessions_refused == 1


def test_leases_hold_their_ranges_until_released_or_expired() -> None:
    clock = Clock()
    sessions = table(clock, Segments())
    session = sessions.open(None)
    first = sessions.lease(session, 100 * 1024)
    second = sessions.lease(session, 100 * 1024)
    assert first is not None and second is not None
    assert first.offset + first.nbytes <= second.offset  # never the same bytes
    assert sessions.lease(session, 100 * 1024) is None  # the segment is full: no room (the client uses gRPC)
    assert sessions.counts.no_room == 1
    assert sessions.release(session, [first.lease_id, 12345]) == 1  # an id it does not hold is ignored
    clock.now += 1.0
    third = sessions.lease(session, 100 * 1024)
    assert third is not None and third.offset == first.offset
    clock.now += 9.0
    assert sessions.next_expiry() == second.expires_at
    assert sessions.expire() == 1  # second is due; third was leased later
    assert session.leases.keys() == {third.lease_id}
    clock.now += 1.0
    assert sessions.expire() == 1 and sessions.next_expiry() is None
    assert session.allocator.used_bytes == 0


def test_a_lease_larger_than_the_segment_is_no_room() -> None:
    sessions = table(Clock(), Segments())
    session = sessions.open(None)
    assert sessions.lease(session, 64 * 4096 + 1) is None


def test_another_sessions_lease_ids_release_nothing() -> None:
    sessions = table(Clock(), Segments())
    a, b = sessions.open(None), sessions.open(None)
    lease = sessions.lease(a, 4096)
    assert lease is not None
    assert sessions.release(b, [lease.lease_id]) == 0
    assert lease.lease_id in a.leases


def test_closing_a_session_ends_its_leases_grant_and_segments() -> None:
    clock, segments = Clock(), Segments()
    sessions = table(clock, segments)
    session = sessions.open(None)
    grant = session.grant
    sessions.lease(session, 4096), sessions.lease(session, 4096)
    assert segments.open == 2 and sessions.num_leases() == 2
    sessions.close(session)
    assert segments.open == 0 and sessions.num_leases() == 0 and len(sessions) == 0
    assert sessions.counts.leases_ended_with_session == 2
    assert sessions.redeem(grant) is None  # type: ignore[arg-type]
    with pytest.raises(UnknownSessionError):
        sessions.session(session.session_id, None)
    clock.now += 100
    assert sessions.expire() == 0 and sessions.next_expiry() is None


def test_close_all_closes_every_segment() -> None:
    segments = Segments()
    sessions = table(Clock(), segments)
    for _ in range(3):
        sessions.open(None)
    sessions.close_all()
    assert len(segments.made) == 6 and segments.open == 0


def test_counters_survive_a_session_opened_while_they_sum() -> None:
    """The metrics thread reads ``counters()`` while the loop opens and closes sessions.

    A segment's ``resident_bytes`` (an ``fstat``) lets another thread run; here it opens and closes sessions
    at exactly that point, which made the sum's iteration over the live dict fail with "dictionary changed size".
    """
    sessions = table(Clock(), Segments())
    first = sessions.open("a")
    busy: list[int] = []

    def resident_bytes_while_the_loop_acts() -> int:
        if not busy:
            busy.append(1)
            sessions.close(sessions.open("b"))
            sessions.open("c")
        return 0

    first.get_segment.resident_bytes = resident_bytes_while_the_loop_acts  # type: ignore[method-assign]
    counters = sessions.counters()
    assert busy and counters["resident_bytes"] >= 0 and sessions.counters()["sessions"] == 2
