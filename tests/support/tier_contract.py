"""The one contract suite every tier passes: subclass :class:`TierContract` and provide a ``tier`` fixture.

Usage (see ``tests/tiers/test_memory.py``)::

    class TestMemoryTier(TierContract):
        @pytest.fixture
        async def tier(self):
            tier = MemoryTier(4 * MiB)
            yield tier
            await tier.close()

The fixture must yield an open, empty tier (``resident()`` lists nothing) and
may close it afterwards (``close`` is idempotent by contract). Nothing here
assumes persistence or a capacity beyond what :class:`kvstore.tiers.base.Tier`
promises; capacity tests run only when ``tier.capacity_bytes`` is not ``None``
and at most 256 MiB.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import xxhash

from kvstore.blocks.tensors import decode_block, encode_block, header_nbytes
from kvstore.keys import BlockKey, Namespace, block_key
from kvstore.tiers.base import BlockMeta, ResidentEntry, Tier, TierFullError

_NAMESPACE = Namespace(model="tests/tier-contract", dtype="float16", block_size=16)
SMALL_SHAPE = (2, 2, 2, 16, 8)
"""``[num_layers, 2, num_kv_heads, block_size, head_dim]`` of the blocks most tests use."""


async def stored_nbytes(tier: Tier, value: bytes) -> int:
    """The length a tier stores ``value`` as: a compressing tier's frame (``pack_values``), else the value's."""
    pack = getattr(tier, "pack_values", None)
    return len(value if pack is None else (await pack([value]))[0])


def make_key(i: int, namespace: Namespace = _NAMESPACE) -> BlockKey:
    """A deterministic 24-byte tier key number ``i``."""
    return block_key(namespace, xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def make_tensor(seed: int, shape: tuple[int, ...] = SMALL_SHAPE, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A random KV block tensor of ``shape`` (``[L, 2, H, B, D]``), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_block(seed: int, shape: tuple[int, ...] = SMALL_SHAPE, dtype: torch.dtype = torch.float16) -> bytes:
    """The encoded bytes (``kvstore.blocks.tensors`` format) of :func:`make_tensor`."""
    return encode_block(make_tensor(seed, shape, dtype))


def make_sized_block(seed: int, nbytes: int) -> bytes:
    """An encoded uint8 block of exactly ``nbytes`` bytes (``nbytes - header`` must be even and > 0)."""
    head_dim, odd = divmod(nbytes - header_nbytes(5), 2)
    assert head_dim > 0 and not odd, nbytes
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randint(0, 256, (1, 2, 1, 1, head_dim), generator=gen, dtype=torch.uint8)
    block = encode_block(tensor)
    assert len(block) == nbytes
    return block


def meta(priority: int = 35, *, expires_at: float = 0.0, last_access: float | None = None) -> BlockMeta:
    """A :class:`BlockMeta` whose last access defaults to now."""
    return BlockMeta(priority, expires_at, time.time() if last_access is None else last_access)


class TierContract:
    """Behaviour every :class:`kvstore.tiers.base.Tier` shares; needs a ``tier`` fixture (open, empty)."""

    async def test_is_a_tier(self, tier: Tier) -> None:
        assert isinstance(tier, Tier)
        assert isinstance(tier.name, str) and tier.name
        assert isinstance(tier.persistent, bool)
        assert tier.capacity_bytes is None or (isinstance(tier.capacity_bytes, int) and tier.capacity_bytes > 0)

    async def test_footprint_covers_the_value_and_grows_with_it(self, tier: Tier) -> None:
        sizes = [1, 100, 4096, 65536, 65537, 2 * 1024 * 1024 + 128]
        footprints = [tier.footprint(n) for n in sizes]
        assert all(f >= n for f, n in zip(footprints, sizes))
        assert footprints == sorted(footprints)

    async def test_round_trip_of_real_blocks(self, tier: Tier) -> None:
        tensors = [
            make_tensor(1),
            make_tensor(2, dtype=torch.bfloat16),
            make_tensor(3, shape=(4, 2, 8, 16, 64)),  # 128 KiB payload: several pages on paged tiers
            make_tensor(4, shape=(1, 2, 1, 16, 8), dtype=torch.float32),
        ]
        keys = [make_key(i) for i in range(len(tensors))]
        values = [encode_block(t) for t in tensors]
        assert await tier.put(keys, values, [meta()] * len(keys)) == [True] * len(keys)
        got = await tier.get(keys)
        assert got == values
        for value, tensor in zip(got, tensors):
            assert isinstance(value, bytes)
            decoded = decode_block(value)
            assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
            assert torch.equal(decoded, tensor)

    async def test_get_keeps_batch_order_and_reports_misses_as_none(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(4)]
        values = [make_block(i) for i in range(4)]
        await tier.put(keys[:2], values[:2], [meta()] * 2)
        assert await tier.get([keys[1], keys[3], keys[0], keys[2], keys[1]]) == [
            values[1], None, values[0], None, values[1],
        ]
        assert await tier.get([make_key(99)]) == [None]

    async def test_contains(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(3)]
        await tier.put([keys[0], keys[2]], [make_block(0), make_block(2)], [meta()] * 2)
        assert await tier.contains(keys) == [True, False, True]
        assert await tier.contains([keys[2], keys[2], keys[1]]) == [True, True, False]

    async def test_delete_removes_only_the_named_keys_and_ignores_missing_ones(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(3)]
        values = [make_block(i) for i in range(3)]
        await tier.put(keys, values, [meta()] * 3)
        await tier.delete([keys[1], make_key(42), keys[1]])
        assert await tier.contains(keys) == [True, False, True]
        assert await tier.get(keys) == [values[0], None, values[2]]
        await tier.delete([make_key(43)])
        await tier.delete([])
        await tier.delete(keys)
        assert await tier.contains(keys) == [False, False, False]
        assert await tier.resident() == []

    async def test_a_delete_takes_effect_when_called_so_a_later_put_survives_it(self, tier: Tier) -> None:
        """The store forgets a block and calls ``delete`` in one step; a put of the key made after that call, even
        before the delete is awaited, must not be deleted by it."""
        key, value = make_key(0), make_block(0)
        await tier.put([key], [value], [meta()])
        deleting = tier.delete([key])
        put = tier.put([key], [value], [meta()])
        await deleting
        assert await put == [True]
        assert await tier.get([key]) == [value]

    async def test_put_of_a_held_key_replaces_value_and_meta(self, tier: Tier) -> None:
        key = make_key(0)
        first, second = make_block(1), make_block(2, shape=(2, 2, 4, 16, 8))
        await tier.put([key], [first], [meta(10)])
        assert await tier.put([key], [second], [meta(90)]) == [True]
        assert await tier.get([key]) == [second]
        [entry] = await tier.resident()
        assert (entry.key, entry.nbytes, entry.meta.priority) == (key, await stored_nbytes(tier, second), 90)

    async def test_last_occurrence_of_a_key_in_one_batch_wins(self, tier: Tier) -> None:
        key, other = make_key(0), make_key(1)
        first, second, third = make_block(1), make_block(2), make_block(3)
        assert await tier.put([key, other, key], [first, third, second], [meta(20), meta(), meta(70)]) == [True] * 3
        assert await tier.get([key, other]) == [second, third]
        entries = {e.key: e for e in await tier.resident()}
        assert set(entries) == {key, other}
        assert entries[key].meta.priority == 70

    async def test_concurrent_puts_of_one_key_both_succeed_and_store_one_whole_value(self, tier: Tier) -> None:
        key = make_key(0)
        first, second = make_block(1, shape=(4, 2, 8, 16, 64)), make_block(2, shape=(4, 2, 8, 16, 64))
        results = await asyncio.gather(
            tier.put([key], [first], [meta()]), tier.put([key], [second], [meta()])
        )
        assert results == [[True], [True]]
        [got] = await tier.get([key])
        assert got in (first, second)
        assert [e.key for e in await tier.resident()] == [key]

    async def test_concurrent_batches_do_not_mix(self, tier: Tier) -> None:
        num_batches, per_batch = 6, 4
        batches = [[make_key(b * per_batch + i) for i in range(per_batch)] for b in range(num_batches)]
        values = {k: make_block(j, shape=(2, 2, 4, 16, 16)) for j, k in enumerate(sum(batches, []))}

        async def put_then_get(keys: list[BlockKey]) -> list[bytes | None]:
            await tier.put(keys, [values[k] for k in keys], [meta()] * len(keys))
            return await tier.get(keys)

        results = await asyncio.gather(*(put_then_get(keys) for keys in batches))
        for keys, got in zip(batches, results):
            assert got == [values[k] for k in keys]

    async def test_resident_lists_every_block_held_with_its_meta(self, tier: Tier) -> None:
        now = time.time()
        keys = [make_key(i) for i in range(3)]
        values = [make_block(i) for i in range(3)]
        metas = [
            BlockMeta(0, 0.0, now - 30.0),
            BlockMeta(35, 0.0, now - 20.0),
            BlockMeta(100, now + 600.0, now - 10.0),
        ]
        await tier.put(keys, values, metas)
        await tier.delete([keys[1]])
        entries = await tier.resident()
        assert all(isinstance(e, ResidentEntry) for e in entries)
        by_key = {e.key: e for e in entries}
        assert len(entries) == len(by_key) == 2
        assert set(by_key) == {keys[0], keys[2]}
        for i in (0, 2):
            entry = by_key[keys[i]]
            assert entry.nbytes == await stored_nbytes(tier, values[i])
            assert entry.meta.priority == metas[i].priority
            assert entry.meta.expires_at == pytest.approx(metas[i].expires_at)
            assert entry.meta.last_access >= metas[i].last_access - 1e-3

    async def test_empty_batches(self, tier: Tier) -> None:
        assert await tier.put([], [], []) == []
        assert await tier.get([]) == []
        assert await tier.contains([]) == []
        await tier.delete([])

    async def test_put_with_mismatched_lengths_raises_and_stores_nothing(self, tier: Tier) -> None:
        with pytest.raises(ValueError):
            await tier.put([make_key(0), make_key(1)], [make_block(0)], [meta()])
        assert await tier.contains([make_key(0), make_key(1)]) == [False, False]

    async def test_counters_are_named_ints_starting_with_no_corrupt_records(self, tier: Tier) -> None:
        await tier.put([make_key(0)], [make_block(0)], [meta()])
        await tier.get([make_key(0), make_key(1)])
        counters = tier.counters()
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in counters.items())
        assert counters["corrupt_records"] == 0

    async def test_capacity_is_never_exceeded_and_a_full_batch_stores_nothing(self, tier: Tier) -> None:
        capacity = tier.capacity_bytes
        if capacity is None or capacity > 256 * 1024 * 1024:
            pytest.skip("the tier has no capacity of its own, or too large a one to fill in a test")
        nbytes = (capacity // 8) // 2 * 2 - 512  # about 8 blocks fit
        fit = capacity // tier.footprint(nbytes)
        assert fit >= 2
        keys = [make_key(i) for i in range(fit + 2)]
        values = [make_sized_block(i, nbytes) for i in range(fit + 2)]
        assert await tier.put(keys[:fit], values[:fit], [meta()] * fit) == [True] * fit
        with pytest.raises(TierFullError):
            await tier.put([keys[fit]], [values[fit]], [meta()])
        await tier.delete([keys[0]])
        with pytest.raises(TierFullError):  # room for one, not two: neither is stored
            await tier.put(keys[fit:], values[fit:], [meta()] * 2)
        assert await tier.contains(keys[fit:]) == [False, False]
        assert await tier.put([keys[fit]], [values[fit]], [meta()]) == [True]
        assert await tier.get(keys[1 : fit + 1]) == values[1 : fit + 1]
        assert sum(tier.footprint(e.nbytes) for e in await tier.resident()) <= capacity

    async def test_close_is_idempotent(self, tier: Tier) -> None:
        await tier.put([make_key(0)], [make_block(0)], [meta()])
        await tier.close()
        await tier.close()
