"""Eviction policies: pure ordering state that answers "which blocks, for N bytes?".

A policy never touches a tier. The store asks it for victims, pins them while
it demotes or drops them, then removes them (see ``kvstore.store``). The same
code drives the offline simulator (``kvstore.sim``).

Semantics follow TensorRT-LLM's KV-cache retention config
(``tensorrt_llm.llmapi.KvCacheRetentionConfig``): a priority in ``[0, 100]``
(default 35) and an optional retention duration after which the priority
reverts to the default. Victims are taken lowest priority first and least
recently used first within a priority. Leased (pinned) blocks are never victims.

Tail before head: callers record the blocks of a prefix chain from its tail
to its head (``reversed(keys)``), as vLLM frees blocks in reverse order
(``vllm/v1/core/block_pool.py``), so within one priority the head is the more
recent and the tail is evicted first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Hashable, Iterator, Protocol, Sequence, TypeVar

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
"""TensorRT-LLM's default retention priority."""

K = TypeVar("K", bound=Hashable)


def check_priority(priority: int) -> int:
    """Return ``priority`` if it lies in ``[0, 100]``.

    Raises:
        ValueError: otherwise.
    """
    if not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


class EvictionPolicy(Protocol[K]):
    """The contract every eviction policy meets; all methods are O(1) or O(log n) amortized."""

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None:
        """Track a new resident ``key`` of ``nbytes`` as the most recently used."""

    def touch(self, key: K) -> None:
        """Mark ``key`` as the most recently used."""

    def remove(self, key: K) -> int:
        """Forget ``key``; return its bytes (0 if unknown)."""

    def pin(self, key: K) -> None:
        """Take a lease on ``key``: it is not a victim until every lease is released."""

    def unpin(self, key: K) -> None:
        """Release one lease on ``key``."""

    def victims(self, nbytes: int, now: float = 0.0) -> list[K]:
        """Return unpinned keys, in eviction order, whose bytes add up to at least ``nbytes``.

        Returns fewer bytes than asked for only when everything else is pinned.
        """

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""


class Leases:
    """Lease counts shared by every policy: a pinned key is never a victim.

    A subclass keeps the counts in a ``_pins`` dict (its own slot) and defines ``__contains__``.
    """

    __slots__ = ()
    _pins: dict[Hashable, int]

    def is_pinned(self, key: Hashable) -> bool:
        """Whether ``key`` holds at least one lease."""
        return key in self._pins

    def pin(self, key: Hashable) -> None:
        """Take one lease on ``key``. Raises ``KeyError`` if unknown."""
        if key not in self:
            raise KeyError(key)
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        """Release one lease on ``key``; unknown or unpinned keys are ignored."""
        count = self._pins.get(key)
        if count is None:
            return
        if count <= 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1


class PriorityLRUPolicy(Leases):
    """LRU within each priority level, lowest level first: TensorRT-LLM's retention semantics.

    Memory: one ``OrderedDict`` node per key in its level, holding its size (size
    ints are interned, blocks mostly share a few sizes), plus small maps for keys
    off the default priority, pinned keys and retained keys only: about 110
    bytes per key beside the key itself (``benchmarks/bench_index.py``).

    Args:
        default_priority: the priority a block reverts to when its retention expires.
    """

    __slots__ = ("_levels", "_priority", "_pins", "_expiry", "_heap", "_nbytes", "_count", "_interned",
                 "default_priority")

    def __init__(self, default_priority: int = DEFAULT_PRIORITY) -> None:
        self.default_priority = check_priority(default_priority)
        self._levels: list[OrderedDict[K, int]] = [OrderedDict() for _ in range(MAX_PRIORITY + 1)]
        self._priority: dict[K, int] = {}  # only keys whose priority is not the default
        self._pins: dict[K, int] = {}
        self._expiry: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._nbytes = 0
        self._count = 0
        self._interned: dict[int, int] = {}

    def _intern(self, nbytes: int) -> int:
        return self._interned.setdefault(nbytes, nbytes) if len(self._interned) < 65536 else nbytes

    def _level_of(self, key: K) -> int:
        return self._priority.get(key, self.default_priority)

    def __contains__(self, key: object) -> bool:
        return key in self._levels[self._priority.get(key, self.default_priority)]

    def __len__(self) -> int:
        return self._count

    def contains_many(self, keys: Sequence[K]) -> list[bool]:
        """Whether each key is tracked; the batch form of ``in`` for hot paths (lookup of 1,024 hashes)."""
        found = list(map(self._levels[self.default_priority].__contains__, keys))  # a C loop
        others = self._priority
        if others and False in found:  # some keys hold a non-default priority
            return [hit or key in others for hit, key in zip(found, keys)]
        return found

    def __iter__(self) -> Iterator[K]:
        for level in self._levels:
            yield from level

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""
        return self._nbytes

    def size_of(self, key: K) -> int:
        """Bytes of ``key``. Raises ``KeyError`` if it is not tracked."""
        return self._levels[self._level_of(key)][key]

    def priority_of(self, key: K) -> int:
        """Current priority of ``key``. Raises ``KeyError`` if it is not tracked."""
        level = self._level_of(key)
        if key not in self._levels[level]:
            raise KeyError(key)
        return level

    def expiry_of(self, key: K) -> float:
        """When the retention of ``key`` ends (0.0 when it has none)."""
        return self._expiry.get(key, 0.0)

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None:
        """Track ``key`` as the most recently used block of its priority.

        Args:
            key: the block key.
            nbytes: capacity the block occupies, bytes.
            priority: retention priority in ``[0, 100]``.
            expires_at: time (the caller's clock, seconds) when the priority reverts
                to the default; 0.0 for no retention limit.

        Raises:
            ValueError: on an out-of-range priority, negative size, or a key already tracked.
        """
        check_priority(priority)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if key in self:
            raise ValueError(f"key {key!r} is already tracked")
        if priority != self.default_priority:
            self._priority[key] = priority
            if expires_at:
                self._expiry[key] = expires_at
                heapq.heappush(self._heap, (expires_at, id(key), key))
        self._levels[priority][key] = self._intern(nbytes)
        self._nbytes += nbytes
        self._count += 1

    def touch(self, key: K) -> None:
        """Move ``key`` to the most recent end of its level. Raises ``KeyError`` if unknown."""
        self._levels[self._level_of(key)].move_to_end(key)

    def remove(self, key: K) -> int:
        """Forget ``key``; return its bytes, or 0 if it was not tracked.

        Its leases stay: they belong to the readers that took them, and each is
        released by its own :meth:`unpin`. A key stored again while an old
        reader still holds it is thus not a victim until that reader is done
        (dropping the leases here let the old reader's ``unpin`` release a new
        reader's lease instead).
        """
        nbytes = self._levels[self._priority.pop(key, self.default_priority)].pop(key, None)
        if nbytes is None:
            return 0
        self._expiry.pop(key, None)  # its heap item goes stale and is skipped
        self._nbytes -= nbytes
        self._count -= 1
        return nbytes

    def expire(self, now: float) -> int:
        """Revert every retention that ended at or before ``now`` to the default priority.

        Reverted blocks join the default level as its least recent, the earliest
        expiry first in line: their retention already kept them longer than
        plain LRU would have, so they are the next victims there (O(1) each,
        where keeping their exact rank would cost O(n)). Returns how many were reverted.
        """
        reverted: list[K] = []
        default = self._levels[self.default_priority]
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, key = heapq.heappop(self._heap)
            if self._expiry.get(key) != expires_at:
                continue  # removed or re-inserted since
            del self._expiry[key]
            default[key] = self._levels[self._priority.pop(key)].pop(key)
            reverted.append(key)
        for key in reversed(reverted):
            default.move_to_end(key, last=False)
        return len(reverted)

    def victims(self, nbytes: int, now: float = 0.0) -> list[K]:
        """Keys to evict, in order, to free at least ``nbytes``; pinned keys are skipped.

        Args:
            nbytes: bytes to free; nothing is returned for ``nbytes <= 0``.
            now: current time on the clock of ``expires_at``; retentions that
                ended by then revert first.

        Returns:
            Lowest priority first, least recently used first within a priority.
            Fewer bytes than asked for only when the rest is pinned.
        """
        if nbytes <= 0:
            return []
        self.expire(now)
        chosen: list[K] = []
        freed = 0
        pins = self._pins
        for level in self._levels:
            for key, size in level.items():
                if key in pins:
                    continue
                chosen.append(key)
                freed += size
                if freed >= nbytes:
                    return chosen
        return chosen


class LRUPolicy(PriorityLRUPolicy):
    """Plain LRU: every block at one priority. The baseline of the simulator."""

    __slots__ = ()

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None:
        """Track ``key`` as the most recently used block; priority and retention are ignored."""
        super().insert(key, nbytes, self.default_priority, 0.0)
