"""A put's tensors encoded where they are stored (``kvstore.blocks.copying.TensorBlock``), through the embedded store:
into the memory tier's pool in place, into bytes for every other tier and for what outlives the put."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks.copying import TensorBlock, encoded_values, tensor_blocks
from kvstore.blocks.tensors import decode_block, encode_block
from kvstore.config import DiskTierConfig, MemoryTierConfig, RedisTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore
from kvstore.errors import ElementCountError, InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import Namespace, hash_blocks
from tests.support.redis import RedisProcess, redis_server  # noqa: F401

NS = Namespace("test/tensor-blocks", dtype="float16", block_size=16)
SHAPE = (2, 2, 2, 16, 32)


def _tensors(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator).to(torch.float16) for _ in range(num_blocks)]


def _hashes(num_blocks: int, start: int = 0) -> list[bytes]:
    return hash_blocks(NS, list(range(start, start + 16 * num_blocks)))


def test_a_tensor_block_encodes_byte_for_byte_as_encode_block() -> None:
    tensor = _tensors(1)[0]
    strided = torch.randn(32, 2, 2, 16, 2).to(torch.float16).permute(4, 1, 2, 3, 0)  # not contiguous
    for source in (tensor, strided):
        block = tensor_blocks([source], "kv")[0]
        assert isinstance(block, TensorBlock) and len(block) == len(encode_block(source))
        target = bytearray(len(block) + 64)
        block.encode_into(memoryview(target), torch.frombuffer(target, dtype=torch.uint8))
        assert bytes(target[:len(block)]) == encode_block(source) == block.encoded()
        assert encoded_values([block, b"as is"]) == [encode_block(source), b"as is"]


def test_tensor_blocks_pass_bytes_through_and_refuse_what_the_codec_refuses() -> None:
    encoded = encode_block(_tensors(1)[0])
    made = tensor_blocks([encoded, _tensors(1)[0]], "kv")
    assert made[0] is encoded and isinstance(made[1], TensorBlock)
    with pytest.raises(ElementCountError):
        tensor_blocks([torch.zeros(2, 3, 2, 16, 32, dtype=torch.float16)], "kv")  # dim 1 is not K and V
    with pytest.raises(ElementCountError):
        tensor_blocks([torch.zeros(SHAPE, dtype=torch.float16), torch.zeros(3, 2, 2, 16, 32, dtype=torch.float16)],
                      "kv")  # two models' shapes in one put
    with pytest.raises(InvalidArgumentError):
        tensor_blocks([object()], "kv")


def test_the_embedded_store_stores_tensors_as_their_encoded_blocks() -> None:
    tensors = _tensors(5)
    hashes = _hashes(5)
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20))) as store:
        assert store.put(NS, hashes, tensors) == 5
        tensors[0].zero_()  # the caller's tensor after the put: nothing stored changes
        assert store.get(NS, hashes) == [encode_block(t) for t in _tensors(5)]
        assert all(torch.equal(got, want) for got, want in zip(store.get_tensors(NS, hashes), _tensors(5)))


def test_a_tensor_that_contradicts_its_namespace_stores_nothing() -> None:
    hashes = _hashes(2)
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20))) as store:
        with pytest.raises(InvalidArgumentError, match="does not match the namespace"):
            store.put(NS, hashes, [t.to(torch.bfloat16) for t in _tensors(2)])
        with pytest.raises(InvalidArgumentError, match="block size"):
            store.put(NS, hashes, [torch.zeros(2, 2, 2, 8, 32, dtype=torch.float16)] * 2)
        assert store.lookup(NS, hashes).num_blocks == 0


def test_a_tensor_over_max_block_bytes_is_refused() -> None:
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20), max_block_bytes=4096)
    with EmbeddedStore(config) as store:
        with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
            store.put(NS, _hashes(1), _tensors(1))
        assert store.lookup(NS, _hashes(1)).num_blocks == 0


def test_tensors_that_fit_no_memory_go_to_disk_encoded(tmp_path) -> None:
    tensors = _tensors(3)
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=4096),  # smaller than one block
                         disk=DiskTierConfig(path=str(tmp_path), capacity_bytes=64 << 20))
    with EmbeddedStore(config) as store:
        assert store.put(NS, _hashes(3), tensors) == 3
        assert store.lookup(NS, _hashes(3)).tiers == ("disk",) * 3
        assert store.get(NS, _hashes(3)) == [encode_block(t) for t in tensors]


def test_a_write_through_copy_is_the_tensor_as_it_was_at_the_put(redis_server: RedisProcess) -> None:  # noqa: F811
    tensors = _tensors(4)
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20),
                         redis=RedisTierConfig(url=redis_server.url, mode="write_through"))
    with EmbeddedStore(config) as store:
        store.put(NS, _hashes(4), tensors)
        for tensor in tensors:
            tensor.fill_(7)  # the queued copies into Redis were encoded before the put returned
        store.drain()
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(enabled=False),
                                   redis=RedisTierConfig(url=redis_server.url))) as other:
        got = other.get(NS, _hashes(4))
    assert [decode_block(b) for b in got] and all(
        torch.equal(decode_block(b), want) for b, want in zip(got, _tensors(4)))
    assert len(got) == 4


@pytest.mark.parametrize("layout", ["rows", "strided rows", "separate"])
def test_a_batch_from_one_tensor_is_copied_in_chunks_and_stored_exactly(layout: str) -> None:
    generator = torch.Generator().manual_seed(3)
    whole = torch.randn(40, *SHAPE, generator=generator).to(torch.float16)  # 40 x 16 KiB: more than one chunk
    if layout == "strided rows":  # the rows of a tensor whose blocks are not contiguous
        whole = torch.randn(40, *SHAPE[:-1], 2 * SHAPE[-1], generator=generator).to(torch.float16)[..., ::2]
    blocks = list(whole.unbind(0)) if layout != "separate" else [b.clone() for b in whole.unbind(0)]
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20))) as store:
        assert store.put(NS, _hashes(40), blocks) == 40
        assert store.get(NS, _hashes(40)) == [encode_block(b) for b in blocks]
