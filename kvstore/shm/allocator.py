"""First-fit allocation of byte ranges in a segment, with neighbouring free ranges merged on free."""

from __future__ import annotations

import bisect

DEFAULT_ALIGNMENT = 4096
"""Alignment of every range, bytes: a page, so that each range starts on its own page."""


class RangeAllocator:
    """Ranges of ``capacity_bytes``, handed out first-fit from the lowest offset.

    First fit from the bottom keeps the ranges in use packed at the start of the
    segment, so a client that reads one batch at a time reuses the same pages
    (already faulted in, and warm in its caches) call after call. Free ranges
    are kept sorted by offset and merged with their neighbours when freed
    (Knuth, TAOCP vol. 1, 2.5, "Dynamic Storage Allocation"). Not thread-safe.

    Args:
        capacity_bytes: bytes to hand out, > 0.
        alignment: every offset and size is a multiple of it, bytes (a power of two).

    Raises:
        ValueError: on a capacity <= 0 or an alignment that is not a power of two.
    """

    __slots__ = ("capacity_bytes", "alignment", "_starts", "_sizes", "_used", "used_bytes")

    def __init__(self, capacity_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self.alignment = alignment
        self._starts: list[int] = [0] if self.capacity_bytes else []  # free ranges, by offset
        self._sizes: list[int] = [self.capacity_bytes] if self.capacity_bytes else []
        self._used: dict[int, int] = {}  # offset -> size of each range handed out
        self.used_bytes = 0

    def aligned(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment (at least one unit)."""
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new range of at least ``nbytes``; ``None`` when no free range is large enough."""
        size = self.aligned(nbytes)
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._used[start] = size
                self.used_bytes += size
                return start
        return None

    def free(self, offset: int) -> int:
        """Give back the range at ``offset``; returns its size, bytes.

        Raises:
            KeyError: if no range handed out starts at ``offset``.
        """
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + size == self._starts[i]:  # merge with the range after it
            self._starts[i] = offset
            self._sizes[i] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:  # and with the range before it
            self._sizes[i - 1] += self._sizes[i]
            del self._starts[i], self._sizes[i]
        return size

    def size_of(self, offset: int) -> int | None:
        """The size of the range handed out at ``offset``, ``None`` if there is none."""
        return self._used.get(offset)

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out."""
        return self.capacity_bytes - self.used_bytes

    @property
    def num_ranges(self) -> int:
        """Ranges handed out."""
        return len(self._used)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as ``(offset, size)``, by offset (tests)."""
        return list(zip(self._starts, self._sizes))
