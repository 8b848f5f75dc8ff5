"""Round trips through the same-host data plane are byte-identical to gRPC's, for every dtype and layout."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
import torch

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.blocks.tensors import DTYPES, Layout, encode_block
from kvstore.errors import DestinationMismatchError, InvalidArgumentError
from kvstore.keys import Namespace, hash_blocks
from tests.support.server import ThreadedServer, finished_calls, make_config, namespace
from tests.support.shm import open_segments
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(make_config())
    yield threaded
    threaded.stop()


@pytest.fixture(scope="module")
def shm(server: ThreadedServer) -> Iterator[KVStoreClient]:
    with KVStoreClient(server.target, retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server: ThreadedServer) -> Iterator[KVStoreClient]:
    with KVStoreClient(server.target, retries=0, shared_memory=False, bulk=False) as client:
        yield client


def random_blocks(ns: Namespace, num_blocks: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (3, 2, 2, ns.block_size, 24) if ns.layout == "kv" else (3, 1, ns.block_size, 40)
    dtype = getattr(torch, ns.dtype)
    if dtype in (torch.int8, torch.uint8):
        low = -128 if dtype is torch.int8 else 0
        return [torch.randint(low, low + 256, shape, generator=generator, dtype=torch.int16).to(dtype)
                for _ in range(num_blocks)]
    return [(torch.randn(shape, generator=generator) * 3).to(dtype) for _ in range(num_blocks)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", [layout.value for layout in Layout])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_and_layout_round_trips_bit_for_bit_both_ways(shm: KVStoreClient, grpc_client: KVStoreClient,
                                                                 dtype: str, layout: str) -> None:
    assert shm.shared_memory() in (("attached",), ("unknown",))
    for writer, reader in ((shm, grpc_client), (grpc_client, shm), (shm, shm)):
        ns = namespace(dtype=dtype, layout=layout, block_size=8)
        hashes = hash_blocks(ns, list(range(5 * 8)))
        tensors = random_blocks(ns, len(hashes), seed=len(dtype))
        assert writer.put(ns, hashes, tensors) == 5
        expected = [encode_block(t, layout) for t in tensors]
        assert [bytes(b) for b in reader.get(ns, hashes)] == expected == [bytes(b) for b in grpc_client.get(ns, hashes)]
        assert all(same_bits(a, b) for a, b in zip(reader.get_tensors(ns, hashes), tensors))
        destinations = [torch.full_like(t, 0) for t in tensors]
        assert reader.get_into(ns, hashes, destinations) == 5
        assert all(same_bits(a, b) for a, b in zip(destinations, tensors))
        with reader.read(ns, hashes) as blocks:
            assert [bytes(b) for b in blocks] == expected
    assert shm.shared_memory() == ("attached",)


def test_encoded_blocks_go_through_as_they_are(shm: KVStoreClient, grpc_client: KVStoreClient) -> None:
    ns = namespace()
    hashes = hash_blocks(ns, list(range(3 * 16)))
    encoded = [encode_block(t) for t in random_blocks(ns, 3, seed=7)]
    assert shm.put(ns, hashes, [encoded[0], bytearray(encoded[1]), memoryview(encoded[2])]) == 3
    assert [bytes(b) for b in grpc_client.get(ns, hashes)] == encoded


def test_get_into_fills_views_of_a_larger_tensor_and_stops_at_the_first_miss(shm: KVStoreClient) -> None:
    ns = namespace(block_size=4)
    hashes = hash_blocks(ns, list(range(6 * 4)))
    tensors = random_blocks(ns, 6, seed=3)
    shm.put(ns, hashes[:4], tensors[:4])
    shm.delete(ns, hashes[2:3])  # a hole: the prefix is 2 blocks
    cache = torch.zeros(3, 2, 2, 6 * 4, 24, dtype=torch.float16)  # [L, 2, H, tokens, D]: the blocks side by side
    views = [cache[:, :, :, i * 4:(i + 1) * 4] for i in range(6)]  # not contiguous
    assert shm.get_into(ns, hashes, views) == 2
    assert same_bits(cache[:, :, :, :8], torch.cat(tensors[:2], dim=3))
    assert not cache[:, :, :, 8:].any()  # past the prefix: untouched


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
def test_get_into_the_rows_of_one_tensor_copies_the_prefix_bit_for_bit(shm: KVStoreClient, dtype: str) -> None:
    ns = namespace(dtype=dtype, block_size=4)
    hashes = hash_blocks(ns, list(range(6 * 4)))
    tensors = random_blocks(ns, 6, seed=5)
    shm.put(ns, hashes[:5], tensors[:5])
    shm.delete(ns, hashes[3:4])  # the prefix is 3 blocks
    staging = torch.zeros((6, *tensors[0].shape), dtype=tensors[0].dtype)  # one copy for the whole batch
    assert shm.get_into(ns, hashes, list(staging.unbind(0))) == 3
    assert all(same_bits(staging[i], tensors[i]) for i in range(3))
    assert not staging[3:].any()  # past the prefix: untouched
    rows = list(staging.unbind(0))
    rows[1], rows[2] = rows[2], rows[1]  # rows out of order: each block still lands in its own destination
    assert shm.get_into(ns, hashes, rows) == 3
    assert same_bits(staging[2], tensors[1]) and same_bits(staging[1], tensors[2])
    assert shm.shared_memory() == ("attached",)


def test_a_block_that_does_not_fit_its_destination_ends_the_copy_with_an_error(shm: KVStoreClient,
                                                                                grpc_client: KVStoreClient) -> None:
    ns = namespace(block_size=4)
    hashes = hash_blocks(ns, list(range(3 * 4)))
    tensors = random_blocks(ns, 3, seed=4)
    shm.put(ns, hashes, tensors)
    for client in (shm, grpc_client):
        destinations = [torch.zeros_like(tensors[0]), torch.zeros(3, 2, 1, 4, 24, dtype=torch.float16),
                        torch.zeros_like(tensors[2])]
        with pytest.raises(DestinationMismatchError) as info:
            client.get_into(ns, hashes, destinations)
        assert (info.value.num_blocks, info.value.num_found) == (1, 3)
        assert same_bits(destinations[0], tensors[0]) and not destinations[2].any()
        wrong_dtype = [t.to(torch.float32) for t in tensors]
        with pytest.raises(DestinationMismatchError, match="float16"):
            client.get_into(ns, hashes, wrong_dtype)


def test_get_into_wants_one_tensor_per_hash(shm: KVStoreClient) -> None:
    ns = namespace()
    hashes = hash_blocks(ns, list(range(2 * 16)))
    with pytest.raises(InvalidArgumentError, match="one destination"):
        shm.get_into(ns, hashes, [torch.zeros(1)])
    with pytest.raises(InvalidArgumentError, match="torch.Tensor"):
        shm.get_into(ns, hashes, [torch.zeros(1), bytearray(10)])  # type: ignore[list-item]


def test_the_async_client_takes_the_same_path(server: ThreadedServer) -> None:
    ns = namespace(dtype="bfloat16", layout="mla", block_size=8)
    hashes = hash_blocks(ns, list(range(4 * 8)))
    tensors = random_blocks(ns, 4, seed=11)
    before = {method: finished_calls(server, method, 0) for method in ("PutShared", "GetShared", "Put", "Get")}

    async def run() -> None:
        async with AsyncKVStoreClient(server.target, retries=0) as client:
            assert await client.put(ns, hashes, tensors) == 4
            destinations = [torch.empty_like(t) for t in tensors]
            assert await client.get_into(ns, hashes, destinations) == 4
            assert all(same_bits(a, b) for a, b in zip(destinations, tensors))
            assert all(same_bits(a, b) for a, b in zip(await client.get_tensors(ns, hashes), tensors))
            with await client.read(ns, hashes) as blocks:
                assert [bytes(b) for b in blocks] == [encode_block(t, "mla") for t in tensors]
            assert client.shared_memory() == ("attached",)

    asyncio.run(run())
    # the bytes went through shared memory: one PutShared, three GetShared (get_into, get_tensors, read), counted once
    # the node has sent each reply (finished_calls waits for that), and no Put or Get over gRPC
    expected = {"PutShared": 1, "GetShared": 3, "Put": 0, "Get": 0}
    calls = {method: finished_calls(server, method, before[method] + n) - before[method] for method, n in expected.items()}
    assert calls == expected, calls


def test_several_nodes_each_serve_their_own_blocks_into_the_destinations() -> None:
    nodes = [ThreadedServer(make_config()) for _ in range(2)]
    try:
        ns = namespace(block_size=4)
        hashes = hash_blocks(ns, list(range(12 * 4)))
        tensors = random_blocks(ns, 12, seed=5)
        with KVStoreClient([n.target for n in nodes], retries=0) as client:
            assert client.put(ns, hashes, tensors) == 12
            destinations = [torch.zeros_like(t) for t in tensors]
            assert client.get_into(ns, hashes, destinations) == 12
            assert all(same_bits(a, b) for a, b in zip(destinations, tensors))
            assert client.shared_memory() == ("attached", "attached")
            owner = client.router.owner_indices(hashes)
            last = max(i for i in range(12) if owner[i] == owner[5])
            client.delete(ns, [hashes[5]])
            destinations = [torch.zeros_like(t) for t in tensors]
            assert client.get_into(ns, hashes, destinations) == 5  # the merged prefix ends at the hole
            assert last >= 5
            wrong = [torch.zeros_like(t) for t in tensors]
            wrong[3] = torch.zeros(3, 2, 2, 4, 23, dtype=torch.float16)
            with pytest.raises(DestinationMismatchError) as info:
                client.get_into(ns, hashes, wrong)
            assert (info.value.num_blocks, info.value.num_found) == (3, 5)
    finally:
        for node in nodes:
            node.stop()


def test_a_closed_client_leaves_no_segment_open(server: ThreadedServer) -> None:
    before = open_segments()
    ns = namespace()
    hashes = hash_blocks(ns, list(range(2 * 16)))
    with KVStoreClient(server.target, retries=0) as client:
        client.put(ns, hashes, random_blocks(ns, 2, seed=1))
        assert client.shared_memory() == ("attached",)
        session = client._links[0].current().session_id  # type: ignore[union-attr]
        own = {f"memfd:kvstore-get-{session:x}", f"memfd:kvstore-put-{session:x}"}
        assert open_segments() - before == own
    # its own segments (a session an earlier test's client left may end meanwhile too: it is not this one's)
    wait_until(lambda: not open_segments() & own, 30, "the session's segments closed on both sides")


@pytest.mark.slow
def test_the_embedded_store_fills_destinations_the_same_way() -> None:
    from kvstore.embedded import open_store

    ns = namespace(dtype="bfloat16", block_size=4)
    hashes = hash_blocks(ns, list(range(3 * 4)))
    tensors = random_blocks(ns, 3, seed=8)
    with open_store() as store:
        store.put(ns, hashes, tensors)
        cache = torch.zeros(3, 2, 2, 12, 24, dtype=torch.bfloat16)
        assert store.get_into(ns, hashes, [cache[:, :, :, i * 4:(i + 1) * 4] for i in range(3)]) == 3
        assert same_bits(cache, torch.cat(tensors, dim=3))
        with pytest.raises(DestinationMismatchError) as info:
            store.get_into(ns, hashes, [torch.empty_like(tensors[0]), torch.empty(1), torch.empty(1)])
        assert (info.value.num_blocks, info.value.num_found) == (1, 3)
