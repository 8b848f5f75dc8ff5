"""Pure-logic tests of the eviction policies: no I/O, no tiers."""

from __future__ import annotations

import pytest

from kvstore.policy import DEFAULT_PRIORITY, LRUPolicy, PriorityLRUPolicy


def test_lru_order_within_a_priority() -> None:
    policy = PriorityLRUPolicy()
    for key in "abcd":
        policy.insert(key, 10)
    policy.touch("a")
    assert policy.victims(10) == ["b"]
    assert policy.victims(25) == ["b", "c", "d"]
    assert policy.nbytes == 40 and len(policy) == 4


def test_lowest_priority_goes_first() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("important", 10, priority=90)
    policy.insert("normal", 10)
    policy.insert("scratch", 10, priority=0)
    assert policy.victims(30) == ["scratch", "normal", "important"]


def test_pinned_blocks_are_never_victims() -> None:
    policy = PriorityLRUPolicy()
    for key in "abc":
        policy.insert(key, 10)
    policy.pin("a")
    policy.pin("a")
    assert policy.victims(100) == ["b", "c"]
    policy.unpin("a")
    assert "a" not in policy.victims(100)
    policy.unpin("a")
    assert policy.victims(100) == ["a", "b", "c"]


def test_tail_before_head_when_recorded_tail_first() -> None:
    policy = PriorityLRUPolicy()
    chain = ["h0", "h1", "h2"]
    for key in reversed(chain):
        policy.insert(key, 1)
    assert policy.victims(1) == ["h2"]
    for key in reversed(chain):  # a hit on the chain touches it tail first too
        policy.touch(key)
    assert policy.victims(3) == ["h2", "h1", "h0"]


def test_retention_expires_to_default_priority() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("kept", 10, priority=80, expires_at=100.0)
    policy.insert("normal", 10)
    assert policy.victims(10, now=50.0) == ["normal"]
    assert policy.priority_of("kept") == 80
    assert policy.victims(10, now=100.0) == ["kept"]  # reverted, and the least recent at 35
    assert policy.priority_of("kept") == DEFAULT_PRIORITY
    assert policy.victims(20, now=100.0) == ["kept", "normal"]


def test_low_priority_retention_expires_upward() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("scratch", 10, priority=5, expires_at=10.0)
    policy.insert("normal", 10)
    policy.insert("low", 10, priority=20)
    assert policy.victims(10, now=0.0) == ["scratch"]
    assert policy.victims(10, now=11.0) == ["low"]  # scratch is back at 35, above 20
    assert policy.priority_of("scratch") == DEFAULT_PRIORITY


def test_remove_and_reinsert_ignores_stale_expiry() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("a", 10, priority=90, expires_at=5.0)
    assert policy.remove("a") == 10 and policy.remove("a") == 0
    policy.insert("a", 10, priority=90, expires_at=50.0)
    policy.expire(10.0)
    assert policy.priority_of("a") == 90
    assert policy.nbytes == 10


def test_victims_returns_less_only_when_pinned() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("a", 10)
    policy.pin("a")
    assert policy.victims(5) == []
    assert policy.victims(0) == []


def test_invalid_input() -> None:
    policy = PriorityLRUPolicy()
    with pytest.raises(ValueError):
        policy.insert("a", 1, priority=101)
    with pytest.raises(ValueError):
        policy.insert("a", -1)
    policy.insert("a", 1)
    with pytest.raises(ValueError):
        policy.insert("a", 1)
    with pytest.raises(KeyError):
        policy.pin("missing")
    with pytest.raises(KeyError):
        policy.touch("missing")


def test_plain_lru_ignores_priority() -> None:
    policy = LRUPolicy()
    policy.insert("important", 1, priority=100)
    policy.insert("b", 1, priority=0)
    assert policy.victims(1) == ["important"]


def test_many_operations_keep_bytes_consistent() -> None:
    policy = PriorityLRUPolicy()
    for i in range(1000):
        policy.insert(i, i % 7 + 1, priority=i % 101, expires_at=float(i % 13))
    for i in range(0, 1000, 3):
        policy.remove(i)
    total = sum(i % 7 + 1 for i in range(1000) if i % 3)
    assert policy.nbytes == total
    victims = policy.victims(total, now=20.0)
    assert len(victims) == len(policy)


def test_a_lease_outlives_a_remove_and_releases_only_itself() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("a", 10)
    policy.pin("a")  # an old reader
    assert policy.remove("a") == 10
    policy.insert("a", 10)  # stored again while the old reader still reads
    policy.pin("a")  # a new reader
    policy.unpin("a")  # the old reader ends: the new reader's lease must hold
    assert policy.is_pinned("a") and policy.victims(10) == []
    policy.unpin("a")
    assert not policy.is_pinned("a") and policy.victims(10) == ["a"]
