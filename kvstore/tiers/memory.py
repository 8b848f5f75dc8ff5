"""The memory tier: encoded blocks in one preallocated page pool on the host (pinned) or a GPU.

The pool is a single ``torch.empty(num_pages, page_bytes, dtype=uint8)`` made at
start, as in vLLM's PagedAttention block pool (``vllm/v1/core/block_pool.py``): a
block of ``n`` bytes takes ``ceil(n / page_bytes)`` pages, which need not be
contiguous, so the pool never fragments and a put never allocates tensor
memory. Pages are small (:data:`DEFAULT_PAGE_BYTES`, 256 bytes): a page is the
unit of allocation, not of layout, so a block takes its own length rounded up
to 256 bytes, not to a 64 KiB page (a 96 KiB block took 128 KiB). Free pages are
kept as coalesced runs (extents); a put takes one run for its whole batch when
there is one (best fit), its blocks one after another, else one run per block
that fits whenever there is one, so most blocks are a single run and move with
a single copy, and otherwise gathers pages from the largest runs. Blocks of one
size free holes of that size, which the next blocks of that size fill exactly.

Puts of tensors. The embedded store hands the tier a put's tensors not yet
encoded (``kvstore.blocks.copying.TensorBlock``): each is encoded straight into its
pages, its payload copied once from the caller's tensor and its checksum taken
over that copy while it is in cache, instead of being encoded into ``bytes`` and
copied again.

Concurrency. Every method is called from the store's one asyncio loop, which
owns the index and the free runs, so neither needs a lock. A batch of at least
``offload_min_bytes`` is copied in a worker thread of the loop's default
executor; a smaller one is copied on the loop thread. Pages are never reused
while a copy of them is in flight:

* a put is reserve -> write -> publish: its pages are taken from the free runs
  before the copy starts and the key is published only after it ends, so no
  reader sees half a value and no other put gets the same pages;
* a get pins the records it reads; a delete or overwrite of a pinned record
  unpublishes it at once but returns its pages to the free runs only when the
  last reader that pinned it is done;
* a caller cancelled during a threaded copy does not stop the thread, so the
  pages it reserved or pinned are freed or unpinned only when the thread ends.

Read-only. A loan hands out read-only views of the host pool (its only way
out without a copy); ``kvstore.blocks.tensors.decode_block`` copies such a view into a
tensor of its own, so no caller's write reaches the pool. :meth:`MemoryTier.get`
returns copies.

Checksums are not verified on reads: blocks were verified when they entered
the store and RAM is trusted, so ``corrupt_records`` stays 0 for this tier.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import struct
import warnings
from typing import Awaitable, Callable, Sequence, TypeVar

import torch

from kvstore.blocks.copying import TensorBlock, encode_batch_into
from kvstore.blocks.format import ALIGNMENT
from kvstore.config import MemoryTierConfig
from kvstore.errors import InvalidArgumentError, UnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers.base import BlockMeta, Buffer, ResidentEntry, TierFullError, TierLoan, done, put_order

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB

_T = TypeVar("_T")

DEFAULT_PAGE_BYTES = 256
"""The pool's default page: its unit of allocation, bytes. Small, so a block's capacity is its own length within
256 bytes (a 16 KiB block: 1.6 % over, ``benchmarks/bench_footprint.py``), and a multiple of 64, so every block
and its payload (``kvstore.blocks.tensors.ALIGNMENT``) start 64-byte aligned; 256 rather than 64 so a pool of up to 1 TiB
fits :data:`MAX_PAGES`."""

MAX_PAGES = (1 << 32) - 1
"""Most pages a pool may have: a record keeps a run's start page in 32 bits."""

_HEAD = struct.Struct("<QBddII")
"""Head of a record: nbytes, priority, expires_at, last_access, then the first run (start page, page count)."""
_RUN = struct.Struct("<II")
"""Each further run of a record: start page, page count."""

_Record = bytes
"""The tier's per-key record: ``_HEAD`` then zero or more ``_RUN``; 33 bytes for a one-run block (66 with the ``bytes`` object's own header).

One immutable ``bytes`` object per block keeps the tier's RAM per block small
(``benchmarks/bench_index.py``); its fields are unpacked only when used.
"""


def _make_record(nbytes: int, meta: BlockMeta, runs: Sequence[tuple[int, int]]) -> _Record:
    first = runs[0] if runs else (0, 0)
    head = _HEAD.pack(nbytes, meta.priority, meta.expires_at, meta.last_access, *first)
    return head + b"".join(_RUN.pack(*run) for run in runs[1:]) if len(runs) > 1 else head


def _record_nbytes(record: _Record) -> int:
    return int.from_bytes(record[:8], "little")


def _record_meta(record: _Record) -> BlockMeta:
    _, priority, expires_at, last_access, _, _ = _HEAD.unpack_from(record)
    return BlockMeta(priority, expires_at, last_access)


def _record_runs(record: _Record) -> list[tuple[int, int]]:
    *_, start, count = _HEAD.unpack_from(record)
    runs = [(start, count)] if count else []
    if len(record) > _HEAD.size:
        runs.extend(_RUN.iter_unpack(memoryview(record)[_HEAD.size :]))
    return runs


async def _await_copy(
    copy: asyncio.Future[_T], *, on_failure: Callable[[], None], on_success: Callable[[], None] | None = None
) -> _T:
    """Await a copy running in a worker thread, then run ``on_success`` or ``on_failure`` on the loop.

    A cancelled caller does not stop the thread, so ``on_failure`` (which frees
    or unpins the pages the copy touches) then runs only once the thread is done.
    """
    try:
        result = await asyncio.shield(copy)
    except asyncio.CancelledError:
        if copy.done():
            on_failure()
        else:
            copy.add_done_callback(lambda f: (f.cancelled() or f.exception(), on_failure()))
        raise
    except BaseException:
        on_failure()
        raise
    if on_success is not None:
        on_success()
    return result


class PageAllocator:
    """Free pages of a pool as coalesced runs; hands out runs, best fit first.

    Pure bookkeeping over page indices ``[0, num_pages)``; it never touches memory.

    Args:
        num_pages: pages in the pool.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.num_free_pages = 0
        self._length_at: dict[int, int] = {}  # run start -> run length
        self._start_ending_at: dict[int, int] = {}  # run end (exclusive) -> run start
        self._starts_of_length: dict[int, set[int]] = {}
        self._lengths: list[int] = []  # sorted distinct lengths of free runs
        if num_pages:
            self._add(0, num_pages)

    @property
    def num_free_runs(self) -> int:
        """Number of separate free runs (1 for an empty pool)."""
        return len(self._length_at)

    def allocate(self, num_pages: int) -> list[tuple[int, int]]:
        """Take ``num_pages`` free pages.

        Returns:
            ``(start, count)`` runs whose counts sum to ``num_pages``: one run
            whenever a free run is long enough (the shortest such run), else
            pieces of the longest runs.

        Raises:
            TierFullError: if fewer than ``num_pages`` pages are free; nothing is taken.
        """
        if num_pages > self.num_free_pages:
            raise TierFullError(f"{num_pages} pages wanted, {self.num_free_pages} free")
        if num_pages == 0:
            return []
        i = bisect.bisect_left(self._lengths, num_pages)
        if i < len(self._lengths):
            return [self._take(self._lengths[i], num_pages)]
        runs = []
        remaining = num_pages
        while remaining:
            run = self._take(self._lengths[-1], remaining)
            runs.append(run)
            remaining -= run[1]
        return runs

    def allocate_run(self, num_pages: int) -> tuple[int, int] | None:
        """Take ``num_pages`` free pages as one run, the shortest free run long enough (best fit).

        Returns:
            ``(start, num_pages)``, or ``None`` when no free run is that long (nothing is taken).
        """
        if num_pages <= 0:
            return None
        i = bisect.bisect_left(self._lengths, num_pages)
        if i == len(self._lengths):
            return None
        return self._take(self._lengths[i], num_pages)

    def free(self, start: int, count: int) -> None:
        """Return the run ``[start, start + count)``, merging it with free neighbours."""
        assert 0 <= start and start + count <= self.num_pages, (start, count)
        if count == 0:
            return
        if start in self._start_ending_at:
            before = self._start_ending_at[start]
            before_count = self._length_at[before]
            self._remove(before, before_count)
            start, count = before, before_count + count
        after = start + count
        if after in self._length_at:
            after_count = self._length_at[after]
            self._remove(after, after_count)
            count += after_count
        self._add(start, count)

    def _take(self, length: int, wanted: int) -> tuple[int, int]:
        start = next(iter(self._starts_of_length[length]))
        self._remove(start, length)
        taken = min(length, wanted)
        if length > taken:
            self._add(start + taken, length - taken)
        return start, taken

    def _add(self, start: int, count: int) -> None:
        self._length_at[start] = count
        self._start_ending_at[start + count] = start
        starts = self._starts_of_length.get(count)
        if starts is None:
            self._starts_of_length[count] = {start}
            bisect.insort(self._lengths, count)
        else:
            starts.add(start)
        self.num_free_pages += count

    def _remove(self, start: int, count: int) -> None:
        del self._length_at[start]
        del self._start_ending_at[start + count]
        starts = self._starts_of_length[count]
        starts.discard(start)
        if not starts:
            del self._starts_of_length[count]
            del self._lengths[bisect.bisect_left(self._lengths, count)]
        self.num_free_pages -= count


class MemoryTier:
    """Encoded blocks in a preallocated page pool on the host or a CUDA device.

    Implements :class:`kvstore.tiers.base.Tier`. It never evicts: a put that
    does not fit raises :class:`TierFullError` and stores nothing of its batch.
    A put of a key already held replaces its value and meta (last writer wins);
    within one batch the last occurrence of a key wins.

    Args:
        capacity_bytes: pool size, bytes; rounded down to whole pages, and
            :attr:`capacity_bytes` reports the rounded value.
        device: ``cpu`` or ``cuda[:N]``; with a CUDA pool, puts copy host to
            device and gets copy device to host.
        page_bytes: page size, bytes, a multiple of 64; a block of ``n`` bytes takes ``ceil(n / page_bytes)`` pages.
        pin_memory: pin a ``cpu`` pool (page-locked) when CUDA is available, so
            that later host<->device copies of its pages are DMA transfers.
        name: tier name in stats and metrics.
        offload_min_bytes: batches of at least this many bytes are copied in a
            worker thread instead of on the event loop.

    Raises:
        InvalidArgumentError: on a page size that is not a positive multiple of 64, a negative capacity, an
            unknown device, or more pages than :data:`MAX_PAGES`.
    """

    persistent = False
    lends_references = False  # loans are views of pages the tier reuses: the store pins what it reads
    writes_tensors = True  # a put's tensors are encoded straight into the pool (TensorWritingTier)

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: str = "cpu",
        page_bytes: int = DEFAULT_PAGE_BYTES,
        pin_memory: bool = True,
        name: str = "memory",
        offload_min_bytes: int = 4 * MiB,
    ) -> None:
        if page_bytes <= 0 or page_bytes % ALIGNMENT:
            raise InvalidArgumentError(f"page_bytes must be a positive multiple of {ALIGNMENT} (blocks start aligned "
                                       f"for their payload's dtype), got {page_bytes}")
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.page_bytes = page_bytes
        self.offload_min_bytes = offload_min_bytes
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
        num_pages = capacity_bytes // page_bytes
        if num_pages > MAX_PAGES:
            raise InvalidArgumentError(f"a pool of {capacity_bytes} bytes has {num_pages} pages of {page_bytes} bytes, "
                                       f"over {MAX_PAGES}: raise page_bytes to at least "
                                       f"{-(-capacity_bytes // MAX_PAGES)}")
        self.capacity_bytes: int | None = num_pages * page_bytes
        self.pinned = self.device.type == "cpu" and pin_memory and torch.cuda.is_available()
        self._pool: torch.Tensor | None = torch.empty(
            (num_pages, page_bytes), dtype=torch.uint8, device=self.device, pin_memory=self.pinned
        )
        if self.device.type == "cpu" and not self.pinned:
            self._pool.zero_()  # fault the pages in now: a steady footprint, and no page faults on puts
        self._flat = self._pool.view(-1)
        # read-only: loans hand out slices of it; the tier writes through the writable one (and torch)
        self._host_writable = self._host_view = None
        if self.device.type == "cpu":
            array = self._flat.numpy()
            self._host_writable = memoryview(array)
            readonly = array.view()
            readonly.flags.writeable = False  # what a view's .obj gives a reader (BlockLease.offsets) is read-only too
            self._host_view = memoryview(readonly)
        self._allocator = PageAllocator(num_pages)
        self._index: dict[BlockKey, _Record] = {}
        self._readers: dict[int, int] = {}  # id(record) -> gets copying it now (records are distinct objects)
        self._unpublished: dict[int, _Record] = {}  # pinned records already deleted or replaced
        self._held_pages = 0  # pages of those
        logger.info(
            "memory tier %s: %s pages of %s bytes on %s (pinned=%s)",
            name, num_pages, page_bytes, self.device, self.pinned,
        )

    @classmethod
    def from_config(cls, cfg: MemoryTierConfig, *, name: str = "memory") -> MemoryTier:
        """Build the tier from its config section (``store.memory``)."""
        return cls(
            cfg.capacity_bytes, device=cfg.device, page_bytes=cfg.page_bytes, pin_memory=cfg.pin_memory, name=name
        )

    # -- accounting ---------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` takes: whole pages, ``ceil(nbytes / page_bytes) * page_bytes``."""
        return -(-nbytes // self.page_bytes) * self.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages free now (pages of deleted blocks that a get is still copying are not free yet)."""
        return self._allocator.num_free_pages

    @property
    def used_bytes(self) -> int:
        """Bytes of the pool in use, whole pages."""
        return (self._allocator.num_pages - self._allocator.num_free_pages) * self.page_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of pages that blocks deleted or replaced still take, because a loan or a copy holds them."""
        return self._held_pages * self.page_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks held (published)."""
        return len(self._index)

    def counters(self) -> dict[str, int]:
        """Event counts since start: ``corrupt_records`` (always 0: memory reads are not re-verified)."""
        return {"corrupt_records": 0}

    # -- the Tier protocol --------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored (published: a put in flight is not yet)."""
        self._check_open()
        index = self._index
        return [key in index for key in keys]

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """A copy of each key's value, or ``None`` for a miss; values are not re-verified.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        records = [self._index.get(key) for key in keys]
        hits = [r for r in records if r is not None]
        if not hits:
            return [None] * len(keys)
        pool = (self._flat, self._host_view)
        if sum(_record_nbytes(r) for r in hits) < self.offload_min_bytes:
            return self._copy_out_all(pool, records)
        for record in hits:
            self._readers[id(record)] = self._readers.get(id(record), 0) + 1

        def unpin_all() -> None:
            for record in hits:
                self._unpin(record)

        copy = asyncio.get_running_loop().run_in_executor(None, self._copy_out_all, pool, records)
        return await _await_copy(copy, on_failure=unpin_all, on_success=unpin_all)

    def lend(self, keys: Sequence[BlockKey]) -> TierLoan | None:
        """Each key's value as a read-only view of the host pool, pinned until the loan is released.

        The loan names the pool and each value's offset in it when every value is such a view
        (:attr:`TierLoan.pool`); the pool tensor is writable, so only a copy out of it may use it.

        A pinned value's pages are not reused (a delete or overwrite unpublishes
        it at once and frees its pages at the release), so the views stay valid
        however long the caller holds them; the pool itself outlives a
        :meth:`close` for as long as a view exists. A value spread over several
        page runs is copied into ``bytes`` instead (the allocator's best fit
        makes that rare).

        Returns:
            The loan, or ``None`` for a GPU pool (use :meth:`get`).

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        host_view = self._host_view
        if host_view is None:
            return None
        values: list[Buffer | None] = []
        pinned: list[_Record] = []
        offsets: list[int] | None = []
        readers, index, page_bytes = self._readers, self._index, self.page_bytes
        for key in keys:
            record = index.get(key)
            if record is None:
                values.append(None)
                offsets = None
                continue
            runs = _record_runs(record)
            if len(runs) != 1:
                values.append(self._copy_out(self._flat, host_view, record))
                offsets = None
                continue
            base = runs[0][0] * page_bytes
            values.append(host_view[base: base + _record_nbytes(record)])
            if offsets is not None:
                offsets.append(base)
            readers[id(record)] = readers.get(id(record), 0) + 1
            pinned.append(record)

        def release() -> None:
            for record in pinned:
                self._unpin(record)
            pinned.clear()  # a second call releases nothing

        return TierLoan(values, release, None, self._flat if offsets else None, offsets or None)

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes | TensorBlock],
                  metas: Sequence[BlockMeta]) -> list[bool]:
        """Store each value with its meta, replacing any value held under the same key.

        The batch takes one run of pages when a free run is long enough (so its blocks lie one after another,
        and a Get of them is one strided copy), else a run per block. A :class:`~kvstore.blocks.copying.TensorBlock`
        is encoded straight into its pages: its payload copied once from the caller's tensor, its checksum
        taken there (a batch of like tensors with one header build, ``kvstore.blocks.copying.encode_batch_into``).

        Args:
            keys: block keys.
            values: encoded blocks (any bytes-like object) or tensors to encode, one per key.
            metas: priority and recency, one per key.

        Returns:
            ``True`` for every key.

        Raises:
            InvalidArgumentError: if the three sequences differ in length or a
                priority is outside ``[0, 100]``.
            TierFullError: if the batch does not fit in the free pages (counting
                the pages of values it replaces); nothing of the batch is stored.
                When it fits only by reusing the pages of values it replaces,
                those keys read as misses until the put returns.
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        order = put_order(keys, values, metas)
        views = [v if isinstance(v := values[i], TensorBlock) else memoryview(v).cast("B") for i in order]
        sizes = [len(v) if isinstance(v, TensorBlock) else v.nbytes for v in views]
        page_bytes = self.page_bytes
        pages_needed = [-(-n // page_bytes) for n in sizes]
        self._make_room(sum(pages_needed), [keys[i] for i in order])
        reserved = self._reserve(pages_needed)

        def free_all() -> None:
            for runs in reserved:
                self._free(runs)

        pool = (self._flat, self._host_writable)
        if sum(sizes) < self.offload_min_bytes:
            try:
                self._copy_in_all(pool, reserved, views)
            except BaseException:
                free_all()
                raise
        else:
            copy = asyncio.get_running_loop().run_in_executor(None, self._copy_in_all, pool, reserved, views)
            await _await_copy(copy, on_failure=free_all)
        self._check_open()  # closed while the copy ran: nothing to publish into
        for i, runs, nbytes in zip(order, reserved, sizes):
            old = self._index.get(keys[i])
            self._index[keys[i]] = _make_record(nbytes, metas[i], runs)
            if old is not None:
                self._release(old)
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> Awaitable[None]:
        """Remove each key; missing keys are ignored. Pages a get is copying are freed when it ends.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        for key in keys:
            record = self._index.pop(key, None)
            if record is not None:
                self._release(record)
        return done()

    async def resident(self) -> list[ResidentEntry]:
        """Every block held, with its meta (this tier is empty after a restart)."""
        self._check_open()
        return [ResidentEntry(key, _record_nbytes(r), _record_meta(r)) for key, r in self._index.items()]

    async def close(self) -> None:
        """Drop every block and release the pool; idempotent. Copies in flight keep their own reference."""
        if self._pool is None:
            return
        self._index.clear()
        self._unpublished.clear()
        self._held_pages = 0
        self._pool = self._flat = None
        self._host_view = self._host_writable = None
        logger.info("memory tier %s closed", self.name)

    # -- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._pool is None:
            raise UnavailableError(f"memory tier {self.name} is closed")

    def _make_room(self, num_pages: int, keys: Sequence[BlockKey]) -> None:
        """Ensure ``num_pages`` are free, releasing the unpinned values that ``keys`` will replace if needed."""
        free = self._allocator.num_free_pages
        if num_pages <= free:
            return
        replaced = [
            r for r in (self._index.get(k) for k in keys) if r is not None and id(r) not in self._readers
        ]
        if num_pages > free + sum(count for r in replaced for _, count in _record_runs(r)):
            raise TierFullError(
                f"memory tier {self.name}: batch needs {num_pages} pages of {self.page_bytes} bytes, {free} free"
            )
        for key in keys:
            record = self._index.get(key)
            if record is not None and id(record) not in self._readers:
                del self._index[key]
                self._free(_record_runs(record))

    def _reserve(self, pages_needed: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Take the pages of a batch (free already, :meth:`_make_room`): one run cut block by block when a free run
        is that long, else the allocator's runs block by block."""
        run = self._allocator.allocate_run(sum(pages_needed)) if len(pages_needed) > 1 else None
        if run is None:
            return [self._allocator.allocate(n) for n in pages_needed]
        start, reserved = run[0], []
        for count in pages_needed:
            reserved.append([(start, count)] if count else [])
            start += count
        return reserved

    def _release(self, record: _Record) -> None:
        """Return an unpublished record's pages, or defer that until the gets copying it end."""
        if id(record) in self._readers:
            self._unpublished[id(record)] = record
            self._held_pages += sum(count for _, count in _record_runs(record))
        else:
            self._free(_record_runs(record))

    def _unpin(self, record: _Record) -> None:
        count = self._readers[id(record)] - 1
        if count:
            self._readers[id(record)] = count
            return
        del self._readers[id(record)]
        if self._unpublished.pop(id(record), None) is not None:
            runs = _record_runs(record)
            self._held_pages -= sum(count for _, count in runs)
            self._free(runs)

    def _free(self, runs: Sequence[tuple[int, int]]) -> None:
        if self._pool is None:
            return  # closed while a copy was in flight: the pool is gone
        for start, count in runs:
            self._allocator.free(start, count)

    def _copy_in_all(self, pool: tuple[torch.Tensor, memoryview | None], reserved: Sequence[Sequence[tuple[int, int]]],
                     views: Sequence[memoryview | TensorBlock]) -> None:
        flat, host = pool
        page_bytes = self.page_bytes
        if host is not None and self._encode_batch(flat, host, reserved, views):
            return
        rest = []
        for runs, view in zip(reserved, views):
            if type(view) is not TensorBlock:
                rest.append((runs, view))
            elif host is not None and len(runs) == 1:  # encoded where it is stored: one copy
                base = runs[0][0] * page_bytes
                view.encode_into(host[base:base + len(view)], flat[base:base + len(view)])
            else:  # over several runs, or into a GPU pool
                rest.append((runs, memoryview(view.encoded())))
        if not rest:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only sources are only read
            for runs, view in rest:
                if not view.nbytes:
                    continue
                src = torch.frombuffer(view, dtype=torch.uint8)
                offset = 0
                for start, count in runs:
                    seg = min(count * page_bytes, view.nbytes - offset)
                    base = start * page_bytes
                    flat[base : base + seg].copy_(src[offset : offset + seg])
                    offset += seg

    def _encode_batch(self, flat: torch.Tensor, host: memoryview, reserved: Sequence[Sequence[tuple[int, int]]],
                      views: Sequence[memoryview | TensorBlock]) -> bool:
        """A batch of like tensors, each in one run, evenly spaced (one run cut block by block): encoded in place
        with one header build (``kvstore.blocks.copying.encode_batch_into``); whether it was that batch."""
        first = views[0] if views else None
        if not isinstance(first, TensorBlock) or len(views) < 2:
            return False
        tensors = []
        for v, runs in zip(views, reserved):
            if not isinstance(v, TensorBlock) or v.header is not first.header or len(runs) != 1:
                return False
            tensors.append(v.tensor)
        offsets = [runs[0][0] * self.page_bytes for runs in reserved]
        return encode_batch_into(tensors, first.header.layout, host, flat, offsets)

    def _copy_out_all(
        self, pool: tuple[torch.Tensor, memoryview | None], records: Sequence[_Record | None]
    ) -> list[bytes | None]:
        flat, host_view = pool
        return [None if r is None else self._copy_out(flat, host_view, r) for r in records]

    def _copy_out(self, flat: torch.Tensor, host_view: memoryview | None, record: _Record) -> bytes:
        nbytes = _record_nbytes(record)
        page_bytes = self.page_bytes
        runs = _record_runs(record)
        if host_view is not None:
            view = host_view
            if len(runs) == 1:
                base = runs[0][0] * page_bytes
                return bytes(view[base : base + nbytes])
            parts, remaining = [], nbytes
            for start, count in runs:
                seg = min(count * page_bytes, remaining)
                parts.append(view[start * page_bytes : start * page_bytes + seg])
                remaining -= seg
            return b"".join(parts)
        # CUDA pool: one device-to-host copy per run into pinned memory (torch's caching host allocator)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        offset = 0
        for start, count in runs:
            seg = min(count * page_bytes, nbytes - offset)
            host[offset : offset + seg].copy_(flat[start * page_bytes : start * page_bytes + seg])
            offset += seg
        return bytes(memoryview(host.numpy()))
