"""The metadata-only tiers the simulator runs the store over (``kvstore.tiers.metadata``)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, LendingTier, Tier, TierFullError
from kvstore.tiers.metadata import LendingMetadataTier, MetadataTier

A, B, C = BlockKey(b"a" * 24), BlockKey(b"b" * 24), BlockKey(b"c" * 24)
META = BlockMeta()


def test_a_block_is_one_unit_and_no_bytes_are_kept() -> None:
    async def run() -> None:
        tier = MetadataTier(2, name="disk", yields=True)
        assert isinstance(tier, Tier) and not isinstance(tier, LendingTier)
        assert tier.footprint(1) == tier.footprint(1 << 20) == 1
        value = b"x" * 100
        assert await tier.put([A, B], [value, value], [META, META]) == [True, True]
        assert await tier.contains([A, C]) == [True, False]
        got = await tier.get([A, C])
        assert got[0] is value and got[1] is None  # the placeholder, not a copy
        await tier.delete([A, C])
        assert await tier.contains([A, B]) == [False, True] and len(tier) == 1
        assert await tier.resident() == []

    asyncio.run(run())


def test_a_leased_block_keeps_its_unit_until_the_release() -> None:
    async def run() -> None:
        tier = LendingMetadataTier(2, name="memory")
        assert isinstance(tier, LendingTier) and not tier.lends_references
        await tier.put([A, B], [b"a", b"b"], [META, META])
        lease = tier.lend([A, C])
        assert lease is not None and lease.values == [b"a", None]
        await tier.delete([A])
        assert tier.held_bytes == 1  # A is gone, and its unit is still taken
        with pytest.raises(TierFullError):
            await tier.put([C], [b"c"], [META])
        lease.release()
        assert tier.held_bytes == 0
        assert await tier.put([C], [b"c"], [META]) == [True]
        unleased = tier.lend([B])
        assert unleased is not None
        unleased.release()
        await tier.delete([B])  # no lease left on it: its unit is free at once
        assert tier.held_bytes == 0

    asyncio.run(run())
