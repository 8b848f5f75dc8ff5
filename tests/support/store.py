"""Helpers of the store tests: test blocks, small tiers, and views of the store's state that tests check.

Every test module that builds stores imports these from here; no test module imports another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
import random
import threading
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Sequence

import lmdb
import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import RedisTierConfig, StoreConfig
from kvstore.keys import Namespace, block_key, hash_blocks
from kvstore.store.tiered import TieredStore
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES, HeapTier
from kvstore.tiers.lmdb import MAX_KEY_BYTES, RECORD_OVERHEAD_BYTES, LMDBTier
from kvstore.tiers.memory import MemoryTier
from kvstore.wire import reply_head

BLOCK_SIZE = 4
NS = Namespace(model="test-model", dtype="float16", block_size=BLOCK_SIZE)
PAGE = 4096


def make_blocks(n: int, seed: int = 0, ns: Namespace = NS) -> tuple[list[bytes], list[bytes]]:
    """``n`` chained hashes and encoded ``[2, 2, 2, block_size, 64]`` blocks (about 4 KiB each)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * ns.block_size,), generator=generator)
    hashes = hash_blocks(ns, tokens)
    blocks = [
        encode_block(torch.randn(2, 2, 2, ns.block_size, 64, generator=generator).to(torch.float16)) for _ in range(n)
    ]
    return hashes, blocks


def memory_tier(num_blocks: int, **kwargs: object) -> MemoryTier:
    """A page-pool memory tier that holds ``num_blocks`` test blocks (each takes two pages)."""
    return MemoryTier(num_blocks * 2 * PAGE, page_bytes=PAGE, **kwargs)  # type: ignore[arg-type]


def heap_tier(num_blocks: int) -> HeapTier:
    """A heap tier (``kvstore serve``'s memory tier) of ``num_blocks`` test blocks, framing them as Get replies."""
    _, blocks = make_blocks(1)
    return HeapTier(num_blocks * (len(blocks[0]) + BLOCK_OVERHEAD_BYTES),
                    framing=functools.partial(reply_head, chunk_bytes=1 << 20))


def disk_footprint() -> int:
    """Capacity bytes one test block takes in the LMDB tier (overflow pages plus record overhead)."""
    _, blocks = make_blocks(1)
    pages = -(-(len(blocks[0]) + 16 + MAX_KEY_BYTES) // mmap.PAGESIZE)  # a record is the block and its key
    return pages * mmap.PAGESIZE + RECORD_OVERHEAD_BYTES


def redis_config(url: str, mode: str) -> StoreConfig:
    """A store config with a Redis tier at ``url`` in ``mode``, with a quick breaker (and timeouts a loaded machine
    meets: a killed Redis refuses connections at once)."""
    return StoreConfig(redis=RedisTierConfig(url=url, mode=mode, breaker_failures=2, breaker_reset_s=0.2,
                                             connect_timeout_s=1.0, socket_timeout_s=1.0))


def store_key(store: TieredStore, block_hash: bytes) -> str:
    """The Redis key of a block of ``NS`` under the namespace's current generation."""
    return store.tiers[-1].redis_key(block_key(NS, block_hash))  # type: ignore[attr-defined]


def held_keys(store: TieredStore) -> list[set[bytes]]:
    """Per local tier, the keys that some read or copy holds a reference on right now."""
    return [{key for key in policy if store.index.held(level, key) is not None}
            for level, policy in enumerate(store.index.policies)]


async def tier_and_index_disagree(store: TieredStore) -> list[str]:
    """Each local tier whose records differ from the keys the index has resident there, as a line naming both counts.

    Waits first for the writes LMDB tiers have queued: a write whose caller was
    cancelled still runs, in order, and may still be queued after ``drain()``.
    """
    await store.drain()
    local = store.tiers[:len(store.index.policies)]
    for tier in local:
        if isinstance(tier, LMDBTier):
            await asyncio.wrap_future(tier._writer.submit(lambda: None))
    problems = []
    for tier, policy in zip(local, store.index.policies):
        tracked = set(policy)
        held = {entry.key for entry in await tier.resident()}
        if tracked != held:
            problems.append(f"{tier.name}: {len(held - tracked)} records without an entry, "
                            f"{len(tracked - held)} entries without a record")
    if store.index.num_entries():
        problems.append(f"{store.index.num_entries()} entries still in use after drain")
    return problems


async def until(condition: Callable[[], bool], *, max_turns: int = 10_000) -> None:
    """Let the event loop run, one turn at a time, until ``condition()`` holds: an event, observed, not a timed wait.

    Raises:
        AssertionError: if it does not hold after ``max_turns`` turns (the test is wrong, not slow).
    """
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not within {max_turns} loop turns: {condition}")


async def cancel_when(call: Awaitable[object], condition: Callable[[], bool]) -> None:
    """Start ``call``, cancel it once ``condition()`` holds (see :func:`until`), and check that it ends cancelled."""
    task = asyncio.ensure_future(call)
    await until(condition)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@contextlib.asynccontextmanager
async def writer_held(disk: LMDBTier) -> AsyncIterator[None]:
    """Keep the LMDB tier's one writer thread busy for the body, so that every write submitted meanwhile waits
    in its queue; on leaving, let it go and wait until those writes have run."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait()

    disk._writer.submit(hold)
    await asyncio.to_thread(entered.wait)  # the writer thread is in: what is submitted next queues
    try:
        yield
    finally:
        gate.set()
        await asyncio.wrap_future(disk._writer.submit(lambda: None))


def writes_queued(disk: LMDBTier) -> int:
    """Writes waiting in the LMDB tier's writer queue (behind :func:`writer_held`'s)."""
    return disk._writer._work_queue.qsize()  # type: ignore[attr-defined]


def corrupt_records(path: Path, hashes: list[bytes], ns: Namespace = NS) -> None:
    """Flip one byte in the middle of each block's LMDB record (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        for h in hashes:
            key = block_key(ns, h)
            value = bytearray(txn.get(key))
            value[len(value) // 2] ^= 0xFF
            txn.put(key, bytes(value))
    env.close()


async def random_op(store: TieredStore, rng: random.Random, hashes: list[bytes], blocks: list[bytes],
                    priorities: Sequence[int | None] = (None,)) -> None:
    """One random operation of the stress tests on a random run of the blocks: a put (of a run with a repeated
    block, at a random priority of ``priorities``), a read that holds its leases a moment, a delete (of a run with
    every key twice), or a clear of the namespace."""
    k = rng.randrange(len(hashes))
    n = rng.randrange(1, len(hashes) + 1 - k)
    h, b = hashes[k:k + n], blocks[k:k + n]
    r = rng.random()
    if r < 0.35:
        await store.put(NS, h + h[:1], b + b[:1], priority=rng.choice(priorities))
    elif r < 0.7:
        async with store.read(NS, h):
            for _ in range(rng.randrange(4)):  # holds its references a few loop turns
                await asyncio.sleep(0)
    elif r < 0.85:
        await store.delete(NS, h + h)
    else:
        await store.clear(NS)


class GatedTier:
    """Wraps a tier's method so that its next call waits for :attr:`gate`, and sets :attr:`entered` when it is in.

    Orders an interleaving by events, never by time::

        gated = GatedTier(disk, "put")
        task = asyncio.create_task(store.put(...))
        await gated.entered.wait()   # the put is inside the tier's put now
        ...                          # the racing operation
        gated.gate.set()             # let the put go on
    """

    def __init__(self, tier: object, method: str, *, calls: int = 1) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        real = getattr(tier, method)
        remaining = [calls]

        async def gated(*args: object, **kwargs: object) -> object:
            if remaining[0] > 0:
                remaining[0] -= 1
                if remaining[0] == 0:
                    setattr(tier, method, real)
                self.entered.set()
                await self.gate.wait()
            return await real(*args, **kwargs)

        setattr(tier, method, gated)


class SharedMemoryTier(MemoryTier):
    """A page-pool memory tier standing in for a shared tier (Redis): :class:`kvstore.tiers.base.SharedTier`'s
    namespace generations, kept in this process. A clear deletes the namespace's blocks at once, so a sweep
    finds nothing left; copies prepared under an older generation land as any put does (one node, no race)."""

    def __init__(self, capacity_bytes: int, **kwargs: object) -> None:
        super().__init__(capacity_bytes, **kwargs)  # type: ignore[arg-type]
        self._generations: dict[bytes, int] = {}

    def generation(self, tag: bytes) -> int:
        """The namespace's generation: how many clears it had."""
        return self._generations.get(tag, 0)

    async def put(self, keys: Sequence[bytes], values: Sequence[bytes], metas: Sequence[object], *,  # type: ignore[override]
                  generations: object = None) -> list[bool]:
        """:meth:`MemoryTier.put`; the generations are not part of the keys here."""
        return await super().put(keys, values, metas)  # type: ignore[arg-type]

    async def clear_namespace(self, tag: bytes) -> int:
        """The namespace's next generation, its blocks deleted."""
        self._generations[tag] = self.generation(tag) + 1
        await self.delete([entry.key for entry in await self.resident() if entry.key.startswith(tag)])
        return self._generations[tag]

    async def sweep_namespace(self, tag: bytes, generation: int) -> int:
        """Nothing is left to sweep: a clear deleted the namespace's blocks."""
        return 0
