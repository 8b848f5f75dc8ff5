"""Leases bound the bytes: a leased range is never written under its reader, whatever happens to the block, and
ends when released, when it expires, or with its session; a prefix that does not fit goes over gRPC."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks
from kvstore.shm.node.pool import SharedPool
from tests.support.server import MiB, ThreadedServer, finished_calls, make_config, namespace, scrape
from tests.support.waiting import wait_until


def blocks_of(ns: Namespace, num_blocks: int, fill: int, head_dim: int = 64) -> tuple[list[bytes], list[torch.Tensor]]:
    hashes = hash_blocks(ns, [fill * 100_000 + i for i in range(num_blocks * ns.block_size)])
    return hashes, [torch.full((2, 2, 2, ns.block_size, head_dim), fill + i, dtype=torch.float16)
                    for i in range(num_blocks)]


def counts(server: ThreadedServer) -> dict[str, int]:
    return server.call(_counters(server))


async def _counters(server: ThreadedServer) -> dict[str, int]:
    return server.server.shm.counters()  # type: ignore[union-attr]


def calls(server: ThreadedServer, method: str) -> float:
    return scrape(server).get(f'kvstore_requests_total{{code="OK",method="{method}"}}', 0.0)


@pytest.fixture()
def small_node() -> Iterator[ThreadedServer]:
    """A node whose memory tier holds 2 MiB (evictions come quickly) and whose sessions' segments hold 1 MiB."""
    node = ThreadedServer(make_config(**{"store.memory.capacity_bytes": 2 * MiB,
                                         "shared_memory.segment_bytes": MiB}))
    yield node
    node.stop()


@pytest.fixture()
def copying_node() -> Iterator[ThreadedServer]:
    """As :func:`small_node`, with its memory tier on the heap: every Get is copied into the get segment (as a
    Get of blocks read from disk or Redis is), which is what the segment's room bounds."""
    node = ThreadedServer(make_config(**{"store.memory.capacity_bytes": 2 * MiB, "store.memory.storage": "heap",
                                         "shared_memory.segment_bytes": MiB}))
    yield node
    node.stop()


def test_a_leased_range_is_never_written_while_its_blocks_are_deleted_cleared_evicted_or_put_again(
        small_node: ThreadedServer) -> None:
    ns = namespace(block_size=16)
    hashes, tensors = blocks_of(ns, 4, fill=1)  # 4 blocks of 16 KiB
    with KVStoreClient(small_node.target, retries=0) as client:
        client.put(ns, hashes, tensors)
        lease = client.read(ns, hashes)
        assert client.shared_memory() == ("attached",)
        held = [bytes(b) for b in lease.blocks]
        client.delete(ns, hashes[:2])
        client.clear(ns)
        assert client.lookup(ns, hashes).num_blocks == 0
        other = namespace(block_size=16)
        for round_ in range(6):  # 6 x 1 MiB through a 2 MiB tier: everything is evicted, over and over
            other_hashes, other_tensors = blocks_of(other, 32, fill=10 + round_ * 40)
            client.put(other, other_hashes, other_tensors)
            into = [torch.empty_like(t) for t in other_tensors[:16]]
            assert client.get_into(other, other_hashes[:16], into) == 16  # other ranges of the same segment
        assert client.put(ns, hashes, [t + 100 for t in tensors]) == 4  # the same keys, other bytes
        assert [bytes(b) for b in lease.blocks] == held  # still what was read
        # the get_into calls release their leases without waiting for the node: wait for those releases to land
        wait_until(lambda: counts(small_node)["leases"] == 1, 30, "the get_into leases' releases reached the node")
        assert counts(small_node)["leases_expired"] == 0
        pool = small_node.server.store.tiers[0]
        assert isinstance(pool, SharedPool)
        assert small_node.call(_held(pool)) > 0  # the deleted blocks' ranges: kept for the lease, not reused
        lease.release()
        wait_until(lambda: counts(small_node)["leases"] == 0, 30, "the release reached the node")
        assert small_node.call(_held(pool)) == 0  # given back with the lease
        again = client.read(ns, hashes)
        assert [bytes(b) for b in again.blocks] != held
        again.release()


async def _held(pool: SharedPool) -> int:
    return pool.held_bytes


@pytest.mark.slow
def test_a_lease_not_released_expires_and_its_range_comes_back() -> None:
    node = ThreadedServer(make_config(**{"shared_memory.lease_s": 0.5}))
    try:
        ns = namespace(block_size=16)
        hashes, tensors = blocks_of(ns, 2, fill=3)
        with KVStoreClient(node.target, retries=0) as client:
            client.put(ns, hashes, tensors)
            lease = client.read(ns, hashes)  # never released
            wait_until(lambda: counts(node)["leases_expired"] == 1, 30, "the lease expired")
            assert counts(node)["leased_bytes"] == 0
            into = [torch.empty_like(t) for t in tensors]
            assert client.get_into(ns, hashes, into) == 2
            assert all(torch.equal(a, b) for a, b in zip(into, tensors))
            lease.release()  # late: a no-op on the node
    finally:
        node.stop()


def test_a_prefix_larger_than_the_segment_is_read_in_place(small_node: ThreadedServer) -> None:
    ns = namespace(block_size=256)
    hashes, tensors = blocks_of(ns, 6, fill=4)  # 6 x 256 KiB: more than the 1 MiB segment
    with KVStoreClient(small_node.target, retries=0) as client:
        client.put(ns, hashes[:4], tensors[:4])
        into = [torch.empty_like(t) for t in tensors[:4]]
        assert client.get_into(ns, hashes[:4], into) == 4
        assert all(torch.equal(a, b) for a, b in zip(into, tensors))
        assert finished_calls(small_node, "GetShared", 1) == 1 and counts(small_node)["no_room"] == 0
        assert calls(small_node, "Get") == 0  # where the blocks lie in the pool: the segment's room is not needed


def test_a_prefix_larger_than_the_segment_goes_over_grpc(copying_node: ThreadedServer) -> None:
    ns = namespace(block_size=256)
    hashes, tensors = blocks_of(ns, 6, fill=4)  # 6 x 256 KiB: more than the 1 MiB segment
    with KVStoreClient(copying_node.target, retries=0) as client:
        client.put(ns, hashes[:4], tensors[:4])
        into = [torch.empty_like(t) for t in tensors[:4]]
        assert client.get_into(ns, hashes[:4], into) == 4
        assert all(torch.equal(a, b) for a, b in zip(into, tensors))
        assert finished_calls(copying_node, "Get", 1) == 1 and counts(copying_node)["no_room"] == 1
        assert client.shared_memory() == ("attached",)  # one call went over gRPC; the session stays


def test_a_full_segment_sends_gets_over_grpc_until_leases_come_back(copying_node: ThreadedServer) -> None:
    ns = namespace(block_size=64)
    hashes, tensors = blocks_of(ns, 4, fill=5)  # 4 x 64 KiB
    with KVStoreClient(copying_node.target, retries=0) as client:
        client.put(ns, hashes, tensors)
        # 3 x 260 KiB (blocks and their headers) leave no room for a fourth prefix in the 1 MiB segment
        leases = [client.read(ns, hashes) for _ in range(3)]
        assert finished_calls(copying_node, "GetShared", 3) == 3 and counts(copying_node)["no_room"] == 0
        assert [bytes(b) for b in client.get(ns, hashes)] == [bytes(b) for b in leases[0].blocks]
        assert counts(copying_node)["no_room"] == 1  # refused over the data plane (a GetShared), then over gRPC
        assert finished_calls(copying_node, "Get", 1) == 1 and finished_calls(copying_node, "GetShared", 4) == 4
        for lease in leases:
            lease.release()
        wait_until(lambda: counts(copying_node)["leases"] == 0, 30, "the releases reached the node")
        client.get(ns, hashes)
        assert finished_calls(copying_node, "GetShared", 5) == 5 and calls(copying_node, "Get") == 1


def test_leases_in_place_count_against_the_tenant_budget() -> None:
    node = ThreadedServer(make_config(**{"shared_memory.tenant_leased_bytes": MiB}))
    try:
        ns = namespace(block_size=64)
        hashes, tensors = blocks_of(ns, 4, fill=7)  # 4 x 64 KiB, read in place
        with KVStoreClient(node.target, retries=0) as client:
            client.put(ns, hashes, tensors)
            leases = [client.read(ns, hashes) for _ in range(3)]  # 3 x 260 KiB of the 1 MiB budget
            assert counts(node)["leased_bytes"] >= 3 * 4 * 64 * 1024
            assert [bytes(b) for b in client.get(ns, hashes)] == [bytes(b) for b in leases[0].blocks]
            assert counts(node)["tenant_budget_no_room"] == 1  # the fourth: over gRPC
            for lease in leases:
                lease.release()
            wait_until(lambda: counts(node)["leased_bytes"] == 0, 30, "the releases reached the node")
    finally:
        node.stop()


def test_a_put_larger_than_the_put_segment_goes_over_grpc(small_node: ThreadedServer) -> None:
    ns = namespace(block_size=256)
    hashes, tensors = blocks_of(ns, 6, fill=6)
    with KVStoreClient(small_node.target, retries=0, bulk=False) as client:  # bulk=False: else the bulk path
        assert client.put(ns, hashes[:2], tensors[:2]) == 2  # 512 KiB: staged
        assert finished_calls(small_node, "PutShared", 1) == 1, client.shared_memory()  # why it went over gRPC
        assert client.put(ns, hashes[2:], tensors[2:]) == 4  # 1 MiB and headers: over gRPC
        assert finished_calls(small_node, "Put", 1) == 1
        with KVStoreClient(small_node.target, retries=0, shared_memory=False, bulk=False) as over_grpc:
            assert [bytes(b) for b in client.get(ns, hashes)] == [bytes(b) for b in over_grpc.get(ns, hashes)]
