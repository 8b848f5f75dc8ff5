"""The embedded store from many threads: lookups and leases run in the callers' threads while the loop is parked,
puts and deletes on the loop; every answer is what was stored, and every lease comes back."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore
from kvstore.errors import UnavailableError
from kvstore.keys import Namespace, hash_blocks
from kvstore.tiers.memory import MemoryTier
from tests.support.redis import redis_server  # noqa: F401

NS = Namespace("test/embedded", dtype="float16", block_size=16)
SHAPE = (2, 2, 2, 16, 32)


def _blocks(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(num_blocks, *SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def test_threads_put_read_look_up_and_delete_at_once_and_every_lease_comes_back() -> None:
    num_threads, rounds, num_blocks = 4, 30, 6
    errors: list[BaseException] = []
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20))) as store:
        shared = _blocks(num_blocks, 99)
        shared_hashes = hash_blocks(NS, list(range(16 * num_blocks)))
        store.put(NS, shared_hashes, list(shared))

        def worker(index: int) -> None:
            try:
                destination = torch.empty(num_blocks, *SHAPE, dtype=torch.float16)
                for r in range(rounds):
                    blocks = _blocks(num_blocks, 1000 * index + r)
                    hashes = hash_blocks(NS, list(range(10**6 * (index + 1) + 1000 * r,
                                                        10**6 * (index + 1) + 1000 * r + 16 * num_blocks)))
                    store.put(NS, hashes, list(blocks))
                    assert store.lookup(NS, hashes).num_blocks == num_blocks
                    assert store.get_into(NS, hashes, list(destination.unbind(0))) == num_blocks
                    assert torch.equal(destination, blocks)
                    assert store.get_into(NS, shared_hashes, list(destination.unbind(0))) == num_blocks
                    assert torch.equal(destination, shared)
                    lease = store.read(NS, hashes)
                    store.delete(NS, hashes)  # the lease holds them: its views stay what was stored
                    assert [bytes(b) for b in lease.blocks] == [encode_block(b) for b in blocks]
                    lease.release()
                    assert store.lookup(NS, hashes).num_blocks == 0
            except BaseException as exc:  # reported by the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        store.drain()
        tier = store.store.tiers[0]
        assert isinstance(tier, MemoryTier)
        store.delete(NS, shared_hashes)
        store.drain()
        store.run(_settled())  # the releases queued on the loop have run
        assert tier.num_blocks == 0 and tier.held_bytes == 0
        assert tier.num_free_pages == tier.num_pages  # every page back: no lease was left behind


async def _settled() -> None:
    """Nothing: by the time it runs, the callbacks queued before it on the loop (the releases) have run."""


def test_a_closed_store_refuses_lookups_and_reads_in_the_callers_thread() -> None:
    store = EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=4 << 20)))
    hashes = hash_blocks(NS, list(range(16)))
    store.put(NS, hashes, list(_blocks(1, 0)))
    store.close()
    with pytest.raises(UnavailableError):
        store.lookup(NS, hashes)
    with pytest.raises(UnavailableError):
        store.get_into(NS, hashes, [torch.empty(SHAPE, dtype=torch.float16)])
    with pytest.raises(UnavailableError):
        store.read(NS, hashes)


def test_a_lookup_asks_the_shared_tier_through_the_loop(redis_server) -> None:  # noqa: F811
    from kvstore.config import RedisTierConfig

    hashes = hash_blocks(NS, list(range(16 * 3)))
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=4 << 20),
                         redis=RedisTierConfig(url=redis_server.url, mode="write_through"))
    with EmbeddedStore(config) as writer:
        writer.put(NS, hashes, list(_blocks(3, 1)))
        writer.drain()
        assert writer.store.locate_now(NS, hashes) is None  # a shared tier: the index alone cannot answer
        assert writer.lookup(NS, hashes).tiers == ("memory",) * 3
    with EmbeddedStore(config) as reader:  # a store of its own: the blocks are only in Redis for it
        assert reader.lookup(NS, hashes).tiers == ("redis",) * 3


def test_a_lookup_without_a_shared_tier_counts_as_the_loops_would() -> None:
    hashes = hash_blocks(NS, list(range(16 * 4)))
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=4 << 20))) as store:
        store.put(NS, hashes[:2], list(_blocks(2, 2)))
        assert store.lookup(NS, hashes).num_blocks == 2
        stats = store.stats()
        assert (stats.lookup_hit_blocks, stats.lookup_miss_blocks) == (2, 2)
