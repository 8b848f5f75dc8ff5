"""End to end through a real gRPC server: the client API, chunking, health, reflection, metrics, shutdown."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.api import BlockClient, LookupResult
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.errors import UnavailableError
from kvstore.wire import chunk_bytes_for, namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from tests.support.server import MiB, ThreadedServer, encoded, finished_calls, kv_blocks, make_config, namespace, scrape


def test_put_lookup_get_delete_clear_stats_end_to_end(client: KVStoreClient) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)

    assert isinstance(client, BlockClient)
    assert client.lookup(ns, hashes) == LookupResult(0, ())
    assert client.put(ns, hashes[:3], tensors[:3], priority=80, retention_s=60) == 3
    assert client.put(ns, hashes[:3], tensors[:3]) == 0  # already stored: a no-op
    assert client.lookup(ns, hashes) == LookupResult(3, ("memory",) * 3)

    got = client.get_tensors(ns, hashes)  # prefix semantics: stops at the first miss
    assert len(got) == 3
    for sent, received in zip(tensors, got):
        assert torch.equal(sent, received)
    assert client.get(ns, hashes[:2]) == encoded(ns, tensors[:2])
    assert client.get(ns, hashes[3:]) == []

    assert client.delete(ns, hashes[1:2]) == 1
    assert client.lookup(ns, hashes).num_blocks == 1  # the hole ends the prefix
    stats = client.stats()
    assert stats.tier("memory").blocks >= 2
    assert stats.tier("memory").hits >= 5
    assert client.clear(ns) == 2
    assert client.lookup(ns, hashes).num_blocks == 0


def test_a_get_sends_its_last_message_with_the_status_and_a_miss_as_one_empty_message(
        stub: pb_grpc.KVStoreStub, client: KVStoreClient) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    client.put(ns, hashes[:2], tensors[:2])
    request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes)
    chunks = list(stub.Get(request))
    assert [c.data for c in chunks] == encoded(ns, tensors[:2])  # both blocks, though the last went with the status
    missed = list(stub.Get(pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes[2:])))
    assert missed == [pb.BlockChunk()] and missed[0].ByteSize() == 0  # nothing cached: one empty chunk, no block
    assert client.get(ns, hashes[2:]) == []


def test_namespaces_are_isolated(client: KVStoreClient) -> None:
    ns = namespace()
    other = namespace(model=ns.model, cache_salt="tenant-b")
    hashes, tensors = kv_blocks(ns, 2)
    client.put(ns, hashes, tensors)
    assert client.lookup(other, hashes).num_blocks == 0
    assert client.get(other, hashes) == []


def test_mla_layout_and_sha256_round_trip(client: KVStoreClient) -> None:
    ns = namespace(layout="mla", dtype="bfloat16", block_size=8, hash_algorithm="sha256")
    hashes = [bytes([i]) * 32 for i in range(2)]
    tensors = [torch.randn(3, 1, 8, 32).to(torch.bfloat16) for _ in hashes]
    assert client.put(ns, hashes, tensors) == 2
    for sent, received in zip(tensors, client.get_tensors(ns, hashes)):
        assert torch.equal(sent, received)


@pytest.mark.parametrize(
    "payload_bytes",
    [
        12 * MiB,  # several chunks
        4 * MiB + 1 - 64,  # encoded 4 MiB + 1 byte: just over one message
        chunk_bytes_for(4 * MiB) - 64,  # exactly one chunk
        chunk_bytes_for(4 * MiB) - 64 + 1,  # one chunk and one byte
    ],
    ids=["12MiB", "4MiB+1", "one-chunk", "one-chunk+1"],
)
@pytest.mark.slow
def test_large_blocks_round_trip_in_chunks(client: KVStoreClient, payload_bytes: int) -> None:
    # mla with block_size 1 and uint8 admits any payload size; its header is 64 bytes
    ns = namespace(layout="mla", dtype="uint8", block_size=1)
    hashes = [bytes([7]) * 16, bytes([8]) * 16]
    generator = torch.Generator().manual_seed(payload_bytes)
    tensors = [torch.randint(0, 256, (1, 1, 1, payload_bytes), dtype=torch.uint8, generator=generator)
               for _ in hashes]
    blocks = encoded(ns, tensors)
    assert len(blocks[0]) == payload_bytes + 64
    assert client.put(ns, hashes, blocks) == 2
    assert client.get(ns, hashes) == blocks
    client.delete(ns, hashes)


@pytest.mark.slow
def test_kv_block_of_12_mib_round_trips(client: KVStoreClient) -> None:
    ns = namespace()
    hashes, _ = kv_blocks(ns, 1)
    tensor = torch.randn(4, 2, 8, 16, 6144).to(torch.float16)  # 12 MiB of payload
    assert tensor.numel() * 2 == 12 * MiB
    assert client.put(ns, hashes, [tensor]) == 1
    (received,) = client.get_tensors(ns, hashes)
    assert torch.equal(received, tensor)
    client.delete(ns, hashes)


def test_get_stream_is_chunked_below_max_message(stub: pb_grpc.KVStoreStub, client: KVStoreClient) -> None:
    ns = namespace(layout="mla", dtype="uint8", block_size=1)
    block = encoded(ns, [torch.zeros(1, 1, 1, 9 * MiB, dtype=torch.uint8)])[0]
    client.put(ns, [b"\x01" * 16], [block])
    chunks = list(stub.Get(pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=[b"\x01" * 16])))
    assert len(chunks) == 3
    assert [c.offset for c in chunks] == [0, chunk_bytes_for(4 * MiB), 2 * chunk_bytes_for(4 * MiB)]
    assert [c.last for c in chunks] == [False, False, True]
    assert all(c.total_bytes == len(block) for c in chunks)
    assert b"".join(c.data for c in chunks) == block


@pytest.mark.slow
def test_cancelled_get_leaves_no_lease_behind() -> None:
    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": "8MiB"}))
    try:
        ns = namespace()
        with KVStoreClient(server.target, retries=0) as kv:
            old, old_tensors = kv_blocks(ns, 6, num_layers=4, num_kv_heads=8, head_dim=512)  # 1 MiB each
            assert kv.put(ns, old, old_tensors) == 6
            channel = grpc.insecure_channel(server.target)
            stub = pb_grpc.KVStoreStub(channel)
            request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=old)
            for read_first in (False, True, True):
                stream = stub.Get(request)
                if read_first:
                    next(stream)
                stream.cancel()
                with pytest.raises(grpc.RpcError) as info:
                    list(stream)
                assert info.value.code() == grpc.StatusCode.CANCELLED
            channel.close()
            # eviction may now take every old block: 8 new ones need the whole tier
            new, new_tensors = kv_blocks(ns, 7, num_layers=4, num_kv_heads=8, head_dim=512, first_token=10_000)
            assert kv.put(ns, new, new_tensors) == 7
            assert kv.lookup(ns, old).num_blocks == 0
            assert kv.lookup(ns, new).num_blocks == 7
    finally:
        server.stop()


@pytest.mark.slow
def test_a_stream_over_max_stream_s_ends_with_deadline_exceeded_and_frees_its_blocks() -> None:
    """A stalled reader with no deadline held its Get's leases for ever: nothing else could be stored."""
    from kvstore.blocks.tensors import encode_block

    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": "64MiB", "limits.max_stream_s": 1.0}))
    try:
        ns = namespace(layout="mla", dtype="uint8", block_size=1)
        old = [bytes([i]) * 16 for i in range(1, 5)]
        blocks = [encode_block(torch.full((1, 1, 1, 12 * MiB), i, dtype=torch.uint8), "mla") for i in range(4)]
        with KVStoreClient(server.target, retries=0, timeout_s=60) as kv:
            assert kv.put(ns, old, blocks) == 4
            channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 4 * MiB),
                                                                ("grpc.http2.bdp_probe", 0)])
            stream = pb_grpc.KVStoreStub(channel).Get(pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=old))
            next(stream)  # then stall: the server blocks in context.write, its leases held
            # the watchdog ends the call after max_stream_s (real time: the node is real); wait for its count
            assert finished_calls(server, "Get", 1, code="DEADLINE_EXCEEDED") == 1
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "max_stream_s" in info.value.details()
            channel.close()
            new = [bytes([i]) * 16 for i in range(11, 15)]  # needs the room of the old blocks
            assert kv.put(ns, new, blocks) == 4
            assert kv.lookup(ns, new).num_blocks == 4
    finally:
        server.stop()


def test_a_get_whose_last_message_stalls_keeps_its_in_flight_slot_until_it_is_read() -> None:
    """The last message leaves with the status, after the handler returned: a reader that stops still holds a slot."""
    from kvstore.blocks.tensors import encode_block

    server = ThreadedServer(make_config(**{"limits.max_inflight_per_connection": 2}))
    try:
        ns = namespace(layout="mla", dtype="uint8", block_size=1)
        block = encode_block(torch.full((1, 1, 1, 3 * MiB), 7, dtype=torch.uint8), "mla")  # one message
        with KVStoreClient(server.target, retries=0, timeout_s=60) as kv:
            assert kv.put(ns, [b"\x01" * 16], [block]) == 1
        # no BDP probe and a small look-ahead: the windows stay small, so a reply of 3 MiB waits for its reader
        channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 4 * MiB),
                                                            ("grpc.http2.bdp_probe", 0),
                                                            ("grpc.http2.lookahead_bytes", 64 * 1024)])
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=[b"\x01" * 16])
        stalled = [stub.Get(request, timeout=30) for _ in range(2)]  # sent, never read yet
        inflight = server.server.service.admission.inflight
        for _ in range(100):  # a fresh channel may start them after the first probe below: wait until they hold
            if sum(inflight.snapshot().values()) == 2:  # both slots (else the probes fit in and never fail)
                break
            threading.Event().wait(0.02)
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(50):  # until both stalled calls have reached the node and hold its slots
                list(stub.Get(request, timeout=30))
                threading.Event().wait(0.05)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in stalled:  # read them: their calls end, and the slots come back
            assert [c.data for c in stream] == [block]
        for _ in range(50):
            try:
                assert [c.data for c in stub.Get(request, timeout=30)] == [block]
                break
            except grpc.RpcError as exc:  # the slots come back once the node has seen the calls end
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                threading.Event().wait(0.05)
        else:
            raise AssertionError("the slots never came back")
        channel.close()
    finally:
        server.stop()


def test_health_reports_serving_for_server_and_service(server: ThreadedServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server: ThreadedServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        replies = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvstore.v1.KVStore")]), timeout=10))
        assert replies[0].file_descriptor_response.file_descriptor_proto


def test_metrics_move_with_traffic(fresh_server: ThreadedServer) -> None:
    before = scrape(fresh_server)
    assert before['kvstore_tier_blocks{tier="memory"}'] == 0
    assert before['kvstore_tier_capacity_bytes{tier="memory"}'] == 48 * MiB
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    with KVStoreClient(fresh_server.target, retries=0, shared_memory=False, bulk=False) as kv:  # the gRPC methods' counts
        kv.put(ns, hashes, tensors)
        kv.get(ns, hashes)
        kv.lookup(ns, hashes)
        missing, _ = kv_blocks(ns, 5, first_token=50_000)
        kv.lookup(ns, hashes[:2] + missing[2:])  # 2 blocks in the cached prefix, 3 past it
        with pytest.raises(Exception):
            kv.lookup(ns, hashes * 22)  # over the node's limits.max_hashes_per_request (64): refused by the node
        stats = kv.stats()
    for method, count in (("Put", 1), ("Get", 1), ("Lookup", 2), ("Stats", 1)):  # a success is counted once sent
        finished_calls(fresh_server, method, count)
    after = scrape(fresh_server)
    assert after['kvstore_lookup_blocks_total{result="hit"}'] == 5 == stats.lookup_hit_blocks
    assert after['kvstore_lookup_blocks_total{result="miss"}'] == 3 == stats.lookup_miss_blocks
    assert after['kvstore_requests_total{code="OK",method="Put"}'] == 1
    assert after['kvstore_requests_total{code="OK",method="Get"}'] == 1
    assert after['kvstore_requests_total{code="OK",method="Lookup"}'] == 2
    assert after['kvstore_requests_total{code="INVALID_ARGUMENT",method="Lookup"}'] == 1
    assert after['kvstore_request_duration_seconds_count{method="Put"}'] == 1
    assert after['kvstore_tier_blocks{tier="memory"}'] == 3
    assert after['kvstore_tier_bytes{tier="memory"}'] > 0
    assert after['kvstore_tier_hits_total{tier="memory"}'] == 3
    assert after['kvstore_tier_evictions_total{tier="memory"}'] == 0


def test_new_calls_during_shutdown_are_unavailable(fresh_server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    with KVStoreClient(fresh_server.target, retries=0) as kv:
        kv.put(ns, hashes, tensors)
        fresh_server.call(fresh_server.server.begin_shutdown())
        assert kv.health() == "NOT_SERVING"
        for call in (lambda: kv.lookup(ns, hashes), lambda: kv.get(ns, hashes),
                     lambda: kv.put(ns, hashes, tensors), lambda: kv.stats()):
            with pytest.raises(UnavailableError, match="shutting down"):
                call()
    assert fresh_server.call(fresh_server.server.store.lookup(ns, hashes)).num_blocks == 2


def test_stop_closes_the_store_and_refuses_calls(fresh_server: ThreadedServer) -> None:
    target = fresh_server.target
    store = fresh_server.server.store
    fresh_server.stop()
    with pytest.raises(UnavailableError):
        asyncio.run(store.lookup(namespace(), []))  # the store was closed after the server stopped
    with KVStoreClient(target, retries=0, timeout_s=5) as kv:
        with pytest.raises(UnavailableError):
            kv.health()


async def test_async_client_twin(server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    async with AsyncKVStoreClient(server.target, retries=0) as kv:
        assert isinstance(kv, AsyncKVStoreClient)
        assert await kv.health() == "SERVING"
        assert await kv.put(ns, hashes, tensors) == 3
        results = await asyncio.gather(*(kv.lookup(ns, hashes[:n]) for n in range(1, 4)))
        assert [r.num_blocks for r in results] == [1, 2, 3]
        for sent, received in zip(tensors, await kv.get_tensors(ns, hashes)):
            assert torch.equal(sent, received)
        assert (await kv.stats()).tier("memory").blocks >= 3
        assert await kv.delete(ns, hashes[2:]) == 1
        assert await kv.clear(ns) == 2
        assert await kv.get(ns, hashes) == []


def test_sync_client_is_thread_safe_and_bounded(server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 8)
    errors: list[BaseException] = []
    with KVStoreClient(server.target, retries=0, max_inflight=2) as kv:
        kv.put(ns, hashes, tensors)

        def reader(n: int) -> None:
            try:
                for _ in range(5):
                    got = kv.get_tensors(ns, hashes[: n + 1])
                    assert len(got) == n + 1 and torch.equal(got[-1], tensors[n])
            except BaseException as exc:  # collected and re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
