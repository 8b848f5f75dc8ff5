"""Random concurrent puts, reads, deletes and clears (some cancelled) over a real redis-server.

Checks the bookkeeping of ``kvstore.tombstones``: after ``drain()`` no copy
window is open and no delete record is left, and nothing is logged as an error.
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from kvstore.store import TieredStore
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.test_store import NS, PAGE, make_blocks
from tests.test_store_index_stress import random_op
from tests.test_store_redis import redis_config


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
@pytest.mark.parametrize("seed", range(6))
async def test_random_puts_reads_deletes_and_clears_on_two_nodes_leave_no_records_or_errors(
        redis_server: RedisProcess, mode: str, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(seed)
    config = redis_config(redis_server.url, mode)
    hashes, blocks = make_blocks(12, seed=seed)
    stores = [TieredStore([MemoryTier(3 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE if i else 1 << 30)],
                          config, shared=RedisTier(config.redis)) for i in range(2)]
    for s in stores:
        await s.start()

    for _ in range(15):
        tasks = [asyncio.ensure_future(random_op(rng.choice(stores), rng, hashes, blocks)) for _ in range(20)]
        await asyncio.sleep(rng.random() * 0.003)
        for t in tasks:
            if rng.random() < 0.2:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for s in stores:
        await s.drain()
        assert not s._tombstones._open, s._tombstones._open
        assert len(s._tombstones) == 0
    for s in stores:
        await s.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
@pytest.mark.parametrize("seed", range(3))
async def test_redis_killed_and_the_store_closed_mid_flight_leave_no_records(
        redis_server: RedisProcess, mode: str, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    config = redis_config(redis_server.url, mode)
    hashes, blocks = make_blocks(10, seed=seed)
    store = TieredStore([MemoryTier(3 * 2 * PAGE, page_bytes=PAGE, offload_min_bytes=PAGE)], config,
                        shared=RedisTier(config.redis))
    await store.start()

    async def op():
        k = rng.randrange(10)
        n = rng.randrange(1, 11 - k)
        h, b = hashes[k:k + n], blocks[k:k + n]
        r = rng.random()
        if r < 0.4:
            await store.put(NS, h, b)
        elif r < 0.75:
            await store.get(NS, h)
        elif r < 0.9:
            await store.delete(NS, h)
        else:
            await store.clear(NS)

    for rnd in range(8):
        tasks = [asyncio.ensure_future(op()) for _ in range(15)]
        await asyncio.sleep(rng.random() * 0.005)
        if rnd == 3:
            redis_server.kill()
        if rnd == 6:
            redis_server.start()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.drain()
        assert not store._tombstones._open and len(store._tombstones) == 0
    tasks = [asyncio.ensure_future(op()) for _ in range(15)]
    await asyncio.sleep(0.001)
    await store.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.drain()
    assert not store._tombstones._open and len(store._tombstones) == 0
    bad = [r.getMessage() for r in caplog.records
           if "KeyError" in (r.exc_text or "") or "no copy window" in r.getMessage()]
    assert not bad
