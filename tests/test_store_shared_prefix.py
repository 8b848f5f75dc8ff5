"""With a shared tier, a prefix may run Redis -> disk -> memory: Lookup and Get find it whole.

In write-back mode LRU pushes the head of a prompt down first, so block 0 can be in Redis while
later blocks are local. Regression: the store asked Redis only past the local prefix and stopped
at Redis's first miss, cutting such a prefix short.
"""

from kvstore.config import RedisTierConfig, StoreConfig
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier


async def test_prefix_redis_disk_memory_is_found_whole(tmp_path, redis_server: RedisProcess) -> None:
    config = StoreConfig(redis=RedisTierConfig(url=redis_server.url, mode="write_back"), demote_min_priority=0)
    disk = LMDBTier(tmp_path / "disk", disk_footprint())
    async with TieredStore([memory_tier(1), disk], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(3, seed=11)
        for i in range(3):       # each put pushes the older blocks one tier down
            await store.put(NS, hashes[i:i + 1], blocks[i:i + 1])
        await store.drain()
        # every block is cached, one per tier
        assert [await store.locate(NS, [h]) for h in hashes] == [b"\x02", b"\x01", b"\x00"]
        assert await store.locate(NS, hashes) == bytes([2, 1, 0])            # observed: b"\x02"
        assert (await store.lookup(NS, hashes)).num_blocks == 3
        assert await store.get(NS, hashes) == blocks                         # observed: blocks[:1]


class _ReadCountingLMDBTier(LMDBTier):
    """A real LMDB tier that also records the keys each ``get`` was asked for."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.keys_read: list[bytes] = []

    async def get(self, keys):  # type: ignore[no-untyped-def]
        self.keys_read += keys
        return await super().get(keys)


async def test_local_blocks_past_a_block_found_nowhere_are_not_read(tmp_path, redis_server: RedisProcess) -> None:
    config = StoreConfig(redis=RedisTierConfig(url=redis_server.url, mode="write_back"), demote_min_priority=0)
    disk = _ReadCountingLMDBTier(tmp_path / "disk", 4 * disk_footprint())
    async with TieredStore([memory_tier(1), disk], config, shared=RedisTier(config.redis)) as store:
        hashes, blocks = make_blocks(3, seed=12)
        await store.put(NS, hashes[2:], blocks[2:])
        await store.put(NS, hashes[:1], blocks[:1])  # pushes block 2 down to disk; block 1 is nowhere
        await store.drain()
        assert [await store.locate(NS, [h]) for h in hashes] == [b"\x00", b"", b"\x01"]
        assert await store.get(NS, hashes) == blocks[:1]
        assert disk.keys_read == []  # block 2 is past the prefix's end: reading it would be wasted
        assert await store.get(NS, hashes[2:]) == blocks[2:]
        assert len(disk.keys_read) == 1
