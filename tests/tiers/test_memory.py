"""Tests of the memory tier: the shared contract (copies inline and in threads), then the page pool."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvstore.config import MemoryTierConfig
from kvstore.errors import ConfigError, InvalidArgumentError, UnavailableError
from kvstore.tiers.base import BlockMeta, TierFullError
from kvstore.tiers.memory import MemoryTier, PageAllocator
from tests.support.tier_contract import TierContract, make_block, make_key, make_sized_block, meta

KiB = 1024
MiB = 1024 * KiB
PAGE = 16 * KiB

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class TestMemoryTierContract(TierContract):
    @pytest.fixture(params=["inline", "threads"])
    async def tier(self, request):
        offload_min_bytes = 1 << 62 if request.param == "inline" else 0
        tier = MemoryTier(4 * MiB, page_bytes=PAGE, offload_min_bytes=offload_min_bytes)
        yield tier
        await tier.close()


def _block_of_pages(seed: int, num_pages: int, page_bytes: int = PAGE) -> bytes:
    """An encoded block that fills exactly ``num_pages`` pages."""
    return make_sized_block(seed, num_pages * page_bytes)


# -- the page allocator ------------------------------------------------------------


def test_allocator_takes_the_shortest_run_that_fits():
    alloc = PageAllocator(10)
    assert alloc.allocate(2) == [(0, 2)]
    assert alloc.allocate(3) == [(2, 3)]
    assert alloc.allocate(1) == [(5, 1)]
    alloc.free(2, 3)  # free runs: [2, 5) and [6, 10)
    assert alloc.allocate(3) == [(2, 3)]
    assert alloc.num_free_pages == 4 and alloc.num_free_runs == 1


def test_allocator_gathers_pieces_when_no_run_is_long_enough():
    alloc = PageAllocator(8)
    runs = [alloc.allocate(1)[0] for _ in range(8)]
    for start, count in runs[::2]:
        alloc.free(start, count)
    pieces = alloc.allocate(3)
    assert sum(count for _, count in pieces) == 3 and len(pieces) == 3
    assert len({start for start, _ in pieces}) == 3
    assert alloc.num_free_pages == 1


def test_allocator_refuses_more_than_is_free_and_takes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(TierFullError):
        alloc.allocate(2)
    assert alloc.num_free_pages == 1
    assert alloc.allocate(0) == []


def test_allocator_coalesces_freed_neighbours_back_into_one_run():
    alloc = PageAllocator(12)
    runs = [alloc.allocate(3)[0] for _ in range(4)]
    for start, count in (runs[1], runs[3], runs[0], runs[2]):
        alloc.free(start, count)
    assert alloc.num_free_runs == 1 and alloc.num_free_pages == 12
    assert alloc.allocate(12) == [(0, 12)]


# -- the tier -----------------------------------------------------------------------------


def test_capacity_is_whole_pages_and_footprint_rounds_up_to_pages():
    tier = MemoryTier(4 * MiB + 100, page_bytes=PAGE)
    assert tier.capacity_bytes == 4 * MiB
    assert tier.num_pages == tier.num_free_pages == 4 * MiB // PAGE
    assert tier.footprint(1) == PAGE
    assert tier.footprint(PAGE) == PAGE
    assert tier.footprint(PAGE + 1) == 2 * PAGE
    assert tier.footprint(0) == 0


def test_from_config():
    tier = MemoryTier.from_config(MemoryTierConfig(capacity_bytes=2 * MiB, page_bytes=32 * KiB, pin_memory=False))
    assert (tier.capacity_bytes, tier.page_bytes, tier.name, tier.persistent) == (2 * MiB, 32 * KiB, "memory", False)
    assert tier.pinned is False


def test_bad_arguments_raise():
    with pytest.raises(InvalidArgumentError):
        MemoryTier(MiB, page_bytes=0)
    with pytest.raises(InvalidArgumentError):
        MemoryTier(-1)


def test_pool_is_pinned_only_when_cuda_is_there():
    assert MemoryTier(MiB, page_bytes=PAGE).pinned == torch.cuda.is_available()
    assert MemoryTier(MiB, page_bytes=PAGE, pin_memory=False).pinned is False


@pytest.mark.slow
async def test_pages_are_reused_and_the_pool_never_grows():
    tier = MemoryTier(2 * MiB, page_bytes=PAGE)
    pool_ptr, pool_shape = tier._pool.data_ptr(), tuple(tier._pool.shape)
    sizes = [1, 3, 7, 2, 5, 16, 4]  # pages per block
    for cycle in range(20):
        keys = [make_key(cycle * 100 + i) for i in range(len(sizes))]
        values = [_block_of_pages(cycle * 100 + i, n) for i, n in enumerate(sizes)]
        await tier.put(keys, values, [meta()] * len(keys))
        assert tier.num_free_pages == tier.num_pages - sum(sizes)
        assert await tier.get(keys) == values
        await tier.delete(keys[::-1] if cycle % 2 else keys)
    assert (tier._pool.data_ptr(), tuple(tier._pool.shape)) == (pool_ptr, pool_shape)
    assert tier.num_free_pages == tier.num_pages and tier.used_bytes == 0
    await tier.close()


async def test_a_block_spans_scattered_pages_when_the_pool_is_fragmented():
    tier = MemoryTier(16 * PAGE, page_bytes=PAGE)
    keys = [make_key(i) for i in range(16)]
    await tier.put(keys, [_block_of_pages(i, 1) for i in range(16)], [meta()] * 16)
    await tier.delete(keys[::2])  # 8 free pages, no two adjacent
    big = make_sized_block(100, 8 * PAGE - 64)  # needs all 8 scattered pages
    await tier.put([make_key(100)], [big], [meta()])
    assert tier.num_free_pages == 0
    assert await tier.get([make_key(100)]) == [big]
    assert await tier.get(keys[1::2]) == [_block_of_pages(i, 1) for i in range(1, 16, 2)]
    with pytest.raises(TierFullError):
        await tier.put([make_key(200)], [_block_of_pages(200, 1)], [meta()])
    await tier.close()


async def test_a_batch_that_does_not_fit_stores_nothing():
    tier = MemoryTier(8 * PAGE, page_bytes=PAGE)
    await tier.put([make_key(0)], [_block_of_pages(0, 3)], [meta()])
    with pytest.raises(TierFullError):
        await tier.put(
            [make_key(1), make_key(2)], [_block_of_pages(1, 2), _block_of_pages(2, 4)], [meta()] * 2
        )
    assert await tier.contains([make_key(1), make_key(2)]) == [False, False]
    assert tier.num_free_pages == 5
    assert await tier.get([make_key(0)]) == [_block_of_pages(0, 3)]
    await tier.close()


async def test_a_full_pool_can_still_replace_a_block_in_place():
    tier = MemoryTier(4 * PAGE, page_bytes=PAGE)
    keys = [make_key(0), make_key(1)]
    await tier.put(keys, [_block_of_pages(0, 2), _block_of_pages(1, 2)], [meta()] * 2)
    newer = _block_of_pages(9, 2)
    assert await tier.put([keys[0]], [newer], [meta(80)]) == [True]
    assert await tier.get(keys) == [newer, _block_of_pages(1, 2)]
    assert tier.num_free_pages == 0
    with pytest.raises(TierFullError):  # three pages do not fit in the two that key 0 frees
        await tier.put([keys[0]], [_block_of_pages(10, 3)], [meta()])
    assert await tier.get([keys[0]]) == [newer]
    await tier.close()


@pytest.mark.parametrize("num_blocks_room", [1, 2])
async def test_pages_a_get_is_copying_are_not_reused_until_it_ends(num_blocks_room):
    """A delete during a threaded get must not let a put overwrite the pages being copied."""
    block_pages = 16
    tier = MemoryTier(num_blocks_room * block_pages * PAGE, page_bytes=PAGE, offload_min_bytes=0)
    old, new = _block_of_pages(1, block_pages), _block_of_pages(2, block_pages)
    await tier.put([make_key(1)], [old], [meta()])

    async def delete_then_reuse():
        await tier.delete([make_key(1)])
        return await tier.put([make_key(2)], [new], [meta()])

    got, reused = await asyncio.gather(tier.get([make_key(1)]), delete_then_reuse(), return_exceptions=True)
    assert got == [old]
    if num_blocks_room == 1:
        assert isinstance(reused, TierFullError)  # the only pages were still being read
        assert tier.num_free_pages == tier.num_pages  # ...and came back when the get ended
        await tier.put([make_key(2)], [new], [meta()])
    else:
        assert reused == [True]
        assert tier.num_free_pages == tier.num_pages - block_pages
    assert await tier.get([make_key(1), make_key(2)]) == [None, new]
    await tier.close()


async def test_concurrent_overwrite_during_threaded_get_frees_the_old_pages_once():
    tier = MemoryTier(64 * PAGE, page_bytes=PAGE, offload_min_bytes=0)
    key = make_key(0)
    values = [_block_of_pages(i, 8) for i in range(4)]
    await tier.put([key], [values[0]], [meta()])
    results = await asyncio.gather(
        tier.get([key]), tier.put([key], [values[1]], [meta()]),
        tier.get([key]), tier.put([key], [values[2]], [meta()]), tier.get([key, key]),
    )
    for got in (results[0], results[2], results[4]):
        assert all(v in values[:3] for v in got)
    assert results[1] == results[3] == [True]
    await tier.put([key], [values[3]], [meta()])
    assert await tier.get([key]) == [values[3]]
    assert tier.num_free_pages == tier.num_pages - 8
    await tier.delete([key])
    assert tier.num_free_pages == tier.num_pages
    await tier.close()


async def test_bytes_like_values_are_accepted_and_bytes_come_back():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    value = make_block(0)
    await tier.put([make_key(0), make_key(1)], [bytearray(value), memoryview(value)], [meta()] * 2)
    got = await tier.get([make_key(0), make_key(1)])
    assert got == [value, value] and all(type(v) is bytes for v in got)
    await tier.close()


async def test_use_after_close_raises_unavailable():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    await tier.close()
    for call in (lambda: tier.get([make_key(0)]), lambda: tier.contains([make_key(0)]),
                 lambda: tier.delete([make_key(0)]), lambda: tier.put([make_key(0)], [make_block(0)], [meta()]),
                 tier.resident):
        with pytest.raises(UnavailableError):  # a delete raises at the call, the others when awaited
            await call()


async def test_counters_stay_zero_because_memory_is_not_reverified():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    await tier.put([make_key(0)], [make_block(0)], [meta()])
    await tier.get([make_key(0)])
    assert tier.counters() == {"corrupt_records": 0}
    await tier.close()


@pytest.mark.cuda
@cuda_only
async def test_cuda_pool_round_trip_inline_and_threaded():
    for offload_min_bytes in (1 << 62, 0):
        tier = MemoryTier(8 * MiB, device="cuda:0", page_bytes=PAGE, offload_min_bytes=offload_min_bytes)
        assert tier._pool.device.type == "cuda"
        keys = [make_key(i) for i in range(4)]
        values = [make_block(i, shape=(4, 2, 8, 16, 64)) for i in range(4)]
        await tier.put(keys, values, [meta()] * 4)
        await tier.delete([keys[1]])
        assert await tier.get(keys) == [values[0], None, values[2], values[3]]
        await tier.close()


@pytest.mark.cuda
@cuda_only
def test_cpu_pool_is_pinned_with_cuda():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    assert tier.pinned and tier._pool.is_pinned()


async def test_priority_outside_0_to_100_is_refused():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    with pytest.raises(InvalidArgumentError):
        await tier.put([make_key(0)], [make_block(0)], [BlockMeta(101)])
    assert await tier.contains([make_key(0)]) == [False] and tier.num_free_pages == tier.num_pages
    await tier.close()


async def test_record_keeps_meta_exactly_and_stays_small():
    tier = MemoryTier(64 * PAGE, page_bytes=PAGE)
    m = BlockMeta(77, 1234.5, 987.25)
    await tier.put([make_key(0)], [_block_of_pages(0, 3)], [m])
    [entry] = await tier.resident()
    assert entry.meta == m and entry.nbytes == 3 * PAGE and tier.num_blocks == 1
    assert len(tier._index[make_key(0)]) == 33  # one run: the fixed head only
    await tier.close()


@pytest.mark.parametrize("operation", ["put", "get"])
async def test_a_cancelled_threaded_copy_keeps_its_pages_until_the_thread_ends(operation):
    """Cancelling the caller must not free pages a worker thread is still copying."""
    block_pages = 8
    tier = MemoryTier(block_pages * PAGE, page_bytes=PAGE, offload_min_bytes=0)
    value, other = _block_of_pages(1, block_pages), _block_of_pages(2, block_pages)
    started, release = threading.Event(), threading.Event()
    real_copy = tier._copy_in_all if operation == "put" else tier._copy_out_all

    def held_copy(*args):
        started.set()
        release.wait(10)
        return real_copy(*args)

    if operation == "get":
        await tier.put([make_key(1)], [value], [meta()])
        tier._copy_out_all = held_copy
        task = asyncio.create_task(tier.get([make_key(1)]))
    else:
        tier._copy_in_all = held_copy
        task = asyncio.create_task(tier.put([make_key(1)], [value], [meta()]))
    await asyncio.to_thread(started.wait, 10)  # the worker thread is in the copy
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tier.delete([make_key(1)])
    with pytest.raises(TierFullError):  # the thread still holds every page
        await tier.put([make_key(2)], [other], [meta()])
    release.set()
    for _ in range(1000):
        if tier.num_free_pages == tier.num_pages:
            break
        await asyncio.sleep(0.01)  # polling: the pages come back when the worker thread ends, which has no hook
    assert tier.num_free_pages == tier.num_pages
    assert await tier.contains([make_key(1)]) == [False]
    await tier.put([make_key(2)], [other], [meta()])
    assert await tier.get([make_key(2)]) == [other]
    await tier.close()


# -- leases: blocks lent in place -----------------------------------------------------

from kvstore.tiers.base import LendingTier, TierLoan  # noqa: E402


def test_a_memory_tier_is_a_leasing_tier():
    assert isinstance(MemoryTier(MiB, page_bytes=PAGE), LendingTier)


async def test_a_lease_lends_views_of_the_pool_and_none_for_misses():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    values = [_block_of_pages(0, 2), make_block(1)]
    await tier.put([make_key(0), make_key(1)], values, [meta()] * 2)
    lease = tier.lend([make_key(0), make_key(9), make_key(1)])
    assert isinstance(lease, TierLoan)
    assert lease.values[1] is None
    for view, value in zip((lease.values[0], lease.values[2]), values):
        assert isinstance(view, memoryview)
        assert view.nbytes == len(value) and view == value
    tier._flat.fill_(0x5A)  # the views are the pool itself, not copies
    assert all(bytes(view) == b"\x5a" * view.nbytes for view in (lease.values[0], lease.values[2]))
    lease.release()
    await tier.close()


async def test_leased_views_are_read_only():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    await tier.put([make_key(0)], [make_block(0)], [meta()])
    lease = tier.lend([make_key(0)])
    try:
        assert lease.values[0].readonly
    finally:
        lease.release()
        await tier.close()


async def test_a_lease_keeps_deleted_pages_until_it_is_released():
    block_pages = 4
    tier = MemoryTier(2 * block_pages * PAGE, page_bytes=PAGE)
    old = _block_of_pages(1, block_pages)
    await tier.put([make_key(1)], [old], [meta()])
    lease = tier.lend([make_key(1)])
    await tier.delete([make_key(1)])
    assert await tier.contains([make_key(1)]) == [False]  # unpublished at once...
    assert tier.num_free_pages == tier.num_pages - block_pages  # ...but its pages stay taken
    await tier.put([make_key(2)], [_block_of_pages(2, block_pages)], [meta()])  # takes the other half
    with pytest.raises(TierFullError):  # the only other pages are the leased ones
        await tier.put([make_key(3)], [_block_of_pages(3, block_pages)], [meta()])
    assert lease.values[0] == old
    lease.release()
    assert tier.num_free_pages == tier.num_pages - block_pages
    await tier.put([make_key(3)], [_block_of_pages(3, block_pages)], [meta()])
    assert await tier.get([make_key(2), make_key(3)]) == [_block_of_pages(2, block_pages),
                                                          _block_of_pages(3, block_pages)]
    await tier.close()


async def test_an_overwrite_during_a_lease_leaves_the_leased_view_unchanged():
    block_pages = 3
    tier = MemoryTier(2 * block_pages * PAGE, page_bytes=PAGE)
    old, new = _block_of_pages(1, block_pages), _block_of_pages(2, block_pages)
    await tier.put([make_key(1)], [old], [meta()])
    lease = tier.lend([make_key(1)])
    assert await tier.put([make_key(1)], [new], [meta()]) == [True]
    assert await tier.get([make_key(1)]) == [new]
    assert lease.values[0] == old
    assert tier.used_bytes == 2 * block_pages * PAGE  # the old value's pages wait for the release
    with pytest.raises(TierFullError):  # replacing again needs the pages the lease holds
        await tier.put([make_key(1)], [_block_of_pages(3, 2 * block_pages)], [meta()])
    lease.release()
    assert tier.used_bytes == block_pages * PAGE
    await tier.close()


async def test_a_full_pool_cannot_replace_a_leased_block_in_place():
    tier = MemoryTier(4 * PAGE, page_bytes=PAGE)
    keys = [make_key(0), make_key(1)]
    await tier.put(keys, [_block_of_pages(0, 2), _block_of_pages(1, 2)], [meta()] * 2)
    lease = tier.lend(keys[:1])
    with pytest.raises(TierFullError):  # without the lease this reuses key 0's own pages
        await tier.put(keys[:1], [_block_of_pages(9, 2)], [meta()])
    assert await tier.get(keys[:1]) == [_block_of_pages(0, 2)] and lease.values[0] == _block_of_pages(0, 2)
    lease.release()
    assert await tier.put(keys[:1], [_block_of_pages(9, 2)], [meta()]) == [True]
    assert await tier.get(keys[:1]) == [_block_of_pages(9, 2)]
    await tier.close()


async def test_releasing_a_lease_twice_releases_it_once():
    block_pages = 2
    tier = MemoryTier(block_pages * PAGE, page_bytes=PAGE)
    value = _block_of_pages(1, block_pages)
    await tier.put([make_key(1)], [value], [meta()])
    first, second = tier.lend([make_key(1)]), tier.lend([make_key(1)])
    first.release()
    first.release()  # harmless: it must not give back the pin of the second lease
    await tier.delete([make_key(1)])
    assert tier.num_free_pages == 0
    with pytest.raises(TierFullError):
        await tier.put([make_key(2)], [_block_of_pages(2, block_pages)], [meta()])
    assert second.values[0] == value
    second.release()
    assert tier.num_free_pages == tier.num_pages
    second.release()
    assert tier.num_free_pages == tier.num_pages
    await tier.close()


async def test_one_key_leased_twice_in_one_batch_is_pinned_twice():
    tier = MemoryTier(2 * PAGE, page_bytes=PAGE)
    value = _block_of_pages(1, 2)
    await tier.put([make_key(1)], [value], [meta()])
    lease = tier.lend([make_key(1), make_key(1)])
    assert lease.values == [value, value]
    await tier.delete([make_key(1)])
    lease.release()
    assert tier.num_free_pages == tier.num_pages
    await tier.close()


async def test_a_block_on_scattered_pages_is_leased_as_a_copy_and_pins_nothing():
    tier = MemoryTier(16 * PAGE, page_bytes=PAGE)
    keys = [make_key(i) for i in range(16)]
    await tier.put(keys, [_block_of_pages(i, 1) for i in range(16)], [meta()] * 16)
    await tier.delete(keys[::2])  # 8 free pages, no two adjacent
    big = make_sized_block(100, 8 * PAGE - 64)
    await tier.put([make_key(100)], [big], [meta()])
    lease = tier.lend([make_key(100), keys[1]])
    assert type(lease.values[0]) is bytes and lease.values[0] == big
    assert isinstance(lease.values[1], memoryview) and lease.values[1] == _block_of_pages(1, 1)
    await tier.delete([make_key(100)])
    assert tier.num_free_pages == 8  # the copied block held no pin: its pages are free at once
    assert lease.values[0] == big
    lease.release()
    await tier.close()


async def test_a_lease_of_nothing_but_misses_can_be_released():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    lease = tier.lend([make_key(0), make_key(1)])
    assert lease.values == [None, None]
    lease.release()
    assert tier.lend([]).values == []
    await tier.close()


async def test_leased_views_outlive_a_close_and_release_after_it_is_harmless():
    tier = MemoryTier(MiB, page_bytes=PAGE)
    value = make_block(0)
    await tier.put([make_key(0)], [value], [meta()])
    lease = tier.lend([make_key(0)])
    await tier.close()
    assert lease.values[0] == value
    lease.release()
    with pytest.raises(UnavailableError):
        tier.lend([make_key(0)])


@pytest.mark.cuda
@cuda_only
async def test_a_cuda_pool_does_not_lend():
    tier = MemoryTier(MiB, device="cuda:0", page_bytes=PAGE)
    await tier.put([make_key(0)], [make_block(0)], [meta()])
    assert tier.lend([make_key(0)]) is None
    assert await tier.get([make_key(0)]) == [make_block(0)]
    await tier.close()


# -- small pages, batches in one run, tensors encoded in place -------------------------


def test_allocator_takes_one_run_or_nothing():
    alloc = PageAllocator(10)
    assert alloc.allocate_run(4) == (0, 4)
    alloc.allocate(2)
    alloc.free(0, 4)  # free runs: [0, 4) and [6, 10)
    assert alloc.allocate_run(5) is None and alloc.num_free_pages == 8  # none is 5 long: nothing taken
    assert alloc.allocate_run(4) in ((0, 4), (6, 4))
    assert alloc.allocate_run(0) is None


def test_the_default_page_makes_a_block_take_its_own_length():
    tier = MemoryTier(1 * MiB, pin_memory=False)
    assert tier.page_bytes == 256 == MemoryTierConfig().page_bytes
    block = 96 * KiB + 128  # a 96 KiB payload behind its header: 128 KiB of 64 KiB pages before
    assert tier.footprint(block) == 96 * KiB + 256
    assert tier.footprint(block) / block <= 1.05


def test_a_page_that_is_not_a_multiple_of_64_bytes_is_refused():
    with pytest.raises(InvalidArgumentError, match="multiple of 64"):
        MemoryTier(MiB, page_bytes=100)
    with pytest.raises(ConfigError, match="page_bytes"):
        MemoryTierConfig(page_bytes=100)


def test_a_pool_of_more_pages_than_a_record_can_name_is_refused():
    with pytest.raises(InvalidArgumentError, match="raise page_bytes"):
        MemoryTier(1 << 40, page_bytes=64)  # checked before the pool is made


async def test_a_batch_takes_one_run_and_a_lease_names_its_blocks_in_the_pool():
    tier = MemoryTier(4 * MiB, pin_memory=False)
    blocks = [make_sized_block(i, 3000) for i in range(4)]
    keys = [make_key(i) for i in range(4)]
    await tier.put(keys, blocks, [meta()] * 4)
    lease = tier.lend(keys)
    try:
        assert lease.offsets is not None and lease.pool is not None
        step = tier.footprint(3000)
        assert [o - lease.offsets[0] for o in lease.offsets] == [0, step, 2 * step, 3 * step]
        for offset, block, value in zip(lease.offsets, blocks, lease.values):
            assert bytes(lease.pool[offset:offset + len(block)].numpy()) == block == bytes(value)
    finally:
        lease.release()


@pytest.mark.parametrize("offload_min_bytes", [1 << 62, 0], ids=["inline", "threads"])
@pytest.mark.parametrize("num_blocks", [1, 3])
async def test_tensors_are_encoded_in_the_pool_byte_for_byte_as_encode_block(offload_min_bytes, num_blocks):
    from kvstore.blocks.copying import tensor_blocks
    from kvstore.blocks.tensors import encode_block

    tier = MemoryTier(4 * MiB, pin_memory=False, offload_min_bytes=offload_min_bytes)
    tensors = [torch.randn(2, 2, 2, 16, 8).to(torch.bfloat16) for _ in range(num_blocks)]
    keys = [make_key(i) for i in range(num_blocks)]
    await tier.put(keys, tensor_blocks(tensors, "kv"), [meta()] * num_blocks)
    assert await tier.get(keys) == [encode_block(t) for t in tensors]
    await tier.close()


async def test_tensors_over_scattered_pages_are_encoded_once_then_copied():
    from kvstore.blocks.copying import tensor_blocks
    from kvstore.blocks.tensors import encode_block

    tensor = torch.randn(1, 2, 1, 16, 64)  # float32: 8 KiB of payload, 33 pages of 256 bytes with its header
    pages = -(-(len(encode_block(tensor))) // 256)
    tier = MemoryTier(2 * pages * 256, pin_memory=False)
    fill = [make_sized_block(i, 256 * (pages // 2)) for i in range(4)]
    await tier.put([make_key(i) for i in range(4)], fill, [meta()] * 4)
    await tier.delete([make_key(0), make_key(2)])  # free pages left in two runs, neither long enough
    await tier.put([make_key(9)], tensor_blocks([tensor], "kv"), [meta()])
    assert await tier.get([make_key(9)]) == [encode_block(tensor)]
    await tier.close()
