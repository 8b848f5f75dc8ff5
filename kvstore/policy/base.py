"""The contract of an eviction policy, and the priorities every policy shares (TensorRT-LLM's retention semantics)."""

from __future__ import annotations

from typing import Hashable, Iterator, Protocol, Sequence, TypeVar

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
"""TensorRT-LLM's default retention priority."""

PIN_LEVEL = MAX_PRIORITY + 1
"""The level of the keys whose TTL runs (pinned keys): above every priority, so evicted only after every other key."""

MAX_TTL_S = 366 * 86400.0
"""The longest TTL a policy takes, seconds (a node clamps TTLs to its own, shorter, ``store.pins.max_ttl_s``)."""

K = TypeVar("K", bound=Hashable)


def check_priority(priority: int) -> int:
    """Return ``priority`` if it lies in ``[0, 100]``.

    Raises:
        ValueError: otherwise.
    """
    if not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


def check_ttl(ttl_s: float) -> float:
    """Return ``ttl_s`` (seconds) if it is a finite number in ``[0, MAX_TTL_S]``; 0.0 means no TTL.

    Raises:
        ValueError: otherwise.
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0.0 <= ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in [0, {MAX_TTL_S:g}], got {ttl_s!r}")
    return float(ttl_s)


class EvictionPolicy(Protocol[K]):
    """The contract every eviction policy meets; all methods are O(1) or O(log n) amortized."""

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:
        """Track a new resident ``key`` of ``nbytes`` as the most recently used; pinned with a ``ttl_s`` > 0."""

    def touch(self, key: K) -> None:
        """Mark ``key`` as the most recently used (a pinned key's TTL runs again from now)."""

    def pin(self, key: K, ttl_s: float, until: float = 0.0) -> None:
        """Give a tracked ``key`` a TTL: it is evicted only after every key without one, until the TTL runs out
        (from its last touch). Raises ``KeyError`` for an untracked key."""

    def unpin(self, key: K) -> None:
        """End the TTL of ``key`` now (it becomes the next victim of its priority); ignored without one."""

    def pin_of(self, key: K) -> tuple[float, float]:
        """``(ttl_s, until)`` of ``key``'s TTL, ``(0.0, 0.0)`` without one."""

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of the keys whose TTL runs."""

    def pinned_nbytes_of(self, group: Hashable) -> int:
        """Bytes of the pinned keys of one pin group (the store's: a namespace tag)."""

    def is_pinned(self, key: K) -> bool:
        """Whether the TTL of ``key`` runs."""

    def unpin_oldest(self, nbytes: int) -> int:
        """End the TTLs of the least recently used pinned keys until ``nbytes`` are unpinned; the bytes unpinned."""

    def ttl_ran_out(self, key: K) -> bool:
        """Whether ``key``'s TTL ran out while it stayed tracked."""

    def cool(self, keys: Sequence[K]) -> None:
        """Move the tracked ``keys`` (a dead chain, head first) to the front of the order, the tail frontmost."""

    def remove(self, key: K) -> int:
        """Forget ``key``; return its bytes (0 if unknown)."""

    def hold(self, key: K) -> None:
        """Hold ``key`` (its first reference): it is no victim until released. Raises ``KeyError``."""

    def release(self, key: K) -> None:
        """End the hold of ``key`` (its last reference); a key not held is ignored."""

    def victims(self, nbytes: int, now: float = 0.0) -> list[K]:
        """Return keys from the front of the eviction order whose bytes add up to at least ``nbytes``.

        Returns fewer bytes than asked for only when everything else is held.
        """

    def contains_many(self, keys: Sequence[K]) -> list[bool]:
        """``[key in self for key in keys]``, in C loops where it can (a lookup of 1,024 hashes)."""

    def size_of(self, key: K) -> int:
        """Bytes of a tracked ``key``. Raises ``KeyError`` if it is not tracked."""

    def priority_of(self, key: K) -> int:
        """Current priority of a tracked ``key``. Raises ``KeyError`` if it is not tracked."""

    def expiry_of(self, key: K) -> float:
        """When the retention of ``key`` ends (0.0 when it has none)."""

    def expire(self, now: float) -> int:
        """Revert every retention ended by ``now`` to the default priority and end every TTL run out; returns how
        many."""

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` each of ``keys`` (a chain segment, head first) tail first, so the head ends most recent."""

    def insert_many(self, keys: Sequence[K], nbytes: int, priority: int = DEFAULT_PRIORITY,
                    expires_at: float = 0.0, ttl_s: float = 0.0) -> None:
        """:meth:`insert` each of ``keys`` (head first, ``nbytes`` each) tail first, so the head ends most recent."""

    def remove_many(self, keys: Sequence[K]) -> int:
        """:meth:`remove` each of ``keys``; return the bytes freed."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[K]: ...

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""
