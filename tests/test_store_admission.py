"""Put admission with a disk tier: concurrent puts wait for the room evictions in flight free, never refused for it.

Regression (issue 32, item 1): with a memory and a disk tier, three concurrent
writers of mixed block sizes had 2-3 % of their puts refused with ``tier memory
is full``. A put whose room the index promised from victims still being demoted
wrote before their pages were free; the tier refused the batch, and the store
gave up although the disk below had room.
"""
from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.errors import ResourceExhaustedError
from kvstore.keys import block_keys, hash_blocks
from kvstore.store.tiered import TieredStore
from kvstore.tiers.heap import HeapTier
from kvstore.tiers.lmdb import LMDBTier
from kvstore.wire import reply_head
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier

MiB = 1 << 20
HEAD_DIMS = (128, 2048, 16384, 49152)
"""Blocks of 16 KiB, 256 KiB, 2 MiB and 6 MiB (``[2, 2, 2, 4, head_dim]`` float16), as in the issue."""


def _block(head_dim: int, seed: int) -> bytes:
    tensor = torch.zeros(2, 2, 2, NS.block_size, head_dim, dtype=torch.float16)
    tensor.view(-1)[:64] = torch.arange(64, dtype=torch.float16) + seed  # distinct, cheap to make
    return encode_block(tensor)


async def _writer(store: TieredStore, writer: int, num_puts: int, stored: dict[bytes, bytes]) -> list[Exception]:
    """``num_puts`` puts of 2-block chains, the block size cycling; returns the errors raised."""
    errors: list[Exception] = []
    for i in range(num_puts):
        head_dim = HEAD_DIMS[(i + writer) % len(HEAD_DIMS)]
        tokens = torch.arange(2 * NS.block_size) + (writer * 1_000 + i) * 2 * NS.block_size
        hashes = hash_blocks(NS, tokens)
        blocks = [_block(head_dim, writer * 1_000 + i * 2 + j) for j in range(2)]
        try:
            await store.put(NS, hashes, blocks)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            errors.append(exc)
            continue
        stored.update(zip(hashes, blocks))
    return errors


@pytest.mark.slow
async def test_concurrent_puts_with_a_disk_tier_are_not_refused(tmp_path: Path) -> None:
    memory = HeapTier(32 * MiB, framing=functools.partial(reply_head, chunk_bytes=MiB))
    disk = LMDBTier(tmp_path / "disk", 2048 * MiB)
    stored: dict[bytes, bytes] = {}
    async with TieredStore([memory, disk]) as store:
        results = await asyncio.gather(*(_writer(store, w, 30, stored) for w in range(3)))
        errors = [exc for result in results for exc in result]
        assert errors == [], f"{len(errors)} of 90 puts refused, the first: {errors[0]!r}"
        await store.drain()
        # the disk had room for everything: every block is still in some tier, and reads back as put
        for block_hash, block in list(stored.items())[::7]:
            assert await store.get(NS, [block_hash]) == [block]
        counters = store.stats().tiers[0].counters
        assert not [name for name in counters if name.startswith(("refused_puts", "dropped_demotions"))], counters
        assert store.stats().tiers[0].evictions > 0  # the memory tier was over its capacity many times over


async def test_a_refused_put_is_counted_with_its_reason(tmp_path: Path) -> None:
    memory = HeapTier(1 * MiB, framing=functools.partial(reply_head, chunk_bytes=MiB))
    async with TieredStore([memory]) as store:
        hashes = hash_blocks(NS, torch.arange(NS.block_size))
        with pytest.raises(ResourceExhaustedError, match="larger than every tier"):
            await store.put(NS, hashes, [_block(HEAD_DIMS[2], 0)])  # 2 MiB into a 1 MiB tier
        assert store.stats().tiers[0].counters["refused_puts_too_large"] == 1


async def test_a_put_the_memory_tier_cannot_take_goes_to_the_disk_tier(tmp_path: Path) -> None:
    """Every block in memory is being read: a new block is placed in the tier below, not refused."""
    memory = memory_tier(3)
    disk = LMDBTier(tmp_path / "disk", 16 * disk_footprint())
    async with TieredStore([memory, disk]) as store:
        hashes, blocks = make_blocks(3)
        await store.put(NS, hashes, blocks)
        newcomer, new_block = make_blocks(1, seed=5)
        async with store.read(NS, hashes) as got:
            assert len(got) == 3  # all three held by this read
            assert await store.put(NS, newcomer, new_block) == 1
            assert store.index.locate(block_keys(NS, newcomer)) == b"\x01"  # in the disk tier
        assert await store.get(NS, newcomer) == new_block
        assert await store.get(NS, hashes) == blocks
        assert not any(name.startswith("refused_puts") for name in store.stats().tiers[0].counters)
