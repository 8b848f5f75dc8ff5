"""Baselines the simulator compares policies with, and that no node runs: ARC and vLLM's SAE scoring.

* **ARC** (Megiddo and Modha, "ARC: a self-tuning, low overhead replacement
  cache", FAST 2003): a recency list ``T1`` and a frequency list ``T2``, their
  ghosts ``B1`` and ``B2`` (keys only), and a target size ``p`` of ``T1`` that a
  ghost hit moves. Here in the memory tier of the simulated store (``kvstore.tools.sim.node``),
  so a chain's blocks are inserted and touched tail first as on a node.
* **SAE** (session-aware eviction, vLLM pull request 50422, as its description
  publishes it): the blocks one request stores form a *session*; the worst
  session goes first, tail first; a session's score is
  ``last_touch + 1500 * hits + 30000 / (1 + depth / 8)``, where ``last_touch``
  counts block touches, ``hits`` the requests that hit the session and
  ``depth`` is the chain position of its first block; an evicted session leaves
  a ghost whose hits decay by 0.9 every 500 touches and come back if the same
  first block is stored again; and an admission gate refuses a new session that
  scores below the worst incumbent. The description leaves two things open, and
  this implementation reads them so: the gate applies only when storing the
  session would evict (applied to a cache with room it refuses every session
  after the first hot one, and scores 0.036 on the agentic trace where LRU scores
  0.235); and a refused session is not stored at all.

Neither takes priorities or TTLs (every block at the default priority, none pinned).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Hashable, Iterator, Sequence

from kvstore.policy import DEFAULT_PRIORITY

SAE_HIT_WEIGHT = 1500.0
SAE_DEPTH_WEIGHT = 30000.0
SAE_DEPTH_SCALE = 8.0
SAE_GHOST_DECAY = 0.9
SAE_GHOST_EVERY = 500


class _Baseline:
    """What the store's index asks of every policy, for a baseline without priorities, retention or TTLs."""

    default_priority = DEFAULT_PRIORITY

    def __init__(self) -> None:
        self._held: set[Hashable] = set()

    def hold(self, key: Hashable) -> None:
        """No victim until :meth:`release` (the store's index holds what it reads and moves)."""
        self._held.add(key)

    def release(self, key: Hashable) -> None:
        """End a hold."""
        self._held.discard(key)

    def hold_many(self, keys: Sequence[Hashable]) -> None:
        self._held.update(keys)

    def release_many(self, keys: Sequence[Hashable]) -> None:
        self._held.difference_update(keys)

    def expire(self, now: float) -> int:
        """Nothing to expire: a baseline keeps no retention."""
        return 0

    def unpin(self, key: Hashable) -> None:
        """Baselines take no TTLs."""

    def unpin_oldest(self, nbytes: int) -> int:
        """Nothing is pinned."""
        return 0

    def pinned_nbytes_of(self, group: Hashable) -> int:
        """Nothing is pinned."""
        return 0

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        return list(map(self.__contains__, keys))

    def __contains__(self, key: object) -> bool:  # pragma: no cover - each baseline has its own
        raise NotImplementedError

    def size_of(self, key: Hashable) -> int:
        return 1

    def priority_of(self, key: Hashable) -> int:
        return DEFAULT_PRIORITY

    def expiry_of(self, key: Hashable) -> float:
        return 0.0

    def pin_of(self, key: Hashable) -> tuple[float, float]:
        return (0.0, 0.0)

    def is_pinned(self, key: Hashable) -> bool:
        return False

    def ttl_ran_out(self, key: Hashable) -> bool:
        return False

    num_ran_out = 0
    uniform_priority = DEFAULT_PRIORITY

    @property
    def pinned_nbytes(self) -> int:
        return 0

    def pin(self, key: Hashable, ttl_s: float, until: float = 0.0) -> None:
        """Baselines take no TTLs."""

    def cool(self, keys: Sequence[Hashable]) -> None:
        """Baselines take no session hints."""

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            self.touch(key)

    def touch(self, key: Hashable) -> None:  # pragma: no cover - each baseline has its own
        raise NotImplementedError

    def insert_many(self, keys: Sequence[Hashable], nbytes: int, priority: int = DEFAULT_PRIORITY,
                    expires_at: float = 0.0, ttl_s: float = 0.0) -> None:
        for key in reversed(keys):
            self.insert(key, nbytes)

    def insert(self, key: Hashable, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:  # pragma: no cover - each baseline has its own
        raise NotImplementedError

    def remove_many(self, keys: Sequence[Hashable]) -> int:
        return sum(map(self.remove, keys))

    def remove(self, key: Hashable) -> int:  # pragma: no cover - each baseline has its own
        raise NotImplementedError


class ARCPolicy(_Baseline):
    """ARC over blocks of one unit each (module docstring), for ``kvstore simulate --policy arc``.

    Args:
        capacity: blocks the tier holds; the ghosts hold as many keys again.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[Hashable]:
        yield from self.t1
        yield from self.t2

    @property
    def nbytes(self) -> int:
        return len(self)

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
        self.t2[key] = None
        self.t2.move_to_end(key)

    def insert(self, key: Hashable, nbytes: int = 1, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:
        c = self.capacity
        if key in self.b1:  # a ghost hit in B1: recency was worth more
            self.p = min(float(c), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
            return
        if key in self.b2:  # in B2: frequency was
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
            return
        self.t1[key] = None
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def remove(self, key: Hashable) -> int:
        self._held.discard(key)
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
            return 1
        if key in self.t2:
            del self.t2[key]
            self.b2[key] = None
            return 1
        return 0

    def victims(self, nbytes: int, now: float = 0.0) -> list[Hashable]:
        """ARC's REPLACE, ``nbytes`` times: the front of ``T1`` while it is over its target ``p``, else of ``T2``."""
        chosen: list[Hashable] = []
        taken: set[Hashable] = set()
        first = iter(self.t1)
        second = iter(self.t2)
        t1_left = len(self.t1)
        while len(chosen) < nbytes:
            from_t1 = t1_left > 0 and (t1_left > self.p or not self.t2)
            source = first if from_t1 else second
            key = next((k for k in source if k not in self._held and k not in taken), None)
            if key is None:
                other = second if from_t1 else first
                key = next((k for k in other if k not in self._held and k not in taken), None)
                if key is None:
                    break
                from_t1 = not from_t1
            chosen.append(key)
            taken.add(key)
            if from_t1:
                t1_left -= 1
        return chosen


class _Group:
    """One SAE session: the blocks one put stored, tail first."""

    __slots__ = ("keys", "depth", "hits", "last", "hit_request", "seq", "alive")

    def __init__(self, depth: int, seq: int, clock: int) -> None:
        self.keys: list[Hashable] = []
        self.depth = depth
        self.hits = 0.0
        self.last = clock
        self.hit_request = -1
        self.seq = seq
        self.alive = 0

    def score(self) -> float:
        return self.last + SAE_HIT_WEIGHT * self.hits + SAE_DEPTH_WEIGHT / (1.0 + self.depth / SAE_DEPTH_SCALE)


class SAEPolicy(_Baseline):
    """vLLM's session-aware eviction as published (module docstring), for ``kvstore simulate --policy sae``.

    The simulated node (``kvstore.tools.sim.node``) calls :meth:`begin_request` once per request and :meth:`admit_put`
    before a put's new blocks.

    Args:
        capacity: blocks the tier holds (ghosts: as many sessions at most).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self._group_of: dict[Hashable, _Group] = {}
        self._heap: list[tuple[float, int, _Group]] = []
        self._clock = 0
        self._request = 0
        self._seq = 0
        self._current: _Group | None = None
        self._depth = 0
        self._ghosts: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()
        self.refused_puts = 0

    def __contains__(self, key: object) -> bool:
        return key in self._group_of

    def __len__(self) -> int:
        return len(self._group_of)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._group_of)

    @property
    def nbytes(self) -> int:
        return len(self._group_of)

    def begin_request(self) -> None:
        """A new request: its touches count one hit per session."""
        self._request += 1
        self._current = None

    def admit_put(self, fresh: Sequence[Hashable], depth: int) -> bool:
        """Whether a put of ``fresh`` new blocks (head first) at chain position ``depth`` is admitted: always while
        they fit, else only if the new session scores at least the worst incumbent (ghost hits restored)."""
        self._depth = depth
        self._current = None
        hits = self._ghost_hits(fresh[0]) if fresh else 0.0
        self._pending_hits = hits
        if len(self._group_of) + len(fresh) <= self.capacity:
            return True
        score = self._clock + SAE_HIT_WEIGHT * hits + SAE_DEPTH_WEIGHT / (1.0 + depth / SAE_DEPTH_SCALE)
        worst = self._worst()
        if worst is not None and score < worst:
            self.refused_puts += 1
            return False
        return True

    def _ghost_hits(self, key: Hashable) -> float:
        ghost = self._ghosts.pop(key, None)
        if ghost is None:
            return 0.0
        hits, at = ghost
        return hits * SAE_GHOST_DECAY ** ((self._clock - at) / SAE_GHOST_EVERY)

    def _worst(self) -> float | None:
        heap = self._heap
        while heap:
            score, seq, group = heap[0]
            if group.alive <= 0:
                heapq.heappop(heap)
                continue
            real = group.score()
            if real != score:  # scores only grow: correct it lazily
                heapq.heapreplace(heap, (real, seq, group))
                continue
            return score
        return None

    def touch(self, key: Hashable) -> None:
        group = self._group_of[key]
        self._clock += 1
        group.last = self._clock
        if group.hit_request != self._request:
            group.hit_request = self._request
            group.hits += 1

    def insert(self, key: Hashable, nbytes: int = 1, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:
        group = self._current
        if group is None:
            self._seq += 1
            group = self._current = _Group(self._depth, self._seq, self._clock)
            group.hits = getattr(self, "_pending_hits", 0.0)
            self._pending_hits = 0.0
            heapq.heappush(self._heap, (group.score(), group.seq, group))
        self._clock += 1
        group.last = self._clock
        group.keys.append(key)  # the put inserts tail first: its keys run tail to head
        group.alive += 1
        self._group_of[key] = group

    def remove(self, key: Hashable) -> int:
        self._held.discard(key)
        group = self._group_of.pop(key, None)
        if group is None:
            return 0
        group.alive -= 1
        if group.alive == 0 and group.keys:
            self._ghosts[group.keys[-1]] = (group.hits, self._clock)  # by its head block
            if len(self._ghosts) > self.capacity:
                self._ghosts.popitem(last=False)
        return 1

    def victims(self, nbytes: int, now: float = 0.0) -> list[Hashable]:
        """The worst session's blocks, tail first, then the next worst's, until ``nbytes``; held blocks skipped."""
        chosen: list[Hashable] = []
        taken: set[Hashable] = set()
        back = []
        while len(chosen) < nbytes and self._heap:
            score, seq, group = heapq.heappop(self._heap)
            if group.alive <= 0:
                continue
            real = group.score()
            if real != score:
                heapq.heappush(self._heap, (real, seq, group))
                continue
            for key in group.keys:
                if len(chosen) >= nbytes:
                    break
                if self._group_of.get(key) is group and key not in self._held and key not in taken:
                    chosen.append(key)
                    taken.add(key)
            back.append((real, seq, group))
        for item in back:
            heapq.heappush(self._heap, item)
        return chosen
