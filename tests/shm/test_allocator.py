"""The range allocator as pure logic: first fit, alignment, merging of free neighbours, and a random model check."""

from __future__ import annotations

import random

import pytest

from kvstore.shm.allocator import RangeAllocator


def test_ranges_come_first_fit_from_the_bottom_and_aligned() -> None:
    ranges = RangeAllocator(64 * 1024, alignment=4096)
    assert ranges.allocate(1) == 0
    assert ranges.allocate(4097) == 4096
    assert ranges.allocate(4096) == 3 * 4096
    assert ranges.used_bytes == 4 * 4096
    assert ranges.free(4096) == 2 * 4096
    assert ranges.allocate(100) == 4096  # the lowest hole that fits
    assert ranges.allocate(4096) == 2 * 4096


def test_freed_neighbours_merge_so_a_large_range_fits_again() -> None:
    ranges = RangeAllocator(16 * 4096, alignment=4096)
    offsets = [ranges.allocate(4096) for _ in range(16)]
    assert ranges.allocate(1) is None
    for offset in offsets[3:9]:  # out of order: merges both ways
        pass
    for offset in (offsets[5], offsets[3], offsets[4], offsets[8], offsets[6], offsets[7]):
        ranges.free(offset)
    assert ranges.free_ranges() == [(3 * 4096, 6 * 4096)]
    assert ranges.allocate(6 * 4096) == 3 * 4096
    assert ranges.allocate(1) is None


def test_a_range_larger_than_the_capacity_never_fits() -> None:
    ranges = RangeAllocator(8192, alignment=4096)
    assert ranges.allocate(8193) is None
    assert ranges.allocate(8192) == 0


def test_freeing_what_was_not_handed_out_is_an_error() -> None:
    ranges = RangeAllocator(8192)
    offset = ranges.allocate(10)
    ranges.free(offset)
    with pytest.raises(KeyError):
        ranges.free(offset)


@pytest.mark.parametrize("capacity, alignment", [(0, 64), (4096, 3)])
def test_bad_settings_are_refused(capacity: int, alignment: int) -> None:
    with pytest.raises(ValueError):
        RangeAllocator(capacity, alignment)


@pytest.mark.parametrize("seed", range(5))
def test_random_allocations_never_overlap_and_account_exactly(seed: int) -> None:
    rng = random.Random(seed)
    ranges = RangeAllocator(1 << 20, alignment=64)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            assert ranges.free(offset) == held.pop(offset)
        else:
            nbytes = rng.randint(1, 64 * 1024)
            offset = ranges.allocate(nbytes)
            if offset is None:
                assert max((size for _, size in ranges.free_ranges()), default=0) < ranges.aligned(nbytes)
                continue
            held[offset] = ranges.aligned(nbytes)
        spans = sorted(held.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no overlap
        assert ranges.used_bytes == sum(held.values())
        free = ranges.free_ranges()
        assert sum(size for _, size in free) == ranges.free_bytes
        assert all(a + n < b for (a, n), (b, _) in zip(free, free[1:]))  # merged: no two free ranges touch
