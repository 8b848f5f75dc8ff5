"""One client over three real ``kvstore serve`` nodes: blocks on owners, merged prefixes, dead and silent nodes."""

from __future__ import annotations

import time
from functools import partial
from typing import Iterator

import pytest
import torch

from kvstore.api import StoreStats, TierStats
from kvstore.client import AsyncKVStoreClient, KVStoreClient, merge_store_stats, resolve_targets
from kvstore.errors import InvalidArgumentError
from kvstore.keys import Namespace
from kvstore.routing import RendezvousRouter
from tests.support.server import kv_blocks, namespace
from tests.support.kvnode import KVNode
from tests.support.redis import BlackHole, black_hole  # noqa: F401

from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

FAST_REJOIN = {"down_backoff_s": 0.2, "max_down_backoff_s": 1.0}


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[KVNode]]:
    """Three nodes whose only tier is LMDB (memory off), so every block survives a SIGKILL."""
    nodes = [KVNode(memory_capacity="0", disk_path=tmp_path_factory.mktemp(f"lmdb{i}"), disk_capacity="64MiB")
             for i in range(3)]
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.close()


def targets(nodes: list[KVNode]) -> list[str]:
    return [node.target for node in nodes]


def owned_by(router: RendezvousRouter, hashes: list[bytes], node_id: str, *, owner: bool = True) -> list[bytes]:
    """The hashes that ``node_id`` owns (or, with ``owner=False``, does not own), in order."""
    return [h for h in hashes if (router.owner(h) == node_id) == owner]


def spread_blocks(router: RendezvousRouter, ns: Namespace, num_blocks: int,
                  first_token: int = 0) -> tuple[list[bytes], list[torch.Tensor]]:
    """:func:`kv_blocks` from the first ``first_token`` at or after the given one where every node owns a block.

    The owners depend on the nodes' random ports; this keeps the tests' splits non-trivial on any ports.
    """
    while True:
        hashes, tensors = kv_blocks(ns, num_blocks, first_token=first_token)
        if len({router.owner(h) for h in hashes}) == router.num_nodes:
            return hashes, tensors
        first_token += 1


def test_each_block_lives_on_its_owner_and_the_answers_merge_in_order(trio: list[KVNode]) -> None:
    ns = namespace()
    with KVStoreClient(targets(trio), timeout_s=30) as kv:
        hashes, tensors = spread_blocks(kv.router, ns, 24)
        assert kv.put(ns, hashes, tensors) == 24
        assert kv.lookup(ns, hashes).tiers == ("disk",) * 24
        for sent, received in zip(tensors, kv.get_tensors(ns, hashes)):
            assert torch.equal(sent, received)
        for node in trio:  # a node holds exactly the blocks it owns
            with KVStoreClient(node.target, retries=0) as single:
                mine = owned_by(kv.router, hashes, node.target)
                assert 0 < len(mine) < 24
                assert single.lookup(ns, mine).num_blocks == len(mine)
                assert all(single.lookup(ns, [h]).num_blocks == 0
                           for h in owned_by(kv.router, hashes, node.target, owner=False))
        per_node = kv.node_stats()
        assert sorted(per_node) == sorted(targets(trio))
        assert kv.stats().tier("disk").blocks == sum(s.tier("disk").blocks for s in per_node.values())
        assert kv.health() == "SERVING"
        assert kv.delete(ns, hashes[20:]) == 4
        assert kv.lookup(ns, hashes).num_blocks == 20
        assert kv.clear(ns) == 20
        assert kv.lookup(ns, hashes).num_blocks == 0


async def test_the_async_twin_fans_out_the_same_way(trio: list[KVNode]) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 16)
    async with AsyncKVStoreClient(targets=targets(trio), timeout_s=30) as kv:
        assert await kv.put(ns, hashes, tensors) == 16
        assert (await kv.lookup(ns, hashes)).num_blocks == 16
        assert [torch.equal(a, b) for a, b in zip(tensors, await kv.get_tensors(ns, hashes))] == [True] * 16
        assert len(await kv.node_stats()) == 3 and await kv.health() == "SERVING"
        assert await kv.delete(ns, hashes[10:]) == 6
        assert len(await kv.get(ns, hashes)) == 10
        assert await kv.clear(ns) == 10


def test_prefix_ends_at_the_first_block_its_owner_lacks(trio: list[KVNode]) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 20)
    with KVStoreClient(targets(trio), timeout_s=30) as kv:
        kv.put(ns, hashes, tensors)
        hole = 13
        with KVStoreClient(kv.router.owner(hashes[hole]), retries=0) as owner:
            assert owner.delete(ns, [hashes[hole]]) == 1
        assert kv.lookup(ns, hashes).num_blocks == hole
        assert len(kv.get(ns, hashes)) == hole


def test_leaving_a_node_out_of_the_client_moves_only_its_blocks(trio: list[KVNode]) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 60)
    with KVStoreClient(targets(trio), timeout_s=30) as three:
        three.put(ns, hashes, tensors)
        gone = trio[1].target
        with KVStoreClient(targets([trio[0], trio[2]]), timeout_s=30) as two:
            kept = owned_by(three.router, hashes, gone, owner=False)
            assert two.lookup(ns, kept).num_blocks == len(kept)  # same owner: still hits
            moved = owned_by(three.router, hashes, gone)
            assert moved and all(two.lookup(ns, [h]).num_blocks == 0 for h in moved)  # new owner: misses


def test_a_silent_target_costs_at_most_a_timeout_and_the_other_nodes_still_serve(
    trio: list[KVNode], black_hole: BlackHole  # noqa: F811
) -> None:
    timeout_s = 1.0
    silent = f"127.0.0.1:{black_hole.port}"
    ns = namespace()
    with KVStoreClient([*targets(trio), silent], timeout_s=timeout_s, retries=1, **FAST_REJOIN) as kv:
        for round_ in range(4):
            hashes, tensors = spread_blocks(kv.router, ns, 16, first_token=round_ * 1000)
            live = owned_by(kv.router, hashes, silent, owner=False)
            assert 0 < len(live) < 16
            for call in (partial(kv.put, ns, hashes, tensors), partial(kv.lookup, ns, hashes),
                         partial(kv.get, ns, hashes), partial(kv.lookup, ns, live), kv.stats):
                started = time.monotonic()
                call()
                assert time.monotonic() - started < timeout_s * 3 + 1.0  # a hang check, not a performance one
            assert kv.put(ns, hashes, tensors) == 0  # stored already on the live owners; the silent one skipped
            assert kv.lookup(ns, live).num_blocks == len(live)
            live_tensors = [t for h, t in zip(hashes, tensors) if h in live]
            assert [torch.equal(a, b) for a, b in zip(live_tensors, kv.get_tensors(ns, live))] == [True] * len(live)
            assert all(kv.lookup(ns, [h]).num_blocks == 0 for h in owned_by(kv.router, hashes, silent))
        assert [s.up for s in kv.nodes() if s.node_id == silent] == [False]
        assert black_hole.num_accepted >= 1  # the client did try it


async def test_the_async_twin_treats_a_silent_target_as_a_miss_too(
    trio: list[KVNode], black_hole: BlackHole  # noqa: F811
) -> None:
    timeout_s = 1.0
    silent = f"127.0.0.1:{black_hole.port}"
    ns = namespace()
    async with AsyncKVStoreClient([*targets(trio), silent], timeout_s=timeout_s, retries=1, **FAST_REJOIN) as kv:
        for round_ in range(3):
            hashes, tensors = spread_blocks(kv.router, ns, 16, first_token=round_ * 1000)
            live = owned_by(kv.router, hashes, silent, owner=False)
            started = time.monotonic()
            assert await kv.put(ns, hashes, tensors) == len(live)
            assert (await kv.lookup(ns, live)).num_blocks == len(live)
            assert len(await kv.get(ns, live)) == len(live)
            assert time.monotonic() - started < 3 * (timeout_s * 3 + 1.0)  # three calls; a hang check
        assert [s.up for s in kv.nodes() if s.node_id == silent] == [False]


def test_a_node_killed_mid_loop_is_a_miss_then_rejoins_with_its_lmdb_blocks(trio: list[KVNode]) -> None:
    ns = namespace()
    victim = trio[2]
    with KVStoreClient(targets(trio), timeout_s=10, retries=1, **FAST_REJOIN) as kv:
        durable, durable_tensors = spread_blocks(kv.router, ns, 24, first_token=10**6)
        assert kv.put(ns, durable, durable_tensors) == 24
        victims_blocks = owned_by(kv.router, durable, victim.target)
        assert victims_blocks
        for round_ in range(10):
            if round_ == 3:
                victim.kill()
            hashes, tensors = kv_blocks(ns, 12, first_token=round_ * 1000)
            others = owned_by(kv.router, hashes, victim.target, owner=False)
            stored = kv.put(ns, hashes, tensors)  # no exception, before or after the kill
            assert stored == (12 if round_ < 3 else len(others))
            assert kv.lookup(ns, others).num_blocks == len(others)
            assert len(kv.get(ns, others)) == len(others)
            if round_ >= 3:
                assert all(kv.lookup(ns, [h]).num_blocks == 0 for h in victims_blocks)
                assert kv.lookup(ns, durable).num_blocks < 24
        assert [s.up for s in kv.nodes() if s.node_id == victim.target] == [False]

        # KVNode forks with a preexec_fn, which runs gRPC's fork handlers; a child forked while another thread
        # is inside a gRPC call (here: a background probe of the dead node) can deadlock before its exec.
        # Probes start only from calls, so once none is in flight none starts until the next call.
        wait_until(lambda: not any(s.probing for s in kv.nodes()), 10.0, "no probe in flight while forking")
        victim.start()  # same port and LMDB path
        wait_until(lambda: kv.lookup(ns, victims_blocks).num_blocks == len(victims_blocks), 30.0,
                   "the restarted node rejoins with its LMDB blocks")
        assert kv.lookup(ns, durable).num_blocks == 24
        fresh, fresh_tensors = spread_blocks(kv.router, ns, 12, first_token=2 * 10**6)
        assert kv.put(ns, fresh, fresh_tensors) == 12  # new puts reach it again
        with KVStoreClient(victim.target, retries=0) as single:
            mine = owned_by(kv.router, fresh, victim.target)
            assert single.lookup(ns, mine).num_blocks == len(mine)


# ---------------------------------------------------------------------- pure parts of the client


def test_targets_accept_one_string_or_a_list_and_drop_duplicates() -> None:
    assert resolve_targets("a:1", None) == ("a:1",)
    assert resolve_targets(["a:1", "b:2", "a:1"], None) == ("a:1", "b:2")
    assert resolve_targets(None, ("b:2",)) == ("b:2",)
    for target, many in ((None, None), ("a:1", ["b:2"]), ([], None), ([""], None)):
        with pytest.raises(InvalidArgumentError):
            resolve_targets(target, many)
    with KVStoreClient(["a:1", "a:1"]) as same:  # one node listed twice is one node, with today's errors
        assert same.targets == ("a:1",) and repr(same) == "KVStoreClient('a:1')"


def test_merged_stats_sum_each_tier_and_keep_unknown_counts_unknown() -> None:
    a = StoreStats((TierStats("memory", blocks=2, bytes=10, hits=1),
                    TierStats("redis", blocks=-1, counters={"errors": 1})))
    b = StoreStats((TierStats("memory", blocks=3, bytes=5, hits=4),
                    TierStats("redis", blocks=-1, counters={"errors": 2, "written": 7})))
    merged = merge_store_stats([a, b])
    assert merged.tier("memory") == TierStats("memory", blocks=5, bytes=15, hits=5)
    assert merged.tier("redis").blocks == -1 and merged.tier("redis").counters == {"errors": 3, "written": 7}
    assert merge_store_stats([]).tiers == ()
