"""Pure-logic tests of the miss causes: the bounded history of removals, the classification, the counts."""

from __future__ import annotations

import pytest

from kvstore.store.misses import (
    AFTER_MISS,
    CAUSES,
    DELETED,
    EVICTED,
    NEVER_STORED,
    OTHER_NAMESPACE,
    REUSE_GAP_BUCKETS_S,
    TIER_UNAVAILABLE,
    MissCounts,
    MissHistory,
    Removal,
    classify,
)


def test_the_history_remembers_the_last_removals_and_forgets_the_oldest_generation_whole() -> None:
    history: MissHistory[int] = MissHistory(16)  # 8 generations of 2
    for key in range(40):
        history.record(key, EVICTED, 100 + key, level=1, priority=35)
    assert 14 <= len(history) <= 16
    assert history.get(5) is None  # long gone
    assert history.get(39) == Removal(EVICTED, 139, 1, 35, False)
    history.record(30, DELETED, 500)  # recorded again: the newer record counts, and survives its old generation
    for key in range(100, 112):
        history.record(key, EVICTED, 600)
    assert history.get(30) == Removal(DELETED, 500, 0, 0, False)
    assert 130 <= history.horizon_s <= 500  # the oldest generation kept began there
    with pytest.raises(ValueError):
        MissHistory(-1)


def test_a_history_of_nothing_names_every_miss_never_stored() -> None:
    history: MissHistory[int] = MissHistory(0)
    history.record(1, EVICTED, 1.0)
    assert len(history) == 0 and history.get_many([1]) == [None]


def test_record_many_is_record_of_each() -> None:
    one: MissHistory[int] = MissHistory(100)
    many: MissHistory[int] = MissHistory(100)
    for key, priority in zip(range(30), range(30)):
        one.record(key, EVICTED, 7.0, level=2, priority=priority, shared=True)
    many.record_many(list(range(30)), EVICTED, 7.0, level=2, priorities=list(range(30)), shared=True)
    assert one.get_many(list(range(30))) == many.get_many(list(range(30)))


def test_each_missed_block_gets_one_cause() -> None:
    history: MissHistory[str] = MissHistory(10)
    history.record("evicted", EVICTED, 1.0)
    history.record("shared", EVICTED, 1.0, shared=True)
    keys = ["new", "evicted", "resident", "shared"]
    removals = history.get_many(keys)
    resident = [False, False, True, False]
    assert classify(resident, removals) == [NEVER_STORED, EVICTED, AFTER_MISS, EVICTED]
    assert classify(resident, removals, namespace_cause=OTHER_NAMESPACE, shared_down=True) == [
        OTHER_NAMESPACE, EVICTED, AFTER_MISS, TIER_UNAVAILABLE]
    assert classify([False] * 3, [None] * 3) == [NEVER_STORED] * 3  # the common case


def test_counts_sum_to_the_misses_and_histogram_the_reuse_gaps() -> None:
    history: MissHistory[str] = MissHistory(10)
    history.record("a", EVICTED, 100.0)
    history.record("b", DELETED, 100.0)
    counts = MissCounts()
    keys = ["a", "b", "c"]
    removals = history.get_many(keys)
    counts.count(classify([False] * 3, removals), removals, 103.0)
    assert set(counts.by_cause) == set(CAUSES) and counts.total == 3
    assert counts.by_cause[EVICTED] == counts.by_cause[DELETED] == counts.by_cause[NEVER_STORED] == 1
    assert sum(counts.reuse_gap_counts) == 1 and counts.reuse_gap_counts[1] == 1  # 3 s: in the (1, 5] bucket
    assert counts.reuse_gap_sum_s == 3.0 and len(counts.reuse_gap_counts) == len(REUSE_GAP_BUCKETS_S) + 1
    counts.add_gaps([1e9])
    assert counts.reuse_gap_counts[-1] == 1  # +Inf


def test_one_removal_for_many_blocks_counts_as_each_block_would() -> None:
    history: MissHistory[int] = MissHistory(100)
    history.record_many(list(range(10)), EVICTED, 100.0)
    removals = history.get_many(list(range(10)))
    one, each = MissCounts(), MissCounts()
    one.count_removal(removals[0], 10, 107.0)  # type: ignore[arg-type]
    each.count(classify(None, removals), removals, 107.0)
    assert one == each and one.reuse_gap_counts[2] == 10
    history.forget_many(range(5))
    history.forget(7)
    assert history.get_many([0, 5, 7]) == [None, removals[5], None]
