"""The contract of an eviction policy, and the priorities every policy shares (TensorRT-LLM's retention semantics)."""

from __future__ import annotations

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
        """Revert every retention ended by ``now`` to the default priority; returns how many."""

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` each of ``keys`` (a chain segment, head first) tail first, so the head ends most recent."""

    def insert_many(self, keys: Sequence[K], nbytes: int, priority: int = DEFAULT_PRIORITY,
                    expires_at: float = 0.0) -> None:
        """:meth:`insert` each of ``keys`` (head first, ``nbytes`` each) tail first, so the head ends most recent."""

    def remove_many(self, keys: Sequence[K]) -> int:
        """:meth:`remove` each of ``keys``; return the bytes freed."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[K]: ...

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""
