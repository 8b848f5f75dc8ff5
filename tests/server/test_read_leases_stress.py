"""Robustness of leased reads, the compact Lookup reply and in-servicer admission, against real components.

The Get of the service streams memory-tier blocks as read-only views of the page
pool and holds their leases (policy pins and tier page pins) until the last chunk
is written. These tests stall a reader mid-stream (a raw channel without HTTP/2
BDP probing, so the server is held by flow control after a few chunks) and then
delete, clear, overwrite, evict and promote the same blocks, cancel the stream
or let its deadline pass, and check that every byte received is the byte that
was stored and that nothing stays leased or admitted afterwards.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, Iterator

import grpc
import pytest
import torch

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.config import StoreConfig
from kvstore.error_codes import PermissionDeniedError
from kvstore.keys import block_keys
from kvstore.wire import chunk_bytes_for, decode_block_chunk, namespace_to_pb, put_requests
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.v1 import kvstore_pb2 as pb
from tests.support.security import TOKEN_A, TOKEN_B, auth_config, client_of, sha_namespace
from tests.support.server import MiB, ThreadedServer, make_config, namespace
from tests.support.store import NS, disk_footprint, held_keys, make_blocks, memory_tier

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

MESSAGE = MiB
"""``server.max_message_bytes`` of these tests: a 3 MiB block is 4 chunks."""
BLOCK = 3 * MiB
NUM_STREAMED = 6


def mla_block(nbytes: int, fill: int) -> bytes:
    """An encoded ``uint8`` MLA block of ``nbytes`` payload bytes, all ``fill``."""
    return encode_block(torch.full((1, 1, 1, nbytes), fill, dtype=torch.uint8), "mla")


def uint8_namespace() -> Any:
    return namespace(layout="mla", dtype="uint8", block_size=1)


def hashes_of(first: int, count: int) -> list[bytes]:
    return [i.to_bytes(2, "little") * 8 for i in range(first, first + count)]


def server_of(**overrides: Any) -> ThreadedServer:
    """A server whose memory tier is the page pool: these tests follow its leases (the heap tier lends references)."""
    return ThreadedServer(make_config(**{"server.max_message_bytes": MESSAGE, "store.memory.storage": "pages",
                                         **overrides}))


def raw_channel(target: str) -> grpc.Channel:
    """A channel whose receive window stays small (no BDP probing), so a reader that stops reading stalls the server."""
    return grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", MESSAGE),
                                                  ("grpc.max_send_message_length", MESSAGE),
                                                  ("grpc.http2.bdp_probe", 0)])


def raw_get(channel: grpc.Channel, ns: Any, hashes: list[bytes], timeout: float | None = None) -> Any:
    get = channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
                               response_deserializer=lambda b: b)
    return get(pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes), timeout=timeout)


def reassemble(messages: list[bytes]) -> list[bytes]:
    """The blocks of a Get reply from its serialized chunks."""
    blocks: list[list[bytes]] = []
    for raw in messages:
        if not raw:  # an empty chunk carries no block (a miss)
            continue
        chunk, data = decode_block_chunk(raw)
        if chunk.offset == 0:  # blocks come in request order, each from offset 0
            blocks.append([])
        blocks[-1].append(bytes(data))
    return [b"".join(parts) for parts in blocks]


def on_loop(server: ThreadedServer, fn: Any) -> Any:
    async def run() -> Any:
        return fn()
    return server.call(run())


def tier_leases(server: ThreadedServer) -> tuple[dict[int, int], dict[int, bytes]]:
    """The memory tier's pinned records and its deleted-but-pinned records."""
    memory = server.server.store.tiers[0]
    return on_loop(server, lambda: (dict(memory._readers), dict(memory._unpublished)))


def policy_pins(server: ThreadedServer) -> list[set[bytes]]:
    """Per local tier, the keys some read or copy holds a reference on."""
    return on_loop(server, lambda: held_keys(server.server.store))


def inflight(server: ThreadedServer) -> dict[str, int]:
    return on_loop(server, lambda: server.server.admission.inflight.snapshot())


def wait_until(predicate: Any, timeout_s: float = 2.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passed: the node's leases and slots (on its loop) end
    when gRPC is done with a call, which offers nothing to wait on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def stall(channel: grpc.Channel, server: ThreadedServer, ns: Any, hashes: list[bytes],
          timeout: float | None = None) -> tuple[Any, bytes]:
    """Start a Get, read its first chunk and stop reading; returns the stream once the server holds its leases."""
    stream = raw_get(channel, ns, hashes, timeout)
    first = next(stream)
    assert tier_leases(server)[0], "the stream should hold its leases while the reader is stalled"
    return stream, first


def leases_released(server: ThreadedServer) -> bool:
    readers, unpublished = tier_leases(server)
    return not readers and not unpublished


# ---------------------------------------------------------------------- Get streams vs. writers


def test_a_stalled_stream_survives_delete_and_new_puts_and_frees_its_pages_after() -> None:
    server = server_of(**{"store.memory.capacity_bytes": "40MiB"})
    try:
        ns = uint8_namespace()
        streamed, others = hashes_of(1, NUM_STREAMED), hashes_of(100, NUM_STREAMED)
        blocks = [mla_block(BLOCK, i) for i in range(NUM_STREAMED)]
        new_blocks = [mla_block(BLOCK, 0xA0 + i) for i in range(NUM_STREAMED)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            assert kv.put(ns, streamed, blocks) == NUM_STREAMED
            stream, first = stall(channel, server, ns, streamed)
            assert kv.delete(ns, streamed) == NUM_STREAMED       # unpublished now, pages still pinned
            assert kv.lookup(ns, streamed).num_blocks == 0
            assert kv.put(ns, others, new_blocks) == NUM_STREAMED  # must not take the pinned pages
            assert len(tier_leases(server)[1]) == NUM_STREAMED
            assert reassemble([first, *stream]) == blocks
            assert wait_until(lambda: leases_released(server))
            assert kv.get(ns, others) == new_blocks
            # the streamed blocks' pages are free again: a second batch of the same size fits beside `others`
            again = hashes_of(200, NUM_STREAMED)
            assert kv.put(ns, again, blocks) == NUM_STREAMED
            assert kv.get(ns, again) == blocks
        assert all(not pins for pins in policy_pins(server))
    finally:
        server.stop()


def test_a_stalled_stream_survives_clear_and_a_put_of_its_keys_with_other_bytes() -> None:
    server = server_of(**{"store.memory.capacity_bytes": "40MiB"})
    try:
        ns = uint8_namespace()
        streamed = hashes_of(1, NUM_STREAMED)
        blocks = [mla_block(BLOCK, i) for i in range(NUM_STREAMED)]
        replacements = [mla_block(BLOCK, 0xF0 - i) for i in range(NUM_STREAMED)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, streamed, blocks)
            stream, first = stall(channel, server, ns, streamed)
            assert kv.clear(ns) == NUM_STREAMED
            assert kv.put(ns, streamed, replacements) == NUM_STREAMED  # same keys, new records, new pages
            second = raw_get(channel, ns, streamed)  # on the same connection: the new bytes
            assert reassemble([first, *stream]) == blocks
            assert reassemble(list(second)) == replacements
            assert wait_until(lambda: leases_released(server))
            assert kv.get(ns, streamed) == replacements
    finally:
        server.stop()


def test_a_stalled_get_of_ready_replies_survives_delete_eviction_and_new_bytes(tmp_path: Any) -> None:
    """The heap tier lends by reference: a Get's blocks stay whole, though they may go from the tier meanwhile."""
    small = MESSAGE // 2  # one message each: stored as ready replies
    server = ThreadedServer(make_config(**{"server.max_message_bytes": MESSAGE,
                                           "store.memory.capacity_bytes": 8 * (small + 64),
                                           "store.memory.storage": "heap",
                                           "store.disk.path": str(tmp_path / "disk")}))
    try:
        assert type(server.server.store.tiers[0]).__name__ == "HeapTier"
        ns = uint8_namespace()
        streamed, pressure = hashes_of(1, 4), hashes_of(100, 8)
        blocks = [mla_block(small, i) for i in range(4)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, streamed, blocks)
            stream = raw_get(channel, ns, streamed)
            first = next(stream)  # the rest waits in the node, as ready replies it holds by reference
            assert kv.delete(ns, streamed[:2]) == 2
            assert kv.put(ns, streamed[:2], [mla_block(small, 0xA0), mla_block(small, 0xA1)]) == 2
            # a tier's worth of new blocks: the unpinned streamed ones are demoted to disk meanwhile
            assert kv.put(ns, pressure, [mla_block(small, 0x50 + i) for i in range(8)]) == 8
            assert "disk" in kv.lookup(ns, streamed).tiers
            assert reassemble([first, *stream]) == blocks  # the bytes as they were when the Get began
            assert kv.get(ns, streamed) == [mla_block(small, 0xA0), mla_block(small, 0xA1), *blocks[2:]]
        server.call(server.server.store.drain())  # that Get's promotions from disk hold pins while they copy
        assert all(not pins for pins in policy_pins(server))
    finally:
        server.stop()


def test_eviction_pressure_during_a_stream_spares_the_streamed_blocks(tmp_path: Any) -> None:
    server = server_of(**{"store.memory.capacity_bytes": "32MiB", "store.disk.path": str(tmp_path / "disk"),
                          "store.disk.capacity_bytes": "128MiB"})
    try:
        ns = uint8_namespace()
        streamed, idle, pressure = hashes_of(1, NUM_STREAMED), hashes_of(100, 2), hashes_of(200, 3)
        blocks = [mla_block(BLOCK, i) for i in range(NUM_STREAMED)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, streamed, blocks)
            kv.put(ns, idle, [mla_block(BLOCK, 0x40), mla_block(BLOCK, 0x41)])
            stream, first = stall(channel, server, ns, streamed)
            # room is made by demoting the idle blocks, never the leased ones
            assert kv.put(ns, pressure, [mla_block(BLOCK, 0x50 + i) for i in range(3)]) == 3
            assert kv.lookup(ns, idle).num_blocks == 2 and "disk" in kv.lookup(ns, idle).tiers
            assert kv.lookup(ns, streamed).tiers == ("memory",) * NUM_STREAMED
            # more than the unleased rest of the tier: what memory cannot take goes to the disk tier, not refused
            # (issue 32: refuse a put only when no tier can take it), and the leased blocks stay where they are
            too_big = hashes_of(300, 5)
            assert kv.put(ns, too_big, [mla_block(BLOCK, 0x60 + i) for i in range(5)]) == 5
            assert kv.lookup(ns, too_big).num_blocks == 5 and "disk" in kv.lookup(ns, too_big).tiers
            assert kv.lookup(ns, streamed).tiers == ("memory",) * NUM_STREAMED
            assert reassemble([first, *stream]) == blocks
            assert wait_until(lambda: leases_released(server))
            assert kv.get(ns, streamed) == blocks
            assert kv.get(ns, idle) == [mla_block(BLOCK, 0x40), mla_block(BLOCK, 0x41)]
    finally:
        server.stop()


def test_disk_blocks_streamed_while_another_get_promotes_them(tmp_path: Any) -> None:
    server = server_of(**{"store.memory.capacity_bytes": "24MiB", "store.disk.path": str(tmp_path / "disk"),
                          "store.disk.capacity_bytes": "128MiB"})
    try:
        ns = uint8_namespace()
        cold, hot = hashes_of(1, 4), hashes_of(100, 7)
        cold_blocks = [mla_block(BLOCK, i) for i in range(4)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, cold, cold_blocks)
            kv.put(ns, hot, [mla_block(BLOCK, 0x80 + i) for i in range(7)])  # pushes every cold block down
            assert kv.lookup(ns, cold).tiers == ("disk",) * 4
            stream = raw_get(channel, ns, cold)  # disk hits: copies, pinned in the disk policy
            first = next(stream)
            assert kv.get(ns, cold) == cold_blocks  # a second reader; its promotion moves them up
            assert wait_until(lambda: kv.lookup(ns, cold).tiers == ("memory",) * 4)
            assert kv.delete(ns, cold) == 4  # and away, while the first stream is still stalled
            assert reassemble([first, *stream]) == cold_blocks
            assert wait_until(lambda: leases_released(server))
            server.call(server.server.store.drain())
            assert kv.lookup(ns, cold).num_blocks == 0  # the stalled stream's promotion did not revive them
    finally:
        server.stop()


# ---------------------------------------------------------------------- cancellation, deadlines, admission


def test_cancelled_and_expired_streams_release_leases_and_slots() -> None:
    server = server_of(**{"store.memory.capacity_bytes": "40MiB", "limits.max_inflight_per_connection": 2})
    try:
        ns = uint8_namespace()
        streamed = hashes_of(1, NUM_STREAMED)
        blocks = [mla_block(BLOCK, i) for i in range(NUM_STREAMED)]
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, streamed, blocks)
            for _ in range(2):
                stream, _ = stall(channel, server, ns, streamed)
                stream.cancel()
                with pytest.raises(grpc.RpcError) as info:
                    list(stream)
                assert info.value.code() == grpc.StatusCode.CANCELLED
                stream, _ = stall(channel, server, ns, streamed, timeout=0.2)
                assert stream.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # waits for the call's end: the deadline
                # passes while the reader is stalled
                with pytest.raises(grpc.RpcError) as info:
                    list(stream)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_until(lambda: leases_released(server) and not inflight(server))
            assert all(not pins for pins in policy_pins(server))
            # the connection still has both of its slots, and the whole tier can be replaced
            one, two = raw_get(channel, ns, streamed), raw_get(channel, ns, streamed)
            assert reassemble(list(one)) == blocks and reassemble(list(two)) == blocks
            assert kv.clear(ns) == NUM_STREAMED
            assert wait_until(lambda: leases_released(server))
            fresh = hashes_of(50, 12)
            assert kv.put(ns, fresh, [mla_block(BLOCK, 7)] * 12) == 12
    finally:
        server.stop()


def test_failed_and_refused_calls_never_leak_an_inflight_slot() -> None:
    server = server_of(**{"store.memory.capacity_bytes": "40MiB", "limits.max_inflight_per_connection": 2,
                          "store.max_block_bytes": 4 * MiB})
    try:
        ns = uint8_namespace()
        streamed = hashes_of(1, NUM_STREAMED)
        blocks = [mla_block(BLOCK, i) for i in range(NUM_STREAMED)]
        chunk = chunk_bytes_for(MESSAGE)
        with KVStoreClient(server.target, retries=0, max_message_bytes=MESSAGE) as kv, \
                raw_channel(server.target) as channel:
            kv.put(ns, streamed, blocks)
            lookup = channel.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=lambda b: b,
                                         response_deserializer=pb.LookupResponse.FromString)
            put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                                       response_deserializer=pb.PutResponse.FromString)
            corrupt = bytearray(blocks[0])
            corrupt[-1] ^= 1

            def aborted_by_the_client() -> Iterator[bytes]:
                requests = put_requests(ns, hashes_of(400, 1), blocks[:1], chunk)
                yield next(requests)
                raise RuntimeError("the client gives up mid-stream")

            failures = [
                (lambda: lookup(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT),
                (lambda: lookup(pb.LookupRequest(namespace=pb.Namespace(model="")).SerializeToString()),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (lambda: put(put_requests(ns, hashes_of(300, 1), [mla_block(5 * MiB, 1)], chunk)),
                 grpc.StatusCode.RESOURCE_EXHAUSTED),
                (lambda: put(put_requests(ns, hashes_of(301, 1), [bytes(corrupt)], chunk)),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (lambda: put(aborted_by_the_client()), None),
            ]
            for _ in range(3):
                for call, code in failures:
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    if code is not None:
                        assert info.value.code() == code
                # a Put cancelled while the server waits for its next message
                release = threading.Event()

                def stalled_put() -> Iterator[bytes]:
                    requests = put_requests(ns, hashes_of(500, 1), blocks[:1], chunk)
                    yield next(requests)
                    release.wait(5)

                future = put.future(stalled_put())
                assert wait_until(lambda: bool(inflight(server)))
                future.cancel()
                release.set()
            assert wait_until(lambda: not inflight(server))
            # both slots free: two stalled streams fill them, a third call is refused and counted
            first, _ = stall(channel, server, ns, streamed)
            second = raw_get(channel, ns, streamed)
            next(second)
            request = pb.LookupRequest(namespace=namespace_to_pb(ns), block_hashes=streamed).SerializeToString()
            with pytest.raises(grpc.RpcError) as info:
                lookup(request)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            second.cancel()
            assert wait_until(lambda: not inflight(server) and leases_released(server))
            assert lookup(request).num_blocks == NUM_STREAMED
            assert kv.lookup(ns, hashes_of(300, 2) + hashes_of(400, 1) + hashes_of(500, 1)).num_blocks == 0
        samples = {(s.labels["method"], s.labels["code"]): s.value
                   for metric in server.server.metrics.registry.collect() if metric.name == "kvstore_requests"
                   for s in metric.samples if s.name == "kvstore_requests_total"}
        assert samples[("Lookup", "RESOURCE_EXHAUSTED")] == 1
        assert samples[("Lookup", "INVALID_ARGUMENT")] == 6
        assert samples[("Put", "RESOURCE_EXHAUSTED")] == 3
    finally:
        server.stop()


def test_the_namespace_cache_never_skips_the_tenant_or_hash_checks() -> None:
    server = ThreadedServer(auth_config())
    try:
        ns_a = sha_namespace("tenant-a")
        hashes = [bytes([i]) * 32 for i in range(1, 3)]
        with client_of(server, TOKEN_A) as kv_a, client_of(server, TOKEN_B) as kv_b:
            kv_a.put(ns_a, hashes, [encode_block(torch.zeros(2, 2, 2, 16, 8, dtype=torch.float16))] * 2)
            for _ in range(3):  # cached by now: still tenant A's only
                assert kv_a.lookup(ns_a, hashes).num_blocks == 2
                with pytest.raises(PermissionDeniedError):
                    kv_b.lookup(ns_a, hashes)
                with pytest.raises(PermissionDeniedError):
                    kv_b.get(ns_a, hashes)
            assert inflight(server) == {}
    finally:
        server.stop()


# ---------------------------------------------------------------------- clients and the compact Lookup


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[ThreadedServer]]:
    servers = [server_of(**{"store.memory.capacity_bytes": "24MiB"}) for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


def test_multi_node_get_merges_views_and_joined_blocks_in_order(nodes: list[ThreadedServer]) -> None:
    ns = uint8_namespace()
    chunk = chunk_bytes_for(MESSAGE)
    header = len(mla_block(0, 0))
    sizes = [100, 2 * MiB, chunk - header, chunk - header + 1, 10, BLOCK, 1, MiB // 2, 5 * MiB // 2, 64]
    hashes = hashes_of(1, len(sizes))
    blocks = [mla_block(n, i) for i, n in enumerate(sizes)]
    with KVStoreClient([n.target for n in nodes], retries=0, max_message_bytes=MESSAGE, shared_memory=False, bulk=False) as kv:
        # one put per block: blocks of different shapes never share a put (one namespace, one shape)
        assert sum(kv.put(ns, [h], [b]) for h, b in zip(hashes, blocks)) == len(blocks)
        got = kv.get(ns, hashes)
        assert got == blocks
        assert [type(b) for b in got] == [memoryview if len(b) <= chunk else bytes for b in blocks]
        assert all(b.readonly for b in got if isinstance(b, memoryview))
        copies = [bytes(b) for b in got]
        kv.delete(ns, hashes)  # later calls (and the server's page reuse) leave the received views alone
        for h, n in zip(hashes, sizes):
            kv.put(ns, [h], [mla_block(n, 0xEE)])
        kv.get(ns, hashes)
        assert [bytes(b) for b in got] == copies
        kv.delete(ns, hashes[4:5])
        assert kv.lookup(ns, hashes).num_blocks == 4
        assert len(kv.get(ns, hashes)) == 4

    async def twin() -> None:
        async with AsyncKVStoreClient([n.target for n in nodes], retries=0, max_message_bytes=MESSAGE) as akv:
            results = await asyncio.gather(*(akv.get(ns, hashes[i:4]) for i in range(4)))
            for i, result in enumerate(results):
                assert [bytes(b) for b in result] == [mla_block(n, 0xEE) for n in sizes[i:4]]

    asyncio.run(twin())


def _oracle(store: TieredStore, hashes: list[bytes]) -> bytes:
    levels = bytearray()
    for key in block_keys(NS, hashes):
        level = next((i for i, policy in enumerate(store.index.policies) if key in policy), None)
        if level is None:
            break
        levels.append(level)
    return bytes(levels)


@pytest.mark.parametrize("seed", range(3))
async def test_locate_and_read_agree_with_the_policies_under_mixed_priorities(tmp_path: Any, seed: int) -> None:
    rng = random.Random(seed)
    config = StoreConfig(promote_on_hit=False, demote_min_priority=0)
    disk = LMDBTier(tmp_path / "disk", 16 * disk_footprint())
    async with TieredStore([memory_tier(3), disk], config) as store:
        hashes, blocks = make_blocks(12, seed=seed)
        assert await store.locate(NS, []) == b""
        for step in range(40):
            i = rng.randrange(12)
            j = min(12, i + rng.randrange(1, 4))
            if rng.random() < 0.6:
                await store.put(NS, hashes[i:j], blocks[i:j], priority=rng.choice([None, 10, 35, 80]))
            else:
                async with store.read(NS, hashes[i:]) as got:
                    assert [bytes(b) for b in got] == blocks[i:i + len(got)]
                    assert len(got) == len(_oracle(store, hashes[i:]))
            for start in (0, i, rng.randrange(12)):
                located = await store.locate(NS, hashes[start:])
                assert located == _oracle(store, hashes[start:]), (step, start)
                result = await store.lookup(NS, hashes[start:])
                assert result.tiers == tuple(store.tier_names[level] for level in located)
        misses, _ = make_blocks(1, seed=99)
        assert await store.locate(NS, misses + hashes) == b""  # block 0 misses: nothing, whatever follows


# ---------------------------------------------------------------------- the store and the memory tier


async def test_reads_keep_their_views_while_writers_delete_and_rewrite_the_same_keys() -> None:
    rng = random.Random(7)
    async with TieredStore([MemoryTier(64 * 8192, page_bytes=4096)]) as store:
        hashes, versions = make_blocks(8, seed=1)
        _, second = make_blocks(8, seed=2)
        current = dict(zip(hashes, versions))
        await store.put(NS, hashes, versions)

        async def reader() -> None:
            for _ in range(30):
                start = rng.randrange(8)
                async with store.read(NS, hashes[start:]) as got:
                    expected = [bytes(current[h]) for h in hashes[start:start + len(got)]]
                    for _ in range(rng.randrange(1, 4)):
                        await asyncio.sleep(0)
                    assert [bytes(b) for b in got] == expected

        async def writer(parity: int) -> None:  # disjoint keys: concurrent puts of one key store one value
            for _ in range(60):
                i = rng.randrange(4) * 2 + parity
                await store.delete(NS, hashes[i:i + 1])
                await asyncio.sleep(0)
                value = second[i] if current[hashes[i]] is versions[i] else versions[i]
                current[hashes[i]] = value
                await store.put(NS, hashes[i:i + 1], [value])
                await asyncio.sleep(0)

        await asyncio.gather(*(reader() for _ in range(4)), writer(0), writer(1))
        memory = store.tiers[0]
        assert memory._readers == {} and memory._unpublished == {}
        assert held_keys(store) == [set()] and store.index.num_entries() == 0
        assert memory.num_free_pages == memory.num_pages - 8 * 2  # every deleted version's pages came back
        assert await store.get(NS, hashes) == [current[h] for h in hashes]


async def test_a_lease_outlives_the_tier_close_and_releases_cleanly() -> None:
    tier = MemoryTier(16 * 4096, page_bytes=4096)
    hashes, blocks = make_blocks(2)
    keys = block_keys(NS, hashes)
    await tier.put(keys, blocks, [BlockMeta()] * 2)
    lease = tier.lend(keys)
    await tier.close()
    assert [bytes(v) for v in lease.values] == blocks  # the pool stays alive for the views
    lease.release()
    lease.release()  # a second release releases nothing
    assert tier._readers == {}
