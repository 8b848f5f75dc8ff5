"""Belady's offline-optimal eviction (MIN): evict the resident block whose next use is farthest away.

It needs the future, so it exists only in the simulator, as the upper bound the
online policies are measured against (L. A. Belady, "A study of replacement
algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966).
It answers the same ``insert`` / ``touch`` / ``remove`` / ``victims`` calls as
``kvstore.policy.PriorityLRUPolicy``, so the replay loop drives both alike.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterator, Sequence

from kvstore.policy import DEFAULT_PRIORITY, Leases

NEVER = 1 << 62
"""The next-use time of a block that is never requested again."""

_POSITION_BITS = 20  # a chain may hold up to 2**20 blocks; time = request index << 20 | position


class NextUseOracle:
    """For each block, the requests that name it, so that a replay can ask "when is it needed next?".

    Time is counted in requests: the replay calls :meth:`advance` with the
    index of the request it is about to serve, and :meth:`next_use` answers
    with the first later request that names the block. Ties between blocks
    needed by the same request are broken by their position in its chain, the
    tail counting as farther away, so that MIN, too, evicts a tail before its head.

    Args:
        chains: the block ids of every request, in replay order; shape ``(num_requests, num_blocks_i)``.
    """

    __slots__ = ("_uses", "_cursor", "_position", "now")

    def __init__(self, chains: Sequence[Sequence[Hashable]]) -> None:
        uses: dict[Hashable, list[int]] = {}
        position: dict[Hashable, int] = {}
        for index, chain in enumerate(chains):
            for pos, key in enumerate(chain):
                found = uses.get(key)
                if found is None:
                    uses[key] = [index]
                    position[key] = pos
                elif found[-1] != index:
                    found.append(index)
        self._uses = uses
        self._position = position
        self._cursor: dict[Hashable, int] = {}
        self.now = -1

    def advance(self, request_index: int) -> None:
        """Set the clock to the request about to be served; it never moves back.

        Raises:
            ValueError: if ``request_index`` is before the current one.
        """
        if request_index < self.now:
            raise ValueError(f"the clock only moves forward: {request_index} < {self.now}")
        self.now = request_index

    def next_use(self, key: Hashable) -> int:
        """When ``key`` is next needed after the current request: ``request << 20 | position``, or :data:`NEVER`."""
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        cursor = self._cursor.get(key, 0)
        now = self.now
        while cursor < len(uses) and uses[cursor] <= now:
            cursor += 1
        self._cursor[key] = cursor
        if cursor == len(uses):
            return NEVER
        return (uses[cursor] << _POSITION_BITS) | self._position[key]


class BeladyPolicy(Leases):
    """MIN as an eviction policy: victims are the blocks needed farthest in the future.

    A max-heap of next-use times with lazy invalidation: every insert or touch
    pushes a fresh entry, and entries whose time no longer matches the block's
    are skipped when popped (each entry carries a sequence number, and only the
    block's latest one is live). Among equal times the older entry goes first. Priorities and retention are accepted and ignored.

    Args:
        oracle: the next-use times of the trace being replayed, shared by every tier.
    """

    __slots__ = ("_oracle", "_entries", "_heap", "_pins", "_nbytes", "_seq")

    def __init__(self, oracle: NextUseOracle) -> None:
        self._oracle = oracle
        self._entries: dict[Hashable, tuple[int, int]] = {}  # key -> (nbytes, sequence number of its live heap entry)
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, sequence number, key)
        self._seq = 0
        self._pins: dict[Hashable, int] = {}
        self._nbytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""
        return self._nbytes

    def priority_of(self, key: Hashable) -> int:
        """Always the default priority (MIN has none). Raises ``KeyError`` if ``key`` is not tracked."""
        self._entries[key]
        return DEFAULT_PRIORITY

    def expiry_of(self, key: Hashable) -> float:
        """Always 0.0 (MIN keeps no retention)."""
        return 0.0

    def _push(self, key: Hashable, nbytes: int) -> None:
        self._seq += 1
        self._entries[key] = (nbytes, self._seq)
        heapq.heappush(self._heap, (-self._oracle.next_use(key), self._seq, key))

    def insert(self, key: Hashable, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None:
        """Track a new resident ``key`` of ``nbytes``; ``priority`` and ``expires_at`` are ignored.

        Raises:
            ValueError: on a negative size or a key already tracked.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if key in self._entries:
            raise ValueError(f"key {key!r} is already tracked")
        self._push(key, nbytes)
        self._nbytes += nbytes

    def touch(self, key: Hashable) -> None:
        """Record a use of ``key`` now: its next use moves on. Raises ``KeyError`` if unknown."""
        self._push(key, self._entries[key][0])

    def remove(self, key: Hashable) -> int:
        """Forget ``key``; return its bytes, or 0 if it was not tracked.

        Its leases stay: they belong to the readers that took them, and each is
        released by its own :meth:`unpin`. A key stored again while an old
        reader still holds it is thus not a victim until that reader is done
        (dropping the leases here let the old reader's ``unpin`` release a new
        reader's lease instead).
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._nbytes -= entry[0]
        return entry[0]

    def victims(self, nbytes: int, now: float = 0.0) -> list[Hashable]:
        """Keys to evict, farthest next use first, to free at least ``nbytes``; pinned keys are skipped.

        Args:
            nbytes: bytes to free; nothing is returned for ``nbytes <= 0``.
            now: ignored (the oracle's clock is the request index).

        Returns:
            Fewer bytes than asked for only when the rest is pinned. The keys stay
            tracked until the caller removes them.
        """
        if nbytes <= 0:
            return []
        heap, entries, pins = self._heap, self._entries, self._pins
        chosen: list[Hashable] = []
        held: list[tuple[int, int, Hashable]] = []
        freed = 0
        while heap and freed < nbytes:
            item = heapq.heappop(heap)
            key = item[2]
            entry = entries.get(key)
            if entry is None or entry[1] != item[1]:
                continue  # stale: removed, or touched since
            held.append(item)
            if key in pins:
                continue
            chosen.append(key)
            freed += entry[0]
        for item in held:  # victims() only answers; remove() is what forgets
            heapq.heappush(heap, item)
        return chosen
