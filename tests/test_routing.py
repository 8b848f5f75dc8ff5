"""Rendezvous routing and membership as pure logic: owners, key movement, prefix merging, backoff on a fake clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.api import LookupResult
from kvstore.errors import InvalidArgumentError
from kvstore.routing import Membership, Partition, RendezvousRouter, node_seed, node_weight

NUM_HASHES = 10_000


def random_hashes(num: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(num)]


def node_ids(num: int) -> list[str]:
    return [f"10.0.0.{i}:50051" for i in range(1, num + 1)]


def reference_owner(ids: list[str], block_hash: bytes) -> str:
    """The formula of the docstring, written out: the node of highest weight, ties to the smallest id."""
    return max(sorted(ids), key=lambda n: (node_weight(n, block_hash), -sorted(ids).index(n)))


def test_weights_are_the_documented_xxh3_64_and_stable_across_processes() -> None:
    # pinned values: XXH3_64(utf8("127.0.0.1:50051")) and XXH3_64(bytes 0..15, seed=that); a change moves every key
    assert node_seed("127.0.0.1:50051") == 14486709027615305070
    assert node_weight("127.0.0.1:50051", bytes(range(16))) == 11817172916638718781


def test_owner_is_the_argmax_of_the_weights_whatever_the_order_of_nodes() -> None:
    ids = node_ids(5)
    hashes = random_hashes(300)
    router, shuffled = RendezvousRouter(ids), RendezvousRouter(list(reversed(ids)))
    for block_hash in hashes:
        assert router.owner(block_hash) == shuffled.owner(block_hash) == reference_owner(ids, block_hash)
    assert [router.node_ids[i] for i in router.owner_indices(hashes)] == [router.owner(h) for h in hashes]


def test_blocks_spread_evenly() -> None:
    router = RendezvousRouter(node_ids(4))
    counts = [0] * 4
    for owner in router.owner_indices(random_hashes(NUM_HASHES)):
        counts[owner] += 1
    assert all(abs(c - NUM_HASHES / 4) < 0.1 * NUM_HASHES / 4 for c in counts), counts


@pytest.mark.parametrize("num_nodes", [1, 3, 9])
def test_adding_a_node_moves_about_one_in_n_plus_1_keys_all_to_the_new_node(num_nodes: int) -> None:
    hashes = random_hashes(NUM_HASHES, seed=num_nodes)
    before = RendezvousRouter(node_ids(num_nodes))
    after = RendezvousRouter(node_ids(num_nodes + 1))
    new_node = node_ids(num_nodes + 1)[-1]
    old_owners = [before.node_ids[i] for i in before.owner_indices(hashes)]
    new_owners = [after.node_ids[i] for i in after.owner_indices(hashes)]
    moved = [(old, new) for old, new in zip(old_owners, new_owners) if old != new]
    assert all(new == new_node for _, new in moved)  # nothing moves between the old nodes
    expected = NUM_HASHES / (num_nodes + 1)
    assert abs(len(moved) - expected) < 0.1 * expected, (len(moved), expected)


def test_removing_a_node_moves_only_its_keys_spread_over_the_others() -> None:
    hashes = random_hashes(NUM_HASHES, seed=7)
    ids = node_ids(5)
    removed = ids[2]
    before, after = RendezvousRouter(ids), RendezvousRouter([n for n in ids if n != removed])
    old_owners = [before.node_ids[i] for i in before.owner_indices(hashes)]
    new_owners = [after.node_ids[i] for i in after.owner_indices(hashes)]
    received = {n: 0 for n in ids if n != removed}
    for old, new in zip(old_owners, new_owners):
        if old != removed:
            assert new == old
        else:
            received[new] += 1
    orphans = old_owners.count(removed)
    assert sum(received.values()) == orphans
    assert all(count > 0.15 * orphans for count in received.values()), received  # spread, not piled on one node


def test_router_rejects_empty_or_duplicate_node_ids() -> None:
    for bad in ([], ["a:1", "a:1"], ["a:1", ""]):
        with pytest.raises(InvalidArgumentError):
            RendezvousRouter(bad)


# ---------------------------------------------------------------------- partition and merging


def test_split_keeps_each_nodes_blocks_in_order() -> None:
    router = RendezvousRouter(node_ids(3))
    hashes = random_hashes(50)
    partition = router.split(hashes)
    assert sorted(i for owned in partition.positions for i in owned) == list(range(50))
    for node, owned in enumerate(partition.positions):
        assert list(owned) == sorted(owned)
        assert partition.sub_list(node, hashes) == [h for h in hashes if router.owner(h) == router.node_ids[node]]


def reference_prefix(owners: list[int], node_prefix: list[int]) -> int:
    seen = [0] * len(node_prefix)
    for i, node in enumerate(owners):
        if seen[node] >= node_prefix[node]:
            return i
        seen[node] += 1
    return len(owners)


def partition_of(owners: list[int], num_nodes: int) -> Partition:
    positions = tuple(tuple(i for i, o in enumerate(owners) if o == node) for node in range(num_nodes))
    return Partition(tuple(owners), positions)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(0, n - 1), max_size=30), st.lists(st.integers(0, 30), min_size=n, max_size=n))))
@pytest.mark.slow
def test_merged_prefix_ends_at_the_first_block_past_its_owners_prefix(case: tuple[int, list[int], list[int]]) -> None:
    num_nodes, owners, raw_prefix = case
    partition = partition_of(owners, num_nodes)
    node_prefix = [min(p, len(partition.positions[j])) for j, p in enumerate(raw_prefix)]
    prefix = partition.merge_prefix(node_prefix)
    assert prefix == reference_prefix(owners, node_prefix)
    # the blocks and tiers of the merge are the owners' own, in order
    per_node = [[f"b{i}" for i in partition.positions[j][: node_prefix[j]]] for j in range(num_nodes)]
    assert partition.merge_blocks(per_node) == [f"b{i}" for i in range(prefix)]
    lookups = [LookupResult(node_prefix[j], tuple(f"t{i}" for i in partition.positions[j][: node_prefix[j]]))
               for j in range(num_nodes)]
    assert partition.merge_lookup(lookups) == LookupResult(prefix, tuple(f"t{i}" for i in range(prefix)))


def test_a_node_with_no_answer_is_a_miss_of_its_first_block() -> None:
    partition = partition_of([0, 0, 1, 0, 2], 3)
    answers = [LookupResult(3, ("memory",) * 3), None, LookupResult(1, ("disk",))]
    assert partition.merge_lookup(answers) == LookupResult(2, ("memory", "memory"))
    assert partition.merge_blocks([["a", "b", "d"], None, ["e"]]) == ["a", "b"]
    assert partition.merge_blocks([["a", "b", "d"], ["c"], ["e"]]) == ["a", "b", "c", "d", "e"]
    assert partition.merge_blocks([["a"], ["c"], []]) == ["a"]  # node 0 lacks its second block (position 1)


# ---------------------------------------------------------------------- membership


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_failed_node_is_down_until_its_backoff_passes_then_probed_once() -> None:
    clock = FakeClock()
    members = Membership(["a", "b"], clock=clock, base_backoff_s=1.0, max_backoff_s=4.0)
    assert members.is_up("a") and members.due_probes() == []
    assert members.record_failure("a") == 1.0
    assert not members.is_up("a") and members.is_up("b")
    clock.now_s += 0.9
    assert members.due_probes() == []
    clock.now_s += 0.1
    assert members.due_probes() == ["a"]
    assert members.due_probes() == []  # one probe at a time
    assert members.status()[0].probing
    members.probe_done("a", ok=True)
    assert members.is_up("a") and members.status()[0].consecutive_failures == 0


def test_backoff_doubles_per_failed_probe_up_to_the_cap_and_resets_on_success() -> None:
    clock = FakeClock()
    members = Membership(["a"], clock=clock, base_backoff_s=0.5, max_backoff_s=3.0)
    waits = []
    members.record_failure("a")
    for _ in range(5):
        status = members.status()[0]
        waits.append(status.next_probe_s - clock.now_s)
        clock.now_s = status.next_probe_s
        assert members.due_probes() == ["a"]
        members.probe_done("a", ok=False)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert members.record_success("a") is True  # it was down
    assert members.record_success("a") is False
    assert members.record_failure("a") == 0.5


def test_backoff_stays_at_the_cap_after_thousands_of_failures() -> None:
    """Regression: ``2.0 ** 2000`` raised OverflowError for a node down for hours."""
    members = Membership(["a"], base_backoff_s=0.5, max_backoff_s=30.0)
    assert members.backoff_s(2000) == 30.0


def test_membership_rejects_bad_backoffs() -> None:
    with pytest.raises(InvalidArgumentError):
        Membership(["a"], base_backoff_s=2.0, max_backoff_s=1.0)
