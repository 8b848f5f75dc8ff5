"""Stats and ``/metrics`` agree, and count one scripted workload over memory, disk and Redis by one definition.

The definitions (``docs/service.md``, "Metrics"): a block a get served from tier ``t`` is a hit there and a miss
in every tier above it; the first block a get did not find is a miss in every tier, and so is every block a
lookup asked for past its cached prefix; a tier's evictions are its demotions into the tier below (or into
Redis, in write-back mode) plus what it dropped.
"""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

from kvstore.api import StoreStats
from kvstore.client import KVStoreClient
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES
from kvstore.tiers.lmdb import MAX_KEY_BYTES, RECORD_OVERHEAD_BYTES, default_map_size_bytes
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.server import ThreadedServer, encoded, kv_blocks, make_config, namespace, scrape

COUNTERS = ("hits", "misses", "evictions", "demotions", "promotions", "corrupt_records")


def _counts(stats: StoreStats) -> dict[str, dict[str, int]]:
    return {t.name: {c: getattr(t, c) for c in COUNTERS} for t in stats.tiers}


def _expected_get(before: dict[str, dict[str, int]], names: tuple[str, ...], served: tuple[str, ...],
                  asked: int) -> dict[str, dict[str, int]]:
    """The counts after a lookup, then a get of the same ``asked`` blocks, that served blocks from the tiers
    ``served`` (in order)."""
    after = {name: dict(counts) for name, counts in before.items()}
    for name in names:  # the lookup: every block past the prefix is a miss of every tier
        after[name]["misses"] += asked - len(served)
    for tier in served:
        after[tier]["hits"] += 1
        for above in names[:names.index(tier)]:
            after[above]["misses"] += 1
    if len(served) < asked:
        for name in names:
            after[name]["misses"] += 1
    return after


def test_stats_and_metrics_count_one_workload_over_memory_disk_and_redis_alike(
        redis_server: RedisProcess, tmp_path: Path) -> None:  # noqa: F811
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 8)
    block_bytes = len(encoded(ns, tensors[:1])[0])
    disk_bytes = -(-(block_bytes + 16 + MAX_KEY_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE + RECORD_OVERHEAD_BYTES
    server = ThreadedServer(make_config(**{
        "store.memory.capacity_bytes": 3 * (block_bytes + BLOCK_OVERHEAD_BYTES),  # three blocks
        "store.disk.path": str(tmp_path / "disk"), "store.disk.capacity_bytes": default_map_size_bytes(2 * disk_bytes),  # two blocks
        "store.redis.url": redis_server.url, "store.redis.mode": "write_back",
        "store.promote_on_hit": False,
    }))
    try:
        store = server.server.store
        names = store.tier_names
        assert names == ("memory", "disk", "redis")

        async def drain() -> None:
            await store.drain()

        with KVStoreClient(server.target, retries=0) as kv:
            for i in range(0, 8, 2):  # four puts of two: the older blocks go down, memory -> disk -> Redis
                assert kv.put(ns, hashes[i:i + 2], tensors[i:i + 2]) == 2
            server.call(drain())
            tiers = kv.lookup(ns, hashes).tiers
            assert set(tiers) == {"memory", "disk", "redis"}, tiers  # the workload reaches every tier
            for start, stop, extra in ((0, 8, 0), (0, 3, 0), (5, 8, 1), (2, 6, 0)):
                asked = hashes[start:stop] + ([b"\x99" * 16] * extra)  # a missing block past the end
                before = _counts(kv.stats())
                served = kv.lookup(ns, asked).tiers
                assert len(kv.get(ns, asked)) == len(served)
                assert _counts(kv.stats()) == _expected_get(before, names, served, len(asked)), (start, stop)
            server.call(drain())
            stats = kv.stats()
        counts = _counts(stats)
        assert counts["memory"]["evictions"] == counts["disk"]["demotions"] > 0  # the disk had room for each
        assert counts["disk"]["evictions"] == counts["redis"]["demotions"] > 0  # write-back: all into Redis
        assert counts["memory"]["misses"] > 0 and counts["redis"]["hits"] > 0
        samples = scrape(server)
        for tier in stats.tiers:
            for counter in COUNTERS:
                assert samples[f'kvstore_tier_{counter}_total{{tier="{tier.name}"}}'] == getattr(tier, counter), \
                    (tier.name, counter)
            for event, count in tier.counters.items():
                assert samples[f'kvstore_tier_events_total{{event="{event}",tier="{tier.name}"}}'] == count
            assert "hits" not in tier.counters and "misses" not in tier.counters  # each counter defined once
        assert samples['kvstore_lookup_blocks_total{result="hit"}'] == stats.lookup_hit_blocks
        assert samples['kvstore_lookup_blocks_total{result="miss"}'] == stats.lookup_miss_blocks
    finally:
        server.stop()


def test_promotions_count_at_the_tier_they_leave(redis_server: RedisProcess) -> None:  # noqa: F811
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    block_bytes = len(encoded(ns, tensors[:1])[0])
    server = ThreadedServer(make_config(**{
        "store.memory.capacity_bytes": 8 * (block_bytes + BLOCK_OVERHEAD_BYTES),
        "store.redis.url": redis_server.url, "store.redis.mode": "write_through",
        "store.promote_on_hit": True,
    }))
    other = ThreadedServer(make_config(**{"store.redis.url": redis_server.url}))
    try:
        async def drain(threaded: ThreadedServer) -> None:
            await threaded.server.store.drain()

        with KVStoreClient(other.target, retries=0) as writer:
            assert writer.put(ns, hashes, tensors) == 4
        other.call(drain(other))  # written through into Redis
        with KVStoreClient(server.target, retries=0) as kv:
            assert kv.lookup(ns, hashes).tiers == ("redis",) * 4
            assert len(kv.get(ns, hashes)) == 4  # four Redis hits, four memory misses
            server.call(drain(server))
            assert kv.lookup(ns, hashes).tiers == ("memory",) * 4
            counts = _counts(kv.stats())
        assert counts["redis"] == {"hits": 4, "misses": 0, "evictions": 0, "demotions": 0, "promotions": 4,
                                   "corrupt_records": 0}
        assert counts["memory"]["misses"] == 4 and counts["memory"]["hits"] == 0  # was: 0 misses with Redis below
        samples = scrape(server)
        assert samples['kvstore_tier_promotions_total{tier="redis"}'] == 4
        assert samples['kvstore_tier_misses_total{tier="memory"}'] == 4
    finally:
        server.stop()
        other.stop()


def test_a_lookup_that_finds_nothing_is_a_miss_of_every_tier() -> None:
    """The traffic of a connector: look up, get the prefix found. With a quarter of the blocks cached, the
    memory tier's hits / (hits + misses) is a quarter too, not 1 (as when only Gets counted)."""
    from kvstore import open_store
    from kvstore.config import MemoryTierConfig, StoreConfig

    ns = namespace()
    hashes, tensors = kv_blocks(ns, 8)
    store = open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20)))
    try:
        store.put(ns, hashes[:2], tensors[:2])
        for prompt in (hashes, hashes[2:], hashes[:4] + [b"\x99" * 16] * 4):  # 2 of 8, 0 of 6, 2 of 8 cached
            found = store.lookup(ns, prompt).num_blocks
            assert len(store.get(ns, prompt[:found])) == found
        memory = store.stats().tier("memory")
        assert (memory.hits, memory.misses) == (4, 18)  # 4 of the 22 blocks asked for were served
        stats = store.stats()
        assert (stats.lookup_hit_blocks, stats.lookup_miss_blocks) == (4, 18)
    finally:
        store.close()


def test_lookups_are_counted_by_tenant_under_a_digest_of_the_salt() -> None:
    import hashlib

    from kvstore import open_store
    from kvstore.config import MemoryTierConfig, StoreConfig
    from kvstore.store.counts import TenantLookups
    from kvstore.server.metrics import ServiceMetrics

    ns = namespace()
    salted = dataclasses.replace(ns, cache_salt="team-a")
    hashes, tensors = kv_blocks(ns, 4)
    salted_hashes, _ = kv_blocks(salted, 4)
    store = open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20)))
    try:
        store.put(ns, hashes[:3], tensors[:3])
        store.lookup(ns, hashes)
        store.lookup(salted, salted_hashes)
        by_tenant = store.stats().lookup_blocks_by_tenant
        label = "t-" + hashlib.sha256(b"team-a").hexdigest()[:8]
        assert by_tenant == {"default": (3, 1), label: (0, 4)}  # the salt itself is never shown
        metrics = ServiceMetrics()
        metrics.add_store(store.stats)
        from prometheus_client import generate_latest
        text = generate_latest(metrics.registry).decode()
        assert f'kvstore_tenant_lookup_blocks_total{{result="miss",tenant="{label}"}} 4.0' in text
        assert 'kvstore_tier_up{tier="memory"} 1.0' in text and "team-a" not in text
    finally:
        store.close()
    few = TenantLookups(max_tenants=2)
    for salt in ("a", "b", "c", "d"):
        few.count(salt, 1, 0)
    assert few.snapshot()["other"] == (2, 0) and len(few.snapshot()) == 3  # bounded: past the 2nd, "other"
