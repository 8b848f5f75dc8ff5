"""Real kvstore nodes sharing one Redis or one Redis Cluster: a put through one node is a hit through another."""

from __future__ import annotations

import itertools
from typing import Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from tests.support.server import kv_blocks, namespace
from tests.support.kvnode import KVNode
from tests.support.redis import (  # noqa: F401  (redis_cluster and redis_cluster_session are fixtures)
    RedisClusterProcess,
    RedisProcess,
    redis_binaries,
    redis_cluster,
    redis_cluster_session,
)

from tests.support.waiting import wait_until

pytestmark = [pytest.mark.skipif(redis_binaries() is None, reason="redis-server / redis-cli not installed"),
              pytest.mark.slow]  # starts processes: outside `make test-fast`

FAST_REDIS_ENV = {  # short Redis timeouts and breaker, so a dead Redis costs the loop little
    "KVSTORE_STORE__REDIS__MODE": "write_through",
    "KVSTORE_STORE__REDIS__CONNECT_TIMEOUT_S": "0.2",
    "KVSTORE_STORE__REDIS__SOCKET_TIMEOUT_S": "0.2",
    "KVSTORE_STORE__REDIS__BREAKER_FAILURES": "2",
    "KVSTORE_STORE__REDIS__BREAKER_RESET_S": "0.2",
}


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[RedisProcess]:
    """One redis-server for the module's two nodes (killed and restarted by the last test)."""
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def pair(shared_redis: RedisProcess) -> Iterator[tuple[KVNode, KVNode]]:
    """Nodes A and B, memory only, both writing through to the module's Redis."""
    nodes = (KVNode(redis_url=shared_redis.url, env=FAST_REDIS_ENV),
             KVNode(redis_url=shared_redis.url, env=FAST_REDIS_ENV))
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.close()


def put_on_a_then_get_on_b(node_a: KVNode, node_b: KVNode, num_blocks: int = 6) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, num_blocks)
    with KVStoreClient(node_a.target, timeout_s=30) as kv_a, KVStoreClient(node_b.target, timeout_s=30) as kv_b:
        assert kv_b.lookup(ns, hashes).num_blocks == 0
        assert kv_a.put(ns, hashes, tensors) == num_blocks
        wait_until(lambda: kv_b.lookup(ns, hashes).num_blocks == num_blocks, 20.0,
                   "A's write-through reaches Redis and B finds the blocks there")
        assert kv_b.lookup(ns, hashes).tiers == ("redis",) * num_blocks
        assert [torch.equal(a, b) for a, b in zip(tensors, kv_b.get_tensors(ns, hashes))] == [True] * num_blocks
        assert kv_b.stats().tier("redis").hits >= num_blocks
        wait_until(lambda: kv_b.lookup(ns, hashes).tiers == ("memory",) * num_blocks, 20.0,
                   "B promotes the Redis hits into its memory tier")


def test_a_block_put_through_node_a_is_a_hit_through_node_b(pair: tuple[KVNode, KVNode]) -> None:
    put_on_a_then_get_on_b(*pair)


def test_the_same_through_a_shared_redis_cluster(redis_cluster: RedisClusterProcess) -> None:  # noqa: F811
    env = {**FAST_REDIS_ENV, "KVSTORE_STORE__REDIS__CLUSTER": "true"}
    with KVNode(redis_url=redis_cluster.url, env=env) as node_a, KVNode(redis_url=redis_cluster.url, env=env) as node_b:
        put_on_a_then_get_on_b(node_a, node_b, num_blocks=12)  # 12 keys land on more than one cluster node
    num_keys = 0
    for server in redis_cluster.nodes:
        with server.client() as raw:
            num_keys += raw.dbsize()
    assert num_keys >= 12


def test_redis_killed_mid_loop_never_reaches_the_client_and_writes_resume_after_restart(
    pair: tuple[KVNode, KVNode], shared_redis: RedisProcess
) -> None:
    node = pair[0]
    ns = namespace()
    pattern = f"kvstore:{ns.tag.hex()}:*"
    tokens = itertools.count(10**6, 1000)
    written: list[tuple[list[bytes], list[torch.Tensor]]] = []

    def redis_has_keys() -> bool:
        with shared_redis.client(socket_timeout=1.0) as raw:
            return next(iter(raw.scan_iter(match=pattern, count=1000)), None) is not None

    with KVStoreClient(node.target, timeout_s=30, retries=1) as kv:
        for round_ in range(10):
            if round_ == 3:
                wait_until(redis_has_keys, 20.0, "the first rounds' blocks reach Redis")
                shared_redis.kill()
            if round_ == 7:
                shared_redis.start()  # same port, empty (no persistence)
                assert not redis_has_keys()
            hashes, tensors = kv_blocks(ns, 8, first_token=next(tokens))
            assert kv.put(ns, hashes, tensors) == 8  # no error reaches the client
            assert kv.lookup(ns, hashes).tiers == ("memory",) * 8  # the local tier keeps answering
            assert [torch.equal(a, b) for a, b in zip(tensors, kv.get_tensors(ns, hashes))] == [True] * 8
            written.append((hashes, tensors))
        assert all(kv.lookup(ns, hashes).num_blocks == 8 for hashes, _ in written)
        counters = kv.stats().tier("redis").counters
        assert counters.get("errors", 0) + counters.get("breaker_open", 0) > 0  # Redis really was gone

        def a_new_put_reaches_redis() -> bool:
            hashes, tensors = kv_blocks(ns, 2, first_token=next(tokens))
            kv.put(ns, hashes, tensors)
            return redis_has_keys()

        wait_until(a_new_put_reaches_redis, 30.0, "writes to the restarted Redis resume", pause_s=0.2)
