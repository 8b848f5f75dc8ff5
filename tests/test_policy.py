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


def test_held_blocks_are_never_victims() -> None:
    policy = PriorityLRUPolicy()
    for key in "abc":
        policy.insert(key, 10)
    policy.hold("a")
    assert policy.victims(100) == ["b", "c"]
    assert policy.victims(100) == ["b", "c"]  # "a" left the order when first met: not met again
    assert "a" in policy and policy.contains_many(["a", "z"]) == [True, False]
    assert policy.nbytes == 30 and len(policy) == 3 and policy.size_of("a") == 10
    with pytest.raises(KeyError):
        policy.hold("a")  # the index holds a key once; it counts the references
    policy.release("a")
    assert policy.victims(100) == ["a", "b", "c"]  # back at the front it was taken from
    policy.release("a")  # not held: nothing
    assert policy.victims(100) == ["a", "b", "c"]


def test_a_held_block_touched_and_removed() -> None:
    policy = PriorityLRUPolicy()
    for key in "abcd":
        policy.insert(key, 10)
    policy.hold("a")
    policy.hold("b")
    assert policy.victims(10) == ["c"]  # both taken out of the order
    policy.touch_many(["a", "d"])  # a touch puts a held key where it puts any key; the others move as ever
    assert list(policy) == ["c", "d", "a", "b"]  # "b" is out of the order: listed last
    assert policy.remove_many(["b"]) == 10 and "b" not in policy and policy.nbytes == 30
    policy.release("b")  # forgotten with its hold: it does not come back
    policy.release("a")  # still where the touch put it
    assert list(policy) == ["c", "d", "a"] and policy.victims(100) == ["c", "d", "a"]


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


def test_victims_returns_less_only_when_held() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("a", 10)
    policy.hold("a")
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
        policy.hold("missing")
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


def test_a_retention_ending_while_held_reverts_as_ever() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("kept", 10, priority=80, expires_at=5.0)
    policy.insert("normal", 10)
    policy.hold("kept")
    assert policy.victims(20, now=6.0) == ["normal"]
    assert policy.priority_of("kept") == DEFAULT_PRIORITY and policy.is_held("kept")
    policy.release("kept")
    assert policy.victims(20, now=6.0) == ["kept", "normal"]  # reverted as the least recent, as if never held


# ---------------------------------------------------------------- the segmented and adaptive policies

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from kvstore.policy import (  # noqa: E402
    POLICY_NAMES,
    AdaptivePolicy,
    SegmentedLRUPolicy,
    make_policy,
    resolve_policy_name,
)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_honors_priorities_and_holds(name: str) -> None:
    """Client priorities and retention sit on top of every ordering, as TensorRT-LLM's retention API."""
    policy = make_policy(name, capacity_bytes=100)
    policy.insert("important", 10, priority=90)
    policy.insert("normal", 10)
    policy.insert("scratch", 10, priority=0)
    policy.insert("kept", 10, priority=80, expires_at=5.0)
    policy.touch("normal")
    assert policy.victims(40) == ["scratch", "normal", "kept", "important"]
    assert policy.victims(40, now=6.0) == ["scratch", "kept", "normal", "important"]  # retention ended
    assert policy.priority_of("kept") == DEFAULT_PRIORITY
    policy.hold("scratch")
    assert "scratch" not in policy.victims(40)
    assert policy.nbytes == 40 and len(policy) == 4


def test_segmented_lru_protects_reused_blocks() -> None:
    policy = SegmentedLRUPolicy(capacity_bytes=8)  # protected: at most 2 bytes
    for key in "abcdef":
        policy.insert(key, 1)
    policy.touch("a")
    policy.touch("b")
    policy.touch("c")  # a falls back to probation's most recent end
    assert list(policy) == ["d", "e", "f", "a", "b", "c"]
    assert policy.victims(3) == ["d", "e", "f"]  # the new blocks before any reused one
    assert policy.size_of("c") == 1 and "c" in policy and policy.contains_many(["c", "z"]) == [True, False]
    assert policy.remove("c") == 1 and "c" not in policy and policy.nbytes == 5


def test_adaptive_starts_as_lru_and_moves_to_segmented_lru_when_its_shadow_wins() -> None:
    policy = AdaptivePolicy(capacity_bytes=10)
    assert policy.mode == "lru"
    hot = [f"hot{i}" for i in range(2)]
    for key in hot:
        policy.insert(key, 1)
        policy.touch(key)  # used twice: protected in the shadow
    scan = iter(range(10**6))
    for _ in range(60):  # two hot blocks reused between scans of new ones: LRU loses them, SLRU keeps them
        for _ in range(9):
            victims = policy.victims(policy.nbytes + 1 - 10)
            policy.remove_many(victims)
            policy.insert(f"new{next(scan)}", 1)
        for key in hot:
            if key in policy:
                policy.touch(key)
            else:
                policy.remove_many(policy.victims(policy.nbytes + 1 - 10))
                policy.insert(key, 1)
    assert policy.mode == "slru" and policy.switches >= 1


def _random_ops(policy_name: str, batched: bool, seed: int) -> list[object]:
    rng = random.Random(seed)
    policy = make_policy(policy_name, capacity_bytes=40)
    trace: list[object] = []
    for step in range(3000):
        chain = [f"k{rng.randrange(120)}" for _ in range(rng.randint(1, 6))]
        chain = list(dict.fromkeys(chain))
        present = [k for k in chain if k in policy]
        missing = [k for k in chain if k not in policy]
        if batched:
            policy.touch_many(present)
        else:
            for key in reversed(present):
                policy.touch(key)
        need = policy.nbytes + len(missing) - 40
        if need > 0:
            victims = policy.victims(need)
            trace.append(tuple(victims))
            if batched:
                policy.remove_many(victims)
            else:
                for key in victims:
                    policy.remove(key)
        if batched:
            policy.insert_many(missing, 1)
        else:
            for key in reversed(missing):
                policy.insert(key, 1)
        if step % 500 == 0:
            trace.append(tuple(policy))
    trace.append((policy.nbytes, len(policy), getattr(policy, "switches", 0)))
    return trace


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_batch_calls_are_the_same_as_one_call_per_key(name: str) -> None:
    """The simulator's batch calls and the store's single calls leave the same state and name the same victims."""
    assert _random_ops(name, True, 3) == _random_ops(name, False, 3)


def test_policy_names() -> None:
    assert resolve_policy_name("default") == "adaptive"
    assert isinstance(make_policy("default", capacity_bytes=1), AdaptivePolicy)
    assert type(make_policy("lru")) is PriorityLRUPolicy
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="already tracked"):
        make_policy("adaptive", capacity_bytes=4).insert_many(["a", "a"], 1)


_EXPIRY_ORDER = """
import json
from kvstore.policy import make_policy
out = []
for name in ("lru", "slru", "adaptive"):
    policy = make_policy(name, capacity_bytes=1000)
    for i in range(200):
        policy.insert(f"block-{i}".encode(), 1, priority=60, expires_at=1.0)  # one retention end for all
    out.append([k.decode() for k in policy.victims(200, now=2.0)])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_retention_ties_are_the_same_in_every_process() -> None:
    """Blocks whose retention ends at the same time revert in insertion order, not by memory address."""
    outputs = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _EXPIRY_ORDER], capture_output=True, text=True, check=True,
                             env=env).stdout
        outputs.add(out)
    assert len(outputs) == 1
    assert json.loads(outputs.pop())[0][:3] == ["block-0", "block-1", "block-2"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_touch_while_held_orders_as_a_touch(name: str) -> None:
    """A read holds its blocks and touches them; once released they stand where plain touches put them."""
    held, plain = make_policy(name, capacity_bytes=40), make_policy(name, capacity_bytes=40)
    for policy in (held, plain):
        for key in "abcdef":
            policy.insert(key, 5)
        policy.touch("a")
    held.hold_many(["b", "c"])
    assert "b" not in held.victims(30) and "c" not in held.victims(30)
    held.touch_many(["b", "c"])
    held.release_many(["c", "b"])  # tail first, as the index releases a batch
    plain.touch_many(["b", "c"])
    assert held.victims(30) == plain.victims(30)
    assert list(held) == list(plain) and held.nbytes == plain.nbytes


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_removed_key_stored_again_is_not_held(name: str) -> None:
    policy = make_policy(name, capacity_bytes=40)
    for key in "abcd":
        policy.insert(key, 5)
    policy.touch("a")  # protected, where the policy has a protected segment
    for key in "ab":
        policy.hold(key)
    assert policy.remove("a") == 5 and policy.remove_many(["b"]) == 5
    assert not policy.is_held("a") and not policy.is_held("b")
    policy.insert("a", 5)
    policy.hold("a")  # a new block: held anew
    policy.release("a")
    assert "a" in policy.victims(20)


# ---------------------------------------------------------------------- TTLs (pins) and dead chains


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_ttl_holds_a_block_back_until_it_runs_out_from_its_last_touch(name: str) -> None:
    clock = _Clock()
    policy = make_policy(name, capacity_bytes=100, clock=clock)
    policy.insert("pinned", 10, ttl_s=5.0)  # runs until 5
    for key in "abc":
        policy.insert(key, 10)
    assert policy.victims(40, now=1.0) == ["a", "b", "c", "pinned"]  # evicted only after every block without one
    clock.now = 4.0
    policy.touch("pinned")  # a hit: it runs until 9 now
    assert policy.pin_of("pinned") == (5.0, 9.0) and policy.pinned_nbytes == 10
    assert policy.victims(10, now=6.0) == ["a"]
    assert policy.victims(10, now=9.0) == ["pinned"]  # ran out: the next victim of its priority, not deleted
    assert "pinned" in policy and not policy.is_pinned("pinned") and policy.ttl_ran_out("pinned")
    assert policy.pinned_nbytes == 0 and policy.nbytes == 40


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ttls_that_run_out_go_to_the_front_of_their_priority_tail_first(name: str) -> None:
    clock = _Clock()
    policy = make_policy(name, capacity_bytes=100, clock=clock)
    policy.insert("x", 10)
    policy.insert_many(["head", "mid", "tail"], 10, ttl_s=5.0)  # a chain, pinned tail first
    policy.insert("kept", 10, priority=80, ttl_s=50.0)
    assert policy.priority_of("kept") == 80 and policy.is_pinned("kept")
    policy.expire(6.0)
    assert list(policy)[:4] == ["tail", "mid", "head", "x"]  # the chain's tail is the next victim
    assert list(policy)[-1] == "kept"
    policy.expire(60.0)
    assert policy.priority_of("kept") == 80 and list(policy)[-1] == "kept"  # back at its own priority


def test_pinned_bytes_are_counted_by_group_and_forgotten_with_their_keys() -> None:
    policy = make_policy("lru", pin_group=lambda key: key[0])
    policy.insert("a1", 10, ttl_s=9.0)
    policy.insert("a2", 10, ttl_s=9.0)
    policy.insert("b1", 5)
    policy.pin("b1", 9.0)
    assert policy.pinned_nbytes_of("a") == 20 and policy.pinned_nbytes_of("b") == 5 and policy.pinned_nbytes == 25
    policy.remove("a1")
    policy.unpin("b1")
    assert policy.pinned_nbytes == 10 and policy.pinned_nbytes_of("b") == 0
    assert list(policy) == ["b1", "a2"]  # unpinned: the front of its priority
    with pytest.raises(ValueError):
        policy.insert("c", 1, ttl_s=-1.0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_dead_chain_goes_to_the_front_tail_first_and_unpinned(name: str) -> None:
    policy = make_policy(name, capacity_bytes=100)
    for key in "abcdef":
        policy.insert(key, 1)
    policy.pin("d", 100.0)
    policy.touch("b")
    policy.cool(["c", "d", "e"])  # head first: e, the tail, ends frontmost
    assert list(policy)[:3] == ["e", "d", "c"] and not policy.is_pinned("d")
    policy.hold("a")
    policy.cool(["a", "z"])  # a held key and an unknown one are skipped
    assert policy.victims(3) == ["e", "d", "c"]


def test_unpinning_the_oldest_keeps_the_order_lru_would_have_under_one_ttl() -> None:
    policy = make_policy("lru")
    for key in "abcd":
        policy.insert(key, 1, ttl_s=60.0)
    policy.touch("a")
    assert policy.unpin_oldest(2) == 2  # b and c, the least recently used pins
    assert [policy.is_pinned(k) for k in "abcd"] == [True, False, False, True]
    assert list(policy) == ["b", "c", "d", "a"]  # the eviction order is LRU's
    policy.hold("d")
    assert policy.unpin_oldest(5) == 2 and policy.pinned_nbytes == 0
