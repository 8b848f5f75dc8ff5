"""Bounded bytes per caller: Get replies in flight count against a per-connection and a per-tenant budget
(``kvstore.server.budgets.ReplyBudget``); stalled readers wait their turn and a well-behaved client is served."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace
from kvstore.server.budgets import ReplyBudget
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import namespace_to_pb
from tests.support.server import ThreadedServer, kv_blocks, make_config
from tests.support.waiting import wait_until

MiB = 1 << 20


# ---------------------------------------------------------------- as logic


def test_a_get_past_its_connections_budget_waits_its_turn_first_come_first_served() -> None:
    async def scenario() -> None:
        budget = ReplyBudget(per_connection_bytes=10, per_tenant_bytes=100)
        assert budget.admit("p", "t", 0)
        budget.settle("p", "t", 0, 12, 2)  # one Get larger than the budget runs, alone
        assert budget.estimate(3) == 18  # 6 bytes a block, the latest reply's
        assert not budget.admit("p", "t", 6) and budget.admit("q", "t", 6)  # another connection has its own
        budget.release("q", "t", 6)
        order: list[int] = []

        async def get(n: int) -> None:
            await budget.wait("p", "t", 6)  # charged on admission, before it reads
            order.append(n)

        waiting = [asyncio.ensure_future(get(n)) for n in range(3)]
        await asyncio.sleep(0)
        assert order == [] and budget.held_bytes(peer="p") == 12
        budget.release("p", "t", 12)
        await asyncio.sleep(0)
        assert order == [0] and budget.held_bytes(peer="p") == 6  # under 10, but the next waits for a release
        budget.release("p", "t", 6)
        for _ in range(3):
            await asyncio.sleep(0)
        assert order == [0, 1]
        waiting[2].cancel()  # a waiter that goes (its client did) leaves the queue, charged nothing
        await asyncio.gather(*waiting, return_exceptions=True)
        budget.release("p", "t", 6)
        assert budget.held_bytes() == 0 and budget.admit("p", "t", 0) and budget._waiters == {}

    asyncio.run(scenario())


def test_a_tenant_is_bounded_over_all_its_connections() -> None:
    async def scenario() -> None:
        budget = ReplyBudget(per_connection_bytes=100, per_tenant_bytes=10)
        budget.charge("p", "t", 10)
        assert not budget.admit("q", "t", 1) and budget.admit("q", "u", 1)
        got = asyncio.ensure_future(budget.wait("q", "t", 1))
        await asyncio.sleep(0)
        assert not got.done()
        budget.release("p", "t", 10)
        await got
        assert budget.held_bytes(tenant="t") == 1
        budget.release("q", "t", 1)
        budget.release("q", "u", 1)
        assert budget.held_bytes(tenant="t") == 0 and budget.held_bytes() == 0

    asyncio.run(scenario())


def test_waits_for_the_budget_are_counted_and_timed_in_the_metrics() -> None:
    from prometheus_client import generate_latest

    from kvstore.server.metrics import ServiceMetrics
    from kvstore.server.budgets import PutBudget

    budget = ReplyBudget(per_connection_bytes=10, per_tenant_bytes=100)
    metrics = ServiceMetrics()
    metrics.add_budgets(budget, PutBudget(per_connection_bytes=10, per_tenant_bytes=100))

    async def scenario() -> None:
        assert budget.admit("p", "t", 12)  # the budget is full
        admitted = asyncio.ensure_future(budget.wait("p", "t", 6))
        abandoned = asyncio.ensure_future(budget.wait("p", "t", 6))
        await asyncio.sleep(0)
        budget.release("p", "t", 12)
        await admitted
        abandoned.cancel()  # its deadline
        await asyncio.gather(abandoned, return_exceptions=True)

    asyncio.run(scenario())
    text = generate_latest(metrics.registry).decode()
    assert 'kvstore_reply_budget_waits_total{outcome="admitted"} 1.0' in text
    assert 'kvstore_reply_budget_waits_total{outcome="abandoned"} 1.0' in text
    assert 'kvstore_reply_budget_wait_seconds_count 2.0' in text
    assert 'kvstore_reply_budget_wait_seconds_bucket{le="+Inf"} 2.0' in text
    assert "kvstore_reply_budget_held_bytes 6.0" in text  # the admitted Get's estimate, until it is released
    assert budget.num_waited == 2 and budget.waits.sum_s >= 0


def test_budgets_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReplyBudget(0, 1)


# ---------------------------------------------------------------- on a real node


@pytest.mark.slow
def test_stalled_readers_keep_the_node_within_its_budget_while_another_connection_is_served() -> None:
    server = ThreadedServer(make_config(**{"limits.connection_reply_bytes": 4 * MiB,
                                           "limits.max_hashes_per_request": 64}))
    budget = server.server.service.replies
    stalled_ns, good_ns = Namespace("stalled-model"), Namespace("good-model")
    hashes, tensors = kv_blocks(stalled_ns, 8, num_layers=8, num_kv_heads=8, head_dim=128)  # 8 blocks of 1 MiB
    good_hashes, good_tensors = kv_blocks(good_ns, 4, num_layers=4, num_kv_heads=4, head_dim=64)
    reply_bytes = 8 * (len(tensors[0].numpy().tobytes()) + 64)
    errors: list[BaseException] = []
    try:
        with KVStoreClient(server.target, timeout_s=60, retries=0, shared_memory=False, bulk=False) as kv:
            kv.put(stalled_ns, hashes, tensors)
            kv.put(good_ns, good_hashes, good_tensors)
            kv.get(stalled_ns, hashes)  # the node learns its replies' bytes per block: Gets are charged before they read
        # No BDP probing: the stalled client's receive windows stay at gRPC's 64 KiB, so no unread reply can
        # complete into its buffers (with probing, a window can grow past a whole 4 MiB reply, which then ends,
        # frees its budget and lets the next Get in without a wait).
        channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1),
                                                                ("grpc.http2.bdp_probe", 0)])
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(namespace=namespace_to_pb(stalled_ns), block_hashes=hashes)
        streams = [stub.Get(request, timeout=120) for _ in range(32)]  # none is read
        wait_until(lambda: budget.num_waited >= 31, 120, "every stalled Get but the first waiting its turn")
        peak = budget.held_bytes()
        assert 0 < peak <= 4 * MiB + reply_bytes  # the budget plus the one reply admitted under it

        served = threading.Event()

        def good() -> None:
            try:
                with KVStoreClient(server.target, timeout_s=60, retries=0, shared_memory=False, bulk=False) as client:  # its own connection
                    for _ in range(20):
                        got = client.get_tensors(good_ns, good_hashes)
                        assert all(torch.equal(a, b) for a, b in zip(got, good_tensors))
                served.set()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        thread = threading.Thread(target=good)
        thread.start()
        thread.join(120)
        assert served.is_set() and not errors, errors
        assert budget.held_bytes() <= 4 * MiB + reply_bytes  # still within it
        for stream in streams:
            stream.cancel()
        channel.close()  # the stalled client goes: its bytes are released at once, and nothing waits
        wait_until(lambda: budget.held_bytes() == 0 and not budget._waiters, 30, "the stalled client's bytes released")
        with KVStoreClient(server.target, timeout_s=60, retries=0, shared_memory=False, bulk=False) as client:
            assert client.lookup(stalled_ns, hashes).num_blocks == 8
    finally:
        server.stop()


@pytest.mark.slow
def test_many_concurrent_gets_on_one_connection_all_complete_under_a_small_budget() -> None:
    server = ThreadedServer(make_config(**{"limits.connection_reply_bytes": 1 * MiB}))
    ns = Namespace("busy-model")
    hashes, tensors = kv_blocks(ns, 4, num_layers=8, num_kv_heads=8, head_dim=128)
    try:
        with KVStoreClient(server.target, timeout_s=60, retries=0, shared_memory=False, bulk=False) as client:
            client.put(ns, hashes, tensors)
            results: list[bool] = []

            def reader() -> None:
                for _ in range(5):
                    got = client.get_tensors(ns, hashes)
                    results.append(all(torch.equal(a, b) for a, b in zip(got, tensors)))

            threads = [threading.Thread(target=reader) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert results == [True] * 40
        assert server.server.service.replies.num_waited > 0  # they took turns
        wait_until(lambda: server.server.service.replies.held_bytes() == 0, 30, "every reply's bytes released")
    finally:
        server.stop()
