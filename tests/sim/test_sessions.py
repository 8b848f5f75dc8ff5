"""Pure-logic tests of the session tracker (``kvstore.policy.sessions``): dead chains, gaps, turnover, admission."""

from __future__ import annotations

from kvstore.policy.sessions import MIN_GAP_SAMPLES, SessionTracker, common_prefix


def _tracker(capacity: int = 100) -> tuple[SessionTracker[int], list[list[int]]]:
    cooled: list[list[int]] = []
    return SessionTracker(capacity, lambda chain: cooled.append(list(chain))), cooled


def test_a_compacted_session_leaves_its_old_tail_dead() -> None:
    tracker, cooled = _tracker()
    tracker.request("s", [1, 2, 3, 4], 1)
    tracker.request("s", [1, 2, 3, 4, 5], 2)  # extends its chain: nothing dead
    assert cooled == []
    tracker.request("s", [1, 2, 9], 3)  # compacted after the shared prefix
    assert cooled == [[3, 4, 5]] and tracker.cooled_chains == 1
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_a_parent_back_after_its_subagents_ends_their_chains_past_the_fork() -> None:
    tracker, cooled = _tracker()
    tracker.request("parent", [1, 2, 3], 1)
    tracker.request("parent.1", [1, 2, 3, 10, 11], 2)  # forks the parent's last chain at 3 blocks
    tracker.request("parent.2", [1, 2, 3, 20], 3)
    tracker.request("parent.1", [1, 2, 3, 10, 11, 12], 4)
    tracker.request("other", [1, 2, 50], 5)  # shares only blocks the parent's chain does not end at: no fork
    assert cooled == []
    tracker.request("parent", [1, 2, 3, 4], 6)  # the parent resumes: its subagents are done
    assert sorted(cooled) == [[10, 11, 12], [20]]


def test_admission_bounds_a_put_only_when_the_tiers_turn_over_faster_than_sessions_come_back() -> None:
    tracker, _ = _tracker(capacity=100)
    assert tracker.admissible(1) is None  # no gaps known yet
    for n in range(MIN_GAP_SAMPLES + 1):
        tracker.request("s", [n + 1], 10 * n)  # every session back after 10 lookups
    assert tracker.median_gap == 10
    lookup = 10 * MIN_GAP_SAMPLES
    tracker.placed(lookup, 100)  # a capacity placed...
    tracker.placed(lookup + 2, 100)  # ...and another 2 lookups later: the tiers turn over in 2
    assert tracker.turnover(lookup + 2) == 2
    assert tracker.admissible(lookup + 2) == 100 * 2 // 10  # a fifth of the capacity survives until they are back
    tracker.placed(lookup + 40, 100)
    assert tracker.turnover(lookup + 40) == 38 and tracker.admissible(lookup + 40) is None  # slow: no bound


def test_sessions_are_bounded() -> None:
    import kvstore.policy.sessions as sessions

    tracker, _ = _tracker()
    limit = sessions.MAX_SESSIONS
    try:
        sessions.MAX_SESSIONS = 3
        for n in range(10):
            tracker.request(f"s{n}", [n], n)
        assert len(tracker) == 3
    finally:
        sessions.MAX_SESSIONS = limit
