"""Bounded bytes per caller, on the way in: Put bodies being received count against a per-connection and a
per-tenant budget (``kvstore.server.budgets.PutBudget``); a Put past it waits before it reads on."""

from __future__ import annotations

import asyncio
import queue
from typing import Iterator

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.keys import Namespace
from kvstore.server.budgets import PutBudget
from kvstore.wire import PUT_METHOD, identity, put_requests
from kvstore.v1 import kvstore_pb2 as pb
from tests.support.server import ThreadedServer, kv_blocks, make_config, scrape
from tests.support.waiting import wait_until


def test_a_put_past_the_budget_waits_and_its_own_blocks_do_not_count_against_it() -> None:
    async def scenario() -> None:
        budget = PutBudget(per_connection_bytes=10, per_tenant_bytes=100)
        await budget.take("p", "t", 8, 0)
        await budget.take("p", "t", 8, 8)  # one Put larger than the budget runs alone: its own bytes don't count
        assert budget.held_bytes(peer="p") == 16 and budget.held_bytes(tenant="t") == 16
        other = asyncio.ensure_future(budget.take("p", "t", 4, 0))  # another Put of that connection waits
        await asyncio.sleep(0)
        assert not other.done() and budget.num_waited == 1
        await budget.take("q", "t", 4, 0)  # another connection has its own budget (the tenant's is not full)
        budget.release("p", "t", 16)
        await other
        assert budget.held_bytes(peer="p") == 4
        cancelled = asyncio.ensure_future(budget.take("q", "u", 200, 0))
        await cancelled  # the tenant "u" holds nothing: through at once, however large
        budget.release("q", "u", 200)
        budget.release("p", "t", 4)
        budget.release("q", "t", 4)
        assert budget.held_bytes() == 0 and budget._held == {}

    asyncio.run(scenario())


def test_budgets_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PutBudget(1, 0)


def _stalled_put(ns: Namespace, block_hash: bytes, block: bytes, hold: queue.SimpleQueue[None]) -> Iterator[bytes]:
    """A Put stream that sends its namespace and the first chunk of one block, then stops until ``hold`` yields."""
    messages = put_requests(ns, [block_hash], [block], 256 << 10)
    yield next(messages)
    hold.get()


@pytest.mark.slow
def test_stalled_puts_keep_the_node_within_its_put_budget_while_another_connection_puts() -> None:
    ns, good_ns = Namespace("stalled-puts"), Namespace("good-puts")
    hashes, tensors = kv_blocks(ns, 8, num_layers=8, num_kv_heads=8, head_dim=128)  # 8 blocks of 512 KiB
    blocks = [encode_block(t) for t in tensors]
    server = ThreadedServer(make_config(**{"limits.connection_put_bytes": 2 * len(blocks[0])}))  # two blocks
    budget = server.server.service.puts
    good_hashes, good_tensors = kv_blocks(good_ns, 4, num_layers=8, num_kv_heads=8, head_dim=128)
    hold: queue.SimpleQueue[None] = queue.SimpleQueue()
    channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
    put = channel.stream_unary(PUT_METHOD, request_serializer=identity, response_deserializer=pb.PutResponse.FromString)
    try:
        calls = [put.future(_stalled_put(ns, h, b, hold), timeout=120) for h, b in zip(hashes, blocks)]
        wait_until(lambda: budget.num_waited >= 6, 60, "every stalled Put past the budget waiting before it reads on")
        assert budget.held_bytes() == 2 * len(blocks[0])  # the budget's two blocks, none of the waiting ones
        with KVStoreClient(server.target, timeout_s=60, retries=0, shared_memory=False, bulk=False) as kv:
            assert kv.put(good_ns, good_hashes, good_tensors) == 4  # another connection is served meanwhile
        for call in calls:
            call.cancel()
        wait_until(lambda: budget.held_bytes() == 0, 30, "every stalled Put's bytes released")
        waits = budget.waits
        wait_until(lambda: waits.admitted + waits.abandoned == budget.num_waited, 30, "every wait ended and timed")
        samples = scrape(server)
        assert samples['kvstore_put_budget_waits_total{outcome="admitted"}'] == waits.admitted
        assert samples['kvstore_put_budget_waits_total{outcome="abandoned"}'] == waits.abandoned
        assert samples["kvstore_put_budget_wait_seconds_count"] == budget.num_waited >= 6
        assert samples["kvstore_put_budget_held_bytes"] == 0
        for _ in calls:
            hold.put(None)
    finally:
        channel.close()
        server.stop()
