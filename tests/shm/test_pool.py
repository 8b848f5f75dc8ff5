"""The shared pool (kvstore.shm.node.pool): the tier contract, then what is its own: one namespace per sealed slab,
staged puts taken without a copy, pins that keep ranges, touched bytes under the limit, retiring and compacting."""

from __future__ import annotations

import mmap
import os

import pytest

from kvstore.keys import Namespace
from kvstore.shm.node.pool import PAGE_BYTES, SharedPool, slab_bytes_for
from kvstore.shm.segment import F_SEAL_FUTURE_WRITE
from tests.support.tier_contract import TierContract, make_key, make_sized_block, meta

MiB = 1 << 20
A = Namespace(model="tests/pool-a", dtype="float16", block_size=16)
B = Namespace(model="tests/pool-b", dtype="float16", block_size=16)


class TestSharedPoolContract(TierContract):
    @pytest.fixture
    async def tier(self):  # type: ignore[no-untyped-def]
        pool = SharedPool(4 * MiB)
        yield pool
        await pool.close()


async def test_each_slab_holds_one_namespace_and_is_sealed_against_every_other_writer() -> None:
    pool = SharedPool(8 * MiB)
    try:
        await pool.put([make_key(1, A), make_key(2, B)], [make_sized_block(1, 20_000), make_sized_block(2, 20_000)],
                       [meta(), meta()])
        lease = pool.lend([make_key(1, A), make_key(2, B)])
        assert lease.places is not None and lease.places[0].slab_id != lease.places[1].slab_id
        slab = pool.slab(lease.places[0].slab_id)
        assert slab is not None and slab.tag == A.tag
        fd = slab.read_only_fd()
        try:
            import fcntl

            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
            with pytest.raises(PermissionError):
                mmap.mmap(fd, slab.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            os.fchmod(fd, 0o600)  # the owner may change the mode back, and reopen it for writing...
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):  # ...but the seal refuses every write, root's too
                    os.pwrite(rw, b"x", 0)
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, slab.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        assert bytes(lease.values[0]) == make_sized_block(1, 20_000)
        lease.release()
    finally:
        await pool.close()


async def test_a_staged_block_is_stored_where_it_was_copied_and_the_rest_is_freed() -> None:
    pool = SharedPool(8 * MiB)
    try:
        values = [make_sized_block(i, 50_000) for i in range(3)]
        staging = pool.stage(A.tag, [len(v) for v in values])
        assert staging is not None
        for target, value in zip(staging.targets, values):
            target[:] = memoryview(value)
        await pool.put([make_key(i, A) for i in range(2)], staging.blocks[:2], [meta(), meta()])
        assert pool.counts.staged_adopted == 2
        staging.close()  # the third block was not stored: its range goes back
        lease = pool.lend([make_key(0, A), make_key(1, A)])
        assert lease.places == staging.places[:2]  # stored where they were copied: no copy of the pool's own
        assert [bytes(v) for v in lease.values] == values[:2]
        lease.release()
        slab = pool.slab(staging.places[0].slab_id)
        assert slab is not None and slab.ranges.num_ranges == 2
    finally:
        await pool.close()


async def test_a_range_under_a_pin_is_not_reused_until_the_pin_goes() -> None:
    pool = SharedPool(8 * MiB)
    try:
        key = make_key(1, A)
        await pool.put([key], [make_sized_block(1, 30_000)], [meta()])
        lease = pool.lend([key])
        held = bytes(lease.values[0])
        pool.delete([key])
        assert pool.held_bytes > 0
        await pool.put([make_key(i, A) for i in range(2, 40)], [make_sized_block(i, 30_000) for i in range(2, 40)],
                       [meta()] * 38)
        assert bytes(lease.values[0]) == held  # nothing was written over it
        lease.release()
        assert pool.held_bytes == 0
    finally:
        await pool.close()


async def test_touched_bytes_stay_under_the_limit_as_namespaces_take_turns() -> None:
    capacity = 4 * MiB
    pool = SharedPool(capacity)
    try:
        size = 64 * 1024
        for round_, namespace in enumerate([A, B, A, B]):
            keys = [make_key(round_ * 1000 + i, namespace) for i in range(capacity // size - 2)]
            await pool.put(keys, [make_sized_block(i, size - 100) for i in range(len(keys))], [meta()] * len(keys))
            assert pool.touched_bytes <= pool.touched_limit_bytes
            pool.delete(keys)  # what a tier's eviction does: the next namespace needs the room
        assert pool.counts.slabs_retired > 0
    finally:
        await pool.close()


async def test_a_sparse_slab_is_compacted_for_another_namespace() -> None:
    capacity = 4 * MiB
    pool = SharedPool(capacity)
    try:
        size = 64 * 1024
        keys = [make_key(i, A) for i in range(capacity // size - 2)]
        values = [make_sized_block(i, size - 100) for i in range(len(keys))]
        await pool.put(keys, values, [meta()] * len(keys))
        pool.delete(keys[1:-1:2] + keys[2:-1:2])  # only the first and the last stay: A's slabs are sparse
        kept = [keys[0], keys[-1]]
        others = [make_key(10_000 + i, B) for i in range(capacity // size - 6)]
        await pool.put(others, [make_sized_block(i, size - 100) for i in range(len(others))], [meta()] * len(others))
        assert pool.counts.slabs_compacted + pool.counts.slabs_retired > 0
        assert pool.touched_bytes <= pool.touched_limit_bytes
        lease = pool.lend(kept)
        assert [bytes(v) for v in lease.values] == [values[0], values[-1]]  # moved, whole
        lease.release()
    finally:
        await pool.close()


def test_slabs_are_a_32nd_of_the_capacity_between_1_and_64_MiB() -> None:
    assert slab_bytes_for(64 * MiB) == 2 * MiB
    assert slab_bytes_for(MiB) == MiB
    assert slab_bytes_for(1 << 40) == 64 * MiB
    assert slab_bytes_for(100 * MiB + 1) % PAGE_BYTES == 0


async def test_footprint_tracks_the_blocks_own_size() -> None:
    pool = SharedPool(64 * MiB)
    try:
        for nbytes in (16 * 1024 + 64, 96 * 1024, 32_000, 49_000, 2 * MiB + 64):
            assert pool.footprint(nbytes) / nbytes <= 1.004
    finally:
        await pool.close()
