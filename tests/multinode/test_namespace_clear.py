"""A namespace clear on one node is seen by every node over one Redis: the namespace's generation in Redis, part of
every Redis key, moves on, with no message between the nodes.

Two real nodes (in-process ``grpc.aio`` servers) share a real ``redis-server``; each is driven through its own
client. A node's copy into Redis that began before the clear is ordered by an event (its Redis write waits for it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import pytest

from kvstore.client import KVStoreClient
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace

pytestmark = pytest.mark.slow  # two servers and a redis-server: outside `make test-fast`


def node(redis_url: str, **overrides: Any) -> ThreadedServer:
    return ThreadedServer(make_config(**{"store.redis.url": redis_url, "store.redis.mode": "write_through",
                                         **overrides}))


def drain(server: ThreadedServer) -> None:
    async def run() -> None:
        await server.server.store.drain()
    server.call(run())


@pytest.fixture
def two_nodes(redis_server: RedisProcess) -> Iterator[tuple[ThreadedServer, ThreadedServer]]:  # noqa: F811
    a = node(redis_server.url)
    b = node(redis_server.url, **{"store.promote_on_hit": False})  # b reads the blocks from Redis, keeps no copy
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_a_clear_through_one_node_is_seen_by_the_other_at_once(two_nodes: tuple[ThreadedServer, ThreadedServer],
                                                               redis_server: RedisProcess) -> None:  # noqa: F811
    a, b = two_nodes
    ns, other_ns = namespace(), namespace()
    hashes, tensors = kv_blocks(ns, 4)
    other_hashes, other_tensors = kv_blocks(other_ns, 2)
    with KVStoreClient(a.target, retries=0) as on_a, KVStoreClient(b.target, retries=0) as on_b:
        assert on_a.put(ns, hashes, tensors) == 4
        assert on_a.put(other_ns, other_hashes, other_tensors) == 2
        drain(a)  # written through into Redis
        assert on_b.lookup(ns, hashes).tiers == ("redis",) * 4
        assert len(on_b.get(ns, hashes)) == 4
        assert on_a.clear(ns) == 4  # through node a only: node b is told nothing
        assert on_b.lookup(ns, hashes).num_blocks == 0
        assert on_b.get(ns, hashes) == []
        assert on_b.lookup(other_ns, other_hashes).num_blocks == 2  # another namespace is untouched
        assert on_b.put(ns, hashes[:2], tensors[:2]) == 2  # a put after the clear, through b: the new generation
        drain(b)
        assert on_a.lookup(ns, hashes).tiers == ("redis",) * 2  # a's own copies went with its clear
        stats = on_b.stats().tier("redis")
        assert stats.counters["stale_generation"] >= 1  # b learnt of the clear from Redis itself
    drain(a)  # the sweep of the old generation
    keys = {k.decode() for k in redis_server.client().keys(f"kvstore:{ns.tag.hex()}:*")}
    assert {k.split(":")[2] for k in keys if not k.endswith(":generation")} == {"1"}  # only the new generation left


def test_a_copy_into_redis_begun_before_a_clear_elsewhere_is_never_served(
        two_nodes: tuple[ThreadedServer, ThreadedServer]) -> None:
    """Node b's write-through of a block is on its way to Redis when node a clears the namespace: the copy lands
    under the old generation, so neither node serves it, while a put made after the clear is served by both."""
    a, b = two_nodes
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    shared = b.server.store.tiers[-1]
    entered, gate = threading.Event(), asyncio.Event()
    real_put = shared.put

    async def gated_put(*args: Any, **kwargs: Any) -> Any:  # b's next write into Redis waits for the gate
        shared.put = real_put  # type: ignore[method-assign]
        entered.set()
        await gate.wait()
        return await real_put(*args, **kwargs)

    shared.put = gated_put  # type: ignore[method-assign]
    with KVStoreClient(a.target, retries=0) as on_a, KVStoreClient(b.target, retries=0) as on_b:
        assert on_b.put(ns, hashes[:2], tensors[:2]) == 2  # stored in b's memory; its write-through waits
        assert entered.wait(30)
        assert on_a.clear(ns) == 0  # a holds nothing of it; Redis moves to generation 1

        async def open_gate() -> None:
            gate.set()

        b.call(open_gate())
        drain(b)  # the old copy has landed, under generation 0
        assert on_a.lookup(ns, hashes).num_blocks == 0  # a never serves it
        assert on_a.get(ns, hashes) == []
        assert on_b.put(ns, hashes[2:], tensors[2:]) == 1  # a newer put, through b
        drain(b)
        assert on_a.lookup(ns, hashes[2:]).tiers == ("redis",)


def test_the_clients_clear_of_several_nodes_clears_every_nodes_local_tiers(
        two_nodes: tuple[ThreadedServer, ThreadedServer]) -> None:
    a, b = two_nodes
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 6)
    with KVStoreClient([a.target, b.target], retries=0) as both:
        assert both.put(ns, hashes, tensors) == 6  # each block on its owner
        for server in (a, b):
            drain(server)
        assert both.lookup(ns, hashes).num_blocks == 6
        assert both.clear(ns) == 6  # every node clears its own, and Redis moves on (twice: a harmless bump)
        assert both.lookup(ns, hashes).num_blocks == 0
    for server in (a, b):
        with KVStoreClient(server.target, retries=0) as one:
            assert one.lookup(ns, hashes).num_blocks == 0
            assert one.stats().tier("memory").blocks == 0
