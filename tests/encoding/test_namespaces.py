"""Lossy namespaces end to end: keys apart from exact ones, blocks refused across the two, and tensors back in
their dtype and shape through the embedded store and a real gRPC server (both data paths)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import decode_header, encode_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore
from kvstore.blocks.encoding import encode_lossy
from kvstore.errors import InvalidArgumentError, UnknownEncodingError
from kvstore.keys import Namespace, block_key, hash_blocks
from kvstore.wire import namespace_from_pb, namespace_to_pb
from tests.support.server import ThreadedServer, make_config, namespace


def _blocks(num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(num_blocks)
    return [torch.randn(2, 2, 2, 16, 64, generator=generator).to(dtype) for _ in range(num_blocks)]


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(make_config())
    yield threaded
    threaded.stop()


@pytest.fixture()
def store() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20))) as embedded:
        yield embedded


def test_exact_and_lossy_namespaces_never_share_a_key() -> None:
    exact = Namespace(model="m", dtype="bfloat16")
    roots = {exact.root} | {Namespace(model="m", dtype="bfloat16", kv_encoding=e).root
                            for e in ("fp8_e4m3", "int8", "int4", "int2")}
    assert len(roots) == 5
    tokens = list(range(32))
    keys = {block_key(ns, h) for ns in (exact, Namespace(model="m", dtype="bfloat16", kv_encoding="int8"))
            for h in hash_blocks(ns, tokens)}
    assert len(keys) == 4
    lossy = Namespace(model="m", dtype="bfloat16", kv_encoding="int4")
    assert namespace_from_pb(namespace_to_pb(lossy)) == lossy
    assert namespace_from_pb(namespace_to_pb(exact)) == exact


def test_a_bad_encoding_is_refused_at_the_namespace() -> None:
    with pytest.raises(UnknownEncodingError, match="known: fp8_e4m3, int8, int4, int2"):
        Namespace(model="m", kv_encoding="int3")
    with pytest.raises(InvalidArgumentError, match="not float8_e4m3fn"):
        Namespace(model="m", dtype="float8_e4m3fn", kv_encoding="int8")


def test_the_store_refuses_exact_blocks_in_a_lossy_namespace_and_lossy_in_an_exact(store: EmbeddedStore) -> None:
    exact = namespace(dtype="bfloat16")
    lossy = namespace(dtype="bfloat16", kv_encoding="int8")
    x = _blocks(1)[0]
    with pytest.raises(InvalidArgumentError, match="encoding 'none' is not the namespace's 'int8'"):
        store.put(lossy, hash_blocks(lossy, range(16)), [encode_block(x)])
    with pytest.raises(InvalidArgumentError, match="encoding 'int8' is not the namespace's 'none'"):
        store.put(exact, hash_blocks(exact, range(16)), [encode_lossy(x, "kv", "int8")])
    with pytest.raises(InvalidArgumentError, match="encoding 'int4' is not the namespace's 'int8'"):
        store.put(lossy, hash_blocks(lossy, range(16)), [encode_lossy(x, "kv", "int4")])


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_the_embedded_store_stores_the_smaller_block_and_hands_back_the_tensor(store: EmbeddedStore,
                                                                               encoding: str) -> None:
    ns = namespace(dtype="bfloat16", kv_encoding=encoding)
    tensors = _blocks(3)
    hashes = hash_blocks(ns, range(48))
    assert store.put(ns, hashes, tensors) == 3
    stored = store.get(ns, hashes)
    assert all(decode_header(b).encoding == encoding for b in stored)
    assert sum(len(b) for b in stored) < 0.52 * sum(t.numel() * 2 for t in tensors)
    back = store.get_tensors(ns, hashes)
    destinations = torch.zeros(3, *tensors[0].shape, dtype=torch.bfloat16)
    assert store.get_into(ns, hashes, list(destinations.unbind(0))) == 3
    for original, got, into in zip(tensors, back, destinations):
        assert got.dtype == torch.bfloat16 and got.shape == original.shape
        assert torch.equal(got, into)
        relative = ((got.float() - original.float()).norm() / original.float().norm()).item()
        assert relative < (0.01 if encoding == "int8" else 0.12)
    exact = namespace(model=ns.model, dtype="bfloat16")
    assert store.lookup(exact, hash_blocks(exact, range(48))).num_blocks == 0


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shared-memory"])
def test_a_node_serves_lossy_blocks_over_both_data_paths(server: ThreadedServer, shared_memory: bool) -> None:
    ns = namespace(dtype="float16", kv_encoding="int8")
    tensors = _blocks(4, torch.float16)
    hashes = hash_blocks(ns, range(64))
    with KVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=shared_memory) as kv:
        assert kv.put(ns, hashes, tensors) == 4
        back = kv.get_tensors(ns, hashes)
        destinations = [torch.zeros_like(t) for t in tensors]
        assert kv.get_into(ns, hashes, destinations) == 4
        raw = kv.get(ns, hashes)
    for original, got, into, block in zip(tensors, back, destinations, raw):
        assert got.dtype == torch.float16 and got.shape == original.shape
        assert torch.equal(got, into)
        assert torch.equal(got, encode_and_decode(original))
        assert decode_header(block).encoding == "int8"


def encode_and_decode(x: torch.Tensor) -> torch.Tensor:
    from kvstore.blocks.tensors import decode_block

    return decode_block(encode_lossy(x, "kv", "int8"))
