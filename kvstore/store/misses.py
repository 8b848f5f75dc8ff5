"""Why a block missed: the causes, the bounded history of removals that names them, and their counts.

For each block a lookup did not find (or a get did not return after its
lookup found it), the node names one cause (``docs/agentic.md`` explains how
to read them to size a cache):

=================== ==========================================================================================
cause               meaning
=================== ==========================================================================================
``never_stored``    no record of it here: never stored on this node, or removed longer ago than the history
                    remembers (the last ``store.miss_history_blocks`` removals)
``other_namespace`` never stored under this namespace, while a namespace differing from it in a few fields
                    (model, dtype, block size, adapter, tenant salt...) holds blocks here: a configuration that
                    changed (``kvstore explain`` names the fields)
``evicted``         the eviction policy evicted it from the last tier that would take it
``expired``         as ``evicted``, after its TTL had run out (a TTL too short for the pause)
``dropped``         a victim not demoted although a tier was below: under ``store.demote_min_priority``, or
                    its demotion failed (no room, a tier error)
``lost``            its record could not be read (corrupt, unreadable) and was forgotten
``deleted``         removed by a client's delete or clear
``after_miss``      still cached, but after a block that missed: a hit is a prefix, so it ends at the first miss
``tier_unavailable`` it had left the local tiers for the shared tier (Redis), which is down or timed out
``lease_lost``      a get did not return a block its lookup had found: evicted in between (a race lost)
=================== ==========================================================================================

:class:`MissHistory` is pure logic over any hashable key, so the simulator
(``kvstore.tools.sim.node``, the store over metadata-only tiers) keeps the same history and names the same causes as a
node. Its memory is bounded by ``capacity`` entries (``store.miss_history_blocks``),
counted in the index's bytes per block (``benchmarks/bench_index.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import and_, rshift, sub
from typing import Generic, Hashable, Iterable, Sequence, TypeVar, cast

from kvstore.config import DEFAULT_HISTORY_BLOCKS

K = TypeVar("K", bound=Hashable)

NEVER_STORED = "never_stored"
OTHER_NAMESPACE = "other_namespace"
EVICTED = "evicted"
EXPIRED = "expired"
DROPPED = "dropped"
LOST = "lost"
DELETED = "deleted"
AFTER_MISS = "after_miss"
TIER_UNAVAILABLE = "tier_unavailable"
LEASE_LOST = "lease_lost"

CAUSES = (NEVER_STORED, OTHER_NAMESPACE, EVICTED, EXPIRED, DROPPED, LOST, DELETED, AFTER_MISS, TIER_UNAVAILABLE,
          LEASE_LOST)
"""Every cause, in the order stats list them."""

REMOVAL_CAUSES = (EVICTED, EXPIRED, DROPPED, LOST, DELETED)
"""The causes a removal records in the history (their codes are their positions here)."""

EPOCHS = 8
"""The history is this many generations of removals; the oldest goes whole when the history is full."""

REUSE_GAP_BUCKETS_S = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)
"""Upper bounds of the reuse-gap histogram's buckets, seconds (``+Inf`` is implied)."""


@dataclass(frozen=True, slots=True)
class Removal:
    """What the history remembers of one removed block.

    Attributes:
        cause: one of :data:`REMOVAL_CAUSES`.
        at_s: when, seconds on the owner's clock (whole seconds).
        level: the local tier it left (0 the fastest).
        priority: its priority then.
        shared: whether it left for the shared tier (a write-back demotion, or a write-through copy there).
    """

    cause: str
    at_s: int
    level: int
    priority: int
    shared: bool

    @staticmethod
    def unpack(packed: int) -> Removal:
        """The removal a history value packs (:meth:`MissHistory.record`): bits 0-3 the cause, 4 shared, 5-7 the
        tier, 8-15 the priority, 16-23 the generation, 24 on the time."""
        return Removal(REMOVAL_CAUSES[packed & 0xF], packed >> 24, (packed >> 5) & 0x7, (packed >> 8) & 0xFF,
                       bool(packed & 0x10))


class MissHistory(Generic[K]):
    """The last ``capacity`` removals of blocks, by key: what names a miss's cause.

    Stored as one dict of key -> a packed int (cause, time, tier, priority),
    with the keys of each of :data:`EPOCHS` generations in a list, so that the
    oldest generation goes whole, and a lookup is one C-level pass of
    ``dict.get`` over its missed keys.

    Args:
        capacity: removals remembered at most (0: none; every miss then reads ``never_stored``).

    Raises:
        ValueError: on a negative capacity.
    """

    __slots__ = ("capacity", "_values", "_epochs", "_epoch_size", "_epoch", "_first_s")

    def __init__(self, capacity: int = DEFAULT_HISTORY_BLOCKS) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._values: dict[K, int] = {}
        self._epoch_size = max(1, -(-capacity // EPOCHS))
        self._epochs: deque[list[K]] = deque([[]])
        self._epoch = 0  # number of the newest generation
        self._first_s: deque[int] = deque([0])  # when each generation began

    def __len__(self) -> int:
        return len(self._values)

    def record(self, key: K, cause: str, now_s: float, level: int = 0, priority: int = 0,
               shared: bool = False) -> None:
        """Remember that ``key`` was removed at ``now_s`` for ``cause`` (one of :data:`REMOVAL_CAUSES`)."""
        self.record_many([key], cause, now_s, level, [priority], shared)

    def record_many(self, keys: Sequence[K], cause: str, now_s: float, level: int = 0,
                    priorities: Sequence[int] | None = None, shared: bool = False) -> None:
        """:meth:`record` each of ``keys``, removed together (``priorities``: each one's, 0 when not given)."""
        if not self.capacity or not keys:
            return
        epochs = self._epochs
        start = 0
        while start < len(keys):
            newest = epochs[-1]
            if len(newest) >= self._epoch_size:
                newest = []
                epochs.append(newest)
                self._first_s.append(int(now_s))
                self._epoch += 1
                if len(epochs) > EPOCHS:
                    self._drop(epochs.popleft(), self._epoch - EPOCHS)
                    self._first_s.popleft()
            end = min(len(keys), start + self._epoch_size - len(newest))
            base = (max(0, int(now_s)) << 24) | ((self._epoch & 0xFF) << 16) | ((level & 0x7) << 5) \
                | (0x10 if shared else 0) | REMOVAL_CAUSES.index(cause)
            part = keys[start:end]
            if priorities is None:
                self._values.update(zip(part, repeat(base)))
            elif len(part) > 1 and priorities.count(priorities[start]) == len(priorities) and start == 0:
                self._values.update(zip(part, repeat(base | ((priorities[0] & 0xFF) << 8))))
            else:
                self._values.update(zip(part, [base | ((p & 0xFF) << 8) for p in priorities[start:end]]))
            newest.extend(part)  # a key recorded again stays in its older generation's list: skipped when it goes
            start = end

    def _drop(self, keys: list[K], epoch: int) -> None:
        """Forget the generation ``epoch`` (its ``keys``), but not the keys recorded again since."""
        values, mine = self._values, epoch & 0xFF
        for key in keys:
            packed = values.get(key)
            if packed is not None and (packed >> 16) & 0xFF == mine:
                del values[key]

    def forget(self, key: K) -> None:
        """A removed ``key`` stored again: its removal no longer names anything (so a key the history holds is in
        no tier, and a lookup asks the tiers only about the keys it does not hold)."""
        self._values.pop(key, None)

    def forget_many(self, keys: Iterable[K]) -> None:
        """:meth:`forget` each of ``keys`` (a C loop)."""
        if self._values:
            deque(map(self._values.pop, keys, repeat(None)), maxlen=0)

    def get_many(self, keys: Sequence[K]) -> list[int | None]:
        """The packed removal of each key (:meth:`Removal.unpack`), ``None`` where none is remembered."""
        return list(map(self._values.get, keys))

    def get(self, key: K) -> Removal | None:
        """The remembered removal of ``key``, if any."""
        packed = self._values.get(key)
        return None if packed is None else Removal.unpack(packed)

    @property
    def horizon_s(self) -> int:
        """When the oldest remembered generation began (the history's reach), seconds; 0 when empty."""
        return self._first_s[0] if self._values else 0


@dataclass(slots=True)
class MissCounts:
    """Blocks missed, by cause, and the reuse gaps of evicted blocks: a node's counts since it started.

    Attributes:
        by_cause: blocks missed per cause (every cause of :data:`CAUSES` present).
        reuse_gap_counts: per bucket of :data:`REUSE_GAP_BUCKETS_S` (and a last one, ``+Inf``), how many missed
            blocks had been evicted that many seconds before the request (``evicted``, ``expired``, ``dropped``):
            mass at short gaps says the cache is too small.
        reuse_gap_sum_s: the sum of those gaps, seconds.
    """

    by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    reuse_gap_counts: list[int] = field(default_factory=lambda: [0] * (len(REUSE_GAP_BUCKETS_S) + 1))
    reuse_gap_sum_s: float = 0.0

    @property
    def total(self) -> int:
        """Blocks missed over every cause."""
        return sum(self.by_cause.values())

    def add_gap(self, gap_s: float) -> None:
        """Count one reuse gap of ``gap_s`` seconds."""
        self.add_gaps([gap_s])

    def add_gaps(self, gaps_s: Iterable[float]) -> None:
        """Count reuse gaps, seconds (a negative one, a clock step, in the first bucket). C loops only."""
        gaps = gaps_s if isinstance(gaps_s, (list, tuple)) else list(gaps_s)
        counts = self.reuse_gap_counts
        for bucket, num in Counter(map(partial(bisect_left, REUSE_GAP_BUCKETS_S), gaps)).items():
            counts[bucket] += num
        self.reuse_gap_sum_s += max(0.0, sum(gaps))

    def count(self, causes: Sequence[str], removals: Sequence[int | None], now_s: float) -> None:
        """Count one lookup's missed blocks: their ``causes`` (:func:`classify`) and, for the evicted, expired and
        dropped ones, the gap since their removal (``removals``: their packed history records). C loops only, but
        for a mixed lookup's gaps."""
        by_cause = self.by_cause
        first = causes[0] if causes else None
        if first is not None and causes.count(first) == len(causes):
            by_cause[first] += len(causes)
            if first in _GAP_CAUSES:  # every block a removal: all their gaps, in C loops
                self._add_removed(cast("Sequence[int]", removals), now_s)  # each a removal: no None
            return
        for cause, num in Counter(causes).items():
            by_cause[cause] += num
        if not _GAP_CAUSES.isdisjoint(causes):
            self.add_gaps([now_s - (packed >> 24) for packed, cause in zip(removals, causes)
                           if packed is not None and cause in _GAP_CAUSES])

    def count_removal(self, packed: int, num: int, now_s: float) -> None:
        """Count ``num`` blocks missed with the same packed removal record (a chain's tail evicted together)."""
        cause = REMOVAL_CAUSES[packed & 0xF]
        self.by_cause[cause] += num
        if cause in _GAP_CAUSES:
            gap = now_s - (packed >> 24)
            self.reuse_gap_counts[bisect_left(REUSE_GAP_BUCKETS_S, gap)] += num
            self.reuse_gap_sum_s += max(0.0, num * gap)

    def _add_removed(self, removals: Sequence[int], now_s: float) -> None:
        """The gaps of removals that all count (no ``None``): one bucket when the newest and the oldest share it
        (a chain's blocks go together), in a few C passes."""
        num = len(removals)
        newest = bisect_left(REUSE_GAP_BUCKETS_S, now_s - (max(removals) >> 24))  # the time is the high bits
        if num > 1 and bisect_left(REUSE_GAP_BUCKETS_S, now_s - (min(removals) >> 24)) != newest:
            self.add_gaps(list(map(sub, repeat(now_s), map(rshift, removals, repeat(24)))))
            return
        self.reuse_gap_counts[newest] += num
        self.reuse_gap_sum_s += max(0.0, num * now_s - sum(map(rshift, removals, repeat(24))))


_GAP_CAUSES = frozenset((EVICTED, EXPIRED, DROPPED))
"""The causes whose gap since the removal the reuse-gap histogram counts."""


def classify(resident: Sequence[bool] | None, removals: Sequence[int | None], *,
             namespace_cause: str = NEVER_STORED, shared_down: bool = False) -> list[str]:
    """The cause of each missed block of a lookup, in order.

    Args:
        resident: per missed block, whether a local tier holds it (it then comes after a missed block); ``None``
            when none does (every block with a removal: the history forgets a block stored again).
        removals: per missed block, its packed removal in the history (:meth:`MissHistory.get_many`), or ``None``.
        namespace_cause: what a block with no record is: ``never_stored``, or ``other_namespace`` when the
            namespace was never stored here and a near one was.
        shared_down: whether the shared tier failed this lookup: a block that left for it is ``tier_unavailable``.
    """
    here_flags: Iterable[bool] = () if resident is None else resident
    if resident is None or True not in resident:
        here_flags = repeat(False)
        if None not in removals:  # all removed: the evicted suffix of a chain, in C loops
            if not shared_down:
                removed = cast("Sequence[int]", removals)  # no None: checked
                return list(map(REMOVAL_CAUSES.__getitem__, map(and_, removed, repeat(0xF))))
        elif removals.count(None) == len(removals):  # the common case: all new
            return [namespace_cause] * len(removals)
    causes = []
    for here, packed in zip(here_flags, removals):
        if here:
            causes.append(AFTER_MISS)
        elif packed is None:
            causes.append(namespace_cause)
        elif shared_down and packed & 0x10:
            causes.append(TIER_UNAVAILABLE)
        else:
            causes.append(REMOVAL_CAUSES[packed & 0xF])
    return causes
