"""No caller can write into a stored block (issue 18, finding 7), through the public API.

Regression: with ``memory.storage="heap"`` in-process, writing into a tensor from ``get_tensors`` changed the
stored block (the heap tier keeps each block as one ``bytes`` object, and ``torch.frombuffer`` over it gave a
writable tensor), and later readers got bytes that failed their checksum. A tensor decoded from
``TieredStore.read()``'s read-only page-pool view could be written too, and the write reached the pool. The
embedded store now copies each block into a tensor of its own, and ``decode_block`` copies read-only memory.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks.tensors import decode_block, encode_block, verify_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.embedded import open_store
from kvstore.keys import Namespace, hash_blocks

NS = Namespace(model="tests/read-only", dtype="float16", block_size=16)


def blocks(num_blocks: int) -> tuple[list[bytes], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(num_blocks)
    tensors = [torch.randn(2, 2, 2, 16, 32, generator=generator).half() for _ in range(num_blocks)]
    return hash_blocks(NS, list(range(num_blocks * 16))), tensors


@pytest.mark.parametrize("storage", ["heap", "pages"])
def test_writing_into_a_tensor_from_get_tensors_leaves_the_stored_block_alone(storage: str) -> None:
    hashes, tensors = blocks(3)
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20, storage=storage, pin_memory=False))
    with open_store(config) as store:
        assert store.put(NS, hashes, tensors) == 3
        stored = [bytes(b) for b in store.get(NS, hashes)]
        for tensor in store.get_tensors(NS, hashes):
            tensor.fill_(7)  # the caller's own copy
        again = store.get(NS, hashes)
        assert [bytes(b) for b in again] == stored
        for block in again:
            verify_block(block)  # observed: ChecksumError for every later reader (heap)
        assert all(torch.equal(a, b) for a, b in zip(store.get_tensors(NS, hashes), tensors))


def test_a_tensor_decoded_from_a_read_lease_does_not_write_into_the_page_pool() -> None:
    hashes, tensors = blocks(2)
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20, storage="pages", pin_memory=False))
    with open_store(config) as store:
        store.put(NS, hashes, tensors)

        async def write_through_the_lease() -> None:
            async with store.store.read(NS, hashes) as views:
                assert all(isinstance(v, memoryview) and v.readonly for v in views)  # read in place, not copied
                for view in views:
                    decode_block(view).fill_(7)

        store.run(write_through_the_lease())
        assert store.get(NS, hashes) == [encode_block(t) for t in tensors]
