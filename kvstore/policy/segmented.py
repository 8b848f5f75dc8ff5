"""Segmented LRU and the adaptive policy (LRU or segmented LRU, whichever a shadow shows hits more): the default."""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from operator import or_
from typing import Callable, Generic, Hashable, Iterator, Sequence

from kvstore.policy.base import DEFAULT_PRIORITY, PIN_LEVEL, K, check_ttl
from kvstore.policy.lru import PriorityLRUPolicy

PROTECTED_FRACTION = 0.25
"""Segmented LRU's protected segment: at most this fraction of a tier's bytes (``SegmentedLRUPolicy``)."""

SWITCH_MARGIN = 0.03
"""``AdaptivePolicy`` leaves LRU only when its shadow scores this much (relative) better than the tier."""

SCORE_HALF_LIFE_TURNOVERS = 8
"""``AdaptivePolicy`` scores halve every this many turnovers (a turnover: a tier's capacity in accessed bytes)."""


class _Segments(Generic[K]):
    """Segmented LRU over ``(key, nbytes)`` entries: a probation and a protected segment, least recent first.

    A new entry joins probation; a touch moves a probation entry to protected,
    whose least recent entries fall back to probation's most recent end while
    protected holds more than ``target`` bytes. Victims come from probation's
    least recent end first, then protected's. With ``target`` ``None`` there is
    no protected segment: a touch moves the entry to probation's most recent
    end, which is plain LRU (Karedla, Love and Wherry, "Caching strategies to
    improve disk system performance", IEEE Computer 27(3), 1994).

    Both the policy's default priority level and its shadow are one of these.
    """

    __slots__ = ("probation", "protected", "protected_bytes", "target")

    def __init__(self, target: int | None) -> None:
        self.probation: OrderedDict[K, int] = OrderedDict()
        self.protected: OrderedDict[K, int] = OrderedDict()
        self.protected_bytes = 0
        self.target = target

    def __contains__(self, key: object) -> bool:
        return key in self.probation or key in self.protected

    def touch(self, key: K) -> int:
        """Record a use of a tracked ``key``; returns its bytes. Raises ``KeyError`` if it is not tracked."""
        probation = self.probation
        size = probation.get(key)
        if size is None:
            self.protected.move_to_end(key)
            return self.protected[key]
        if self.target is None:
            probation.move_to_end(key)
            return size
        del probation[key]
        self.protected[key] = size
        self.protected_bytes += size
        self._demote_overflow()
        return size

    def _demote_overflow(self) -> None:
        protected, probation = self.protected, self.probation
        while self.protected_bytes > (self.target or 0) and protected:
            key, size = protected.popitem(last=False)
            probation[key] = size
            self.protected_bytes -= size

    def remove(self, key: K) -> int | None:
        """Forget ``key``; its bytes, or ``None`` if it was not tracked."""
        size = self.probation.pop(key, None)
        if size is None:
            size = self.protected.pop(key, None)
            if size is not None:
                self.protected_bytes -= size
        return size

    def set_target(self, target: int | None) -> None:
        """Change the protected segment's bound; ``None`` (plain LRU) folds it into probation's most recent end."""
        self.target = target
        if target is None:
            self.probation.update(self.protected)
            self.protected.clear()
            self.protected_bytes = 0
        else:
            self._demote_overflow()

    def items(self) -> Iterator[tuple[K, int]]:
        """``(key, nbytes)`` in eviction order: probation, then protected, least recent first."""
        yield from self.probation.items()
        yield from self.protected.items()


class _Shadow(Generic[K]):
    """A metadata-only cache of the same capacity that runs the policy ``AdaptivePolicy`` is not running.

    It sees every access the tier's policy sees (touches and inserts, keys and
    sizes) and keeps its own contents, evicting its own victims when over
    capacity (skipping keys the tier holds); it holds no data. It
    answers one question: would that policy have hit this access?
    """

    __slots__ = ("segments", "nbytes", "capacity_bytes", "_held", "parked")

    def __init__(self, segments: _Segments[K], nbytes: int, capacity_bytes: int, held: set[K]) -> None:
        self.segments = segments
        self.nbytes = nbytes
        self.capacity_bytes = capacity_bytes
        self._held = held
        self.parked: OrderedDict[K, int] = OrderedDict()
        """Held keys met at probation's front while evicting, in their order there: they stay the shadow's, at its
        front, until the tier releases a hold (:meth:`unpark`), so that evicting past them does not walk them again
        (a put's held prefix: thousands of keys, once per new block before)."""

    def access(self, key: K, nbytes: int) -> bool:
        """Record an access of ``key``; whether the shadow held it."""
        segments = self.segments
        probation = segments.probation
        if key in probation:
            if segments.target is None:
                probation.move_to_end(key)
            else:
                segments.touch(key)
            return True
        protected = segments.protected
        if key in protected:
            protected.move_to_end(key)
            return True
        if self.parked and key in self.parked:
            self.touch_parked(key)
            return True
        probation[key] = nbytes
        self.nbytes += nbytes
        if self.nbytes > self.capacity_bytes:
            self.trim()
        return False

    def touch_parked(self, key: K) -> None:
        """An access of a parked key: where a touch puts a key of probation."""
        self.segments.probation[key] = self.parked.pop(key)
        self.segments.touch(key)

    def unpark(self) -> None:
        """Put the parked keys back at probation's front, in their order (a hold ended: one may be a victim now)."""
        parked, probation = self.parked, self.segments.probation
        for key, size in reversed(parked.items()):
            probation[key] = size
            probation.move_to_end(key, last=False)
        parked.clear()

    def trim(self) -> None:
        """Evict the shadow's own victims until it fits its capacity; held keys met at probation's front are
        parked (:attr:`parked`), so the order is the one skipping them in place gives."""
        probation, pins, parked = self.segments.probation, self._held, self.parked
        while self.nbytes > self.capacity_bytes and probation:
            key, size = probation.popitem(last=False)
            if key in pins:
                parked[key] = size
            else:
                self.nbytes -= size
        if self.nbytes <= self.capacity_bytes:
            return
        excess = self.nbytes - self.capacity_bytes  # probation is held or parked: protected's front next
        chosen = []
        for key, size in self.segments.items():
            if key in pins:
                continue
            chosen.append(key)
            excess -= size
            if excess <= 0:
                break
        for key in chosen:
            self.nbytes -= self.segments.remove(key) or 0


class SegmentedLRUPolicy(PriorityLRUPolicy[K]):
    """``PriorityLRUPolicy`` whose default priority level is a segmented LRU (``_Segments``).

    Blocks at the default priority start in probation; a block used again moves
    to the protected segment, which holds at most ``protected_fraction`` of the
    tier's bytes, so a burst of new blocks (most of them never used again)
    cannot flush the blocks that are being reused. Priorities other than the
    default keep their own LRU levels, lowest priority evicted first, as
    TensorRT-LLM's retention priorities.

    Args:
        default_priority: the priority a block reverts to when its retention expires.
        capacity_bytes: the tier's capacity, bytes; it sizes the protected segment.
        protected_fraction: the protected segment's bound, a fraction of ``capacity_bytes``.
        clock: the time TTLs run on (see :class:`PriorityLRUPolicy`).
        pin_group: what pinned bytes are counted by (see :class:`PriorityLRUPolicy`).

    Raises:
        ValueError: on a bad priority, a negative capacity or a fraction outside ``[0, 1]``.
    """

    __slots__ = ("_segments", "capacity_bytes")

    def __init__(self, default_priority: int = DEFAULT_PRIORITY, capacity_bytes: int = 0,
                 protected_fraction: float | None = PROTECTED_FRACTION, *,
                 clock: Callable[[], float] | None = None, pin_group: Callable[[K], Hashable] | None = None) -> None:
        super().__init__(default_priority, clock=clock, pin_group=pin_group)
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if protected_fraction is not None and not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self.capacity_bytes = capacity_bytes
        target = None if protected_fraction is None else int(capacity_bytes * protected_fraction)
        self._segments: _Segments[K] = _Segments(target)
        self._levels[self.default_priority] = self._segments.probation

    def __contains__(self, key: object) -> bool:
        return (key in self._levels[self._priority.get(key, self.default_priority)] or key in self._segments.protected
                or key in self._out)

    def contains_many(self, keys: Sequence[K]) -> list[bool]:
        """Whether each key is tracked; the batch form of ``in`` for hot paths."""
        segments = self._segments
        if segments.protected:  # C loops over both segments
            in_probation = map(segments.probation.__contains__, keys)
            found = list(map(or_, in_probation, map(segments.protected.__contains__, keys)))
        else:
            found = list(map(segments.probation.__contains__, keys))
        if self._priority and False in found:
            found = list(map(or_, found, map(self._priority.__contains__, keys)))
        if self._out and False in found:
            found = list(map(or_, found, map(self._out.__contains__, keys)))
        return found

    def _take(self, key: K) -> tuple[int, bool]:
        segments = self._segments
        size = segments.protected.pop(key, None) if key not in self._priority else None
        if size is None:
            return super()._take(key)
        segments.protected_bytes -= size
        return size, True

    def _put_front(self, key: K, nbytes: int, protected: bool) -> None:
        segments = self._segments
        if key in self._priority or not protected or segments.target is None:
            super()._put_front(key, nbytes, protected)
            return
        segments.protected[key] = nbytes
        segments.protected.move_to_end(key, last=False)
        segments.protected_bytes += nbytes
        segments.set_target(segments.target)  # any overflow back to probation

    def _put_touched(self, key: K, nbytes: int, protected: bool) -> None:
        segments = self._segments
        if key in self._priority or segments.target is None:
            super()._put_touched(key, nbytes, protected)
            return
        segments.protected[key] = nbytes  # a touch protects a block of the default level
        segments.protected_bytes += nbytes
        segments.set_target(segments.target)

    def _runs(self) -> list[OrderedDict[K, int]]:
        segments = self._segments
        if not self._priority:  # every key at the default level
            return [segments.probation, segments.protected]
        default = self.default_priority
        runs: list[OrderedDict[K, int]] = []
        for priority, level in enumerate(self._levels):
            if level:
                runs.append(level)
            if priority == default and self._segments.protected:
                runs.append(self._segments.protected)
        return runs

    def remove_many(self, keys: Sequence[K]) -> int:
        """:meth:`remove` each of ``keys``; return the bytes freed."""
        if self._held:
            self._held.difference_update(keys)
        if self._ran_out:
            self._ran_out.difference_update(keys)
        if not self._all_default(keys):
            return sum(map(self.remove, keys))
        segments = self._segments
        sizes = list(map(segments.probation.pop, keys, repeat(None)))  # a C loop
        if segments.protected and None in sizes:
            for i, key in enumerate(keys):
                if sizes[i] is None:
                    size = sizes[i] = segments.protected.pop(key, None)
                    if size is not None:
                        segments.protected_bytes -= size
        return self._forget_sizes(sizes)

    def cool(self, keys: Sequence[K]) -> None:
        """:meth:`PriorityLRUPolicy.cool`; keys of the protected segment go to probation's front."""
        protected = self._segments.protected
        if protected:
            for key in keys:
                size = protected.pop(key, None)
                if size is not None:
                    self._segments.protected_bytes -= size
                    self._segments.probation[key] = size
        super().cool(keys)

    def size_of(self, key: K) -> int:
        """Bytes of ``key``. Raises ``KeyError`` if it is not tracked."""
        size = self._segments.protected.get(key)
        return size if size is not None else super().size_of(key)

    def priority_of(self, key: K) -> int:
        """Current priority of ``key``. Raises ``KeyError`` if it is not tracked."""
        if key in self._segments.protected:
            return self.default_priority
        return super().priority_of(key)

    def touch(self, key: K) -> None:
        """Record a use of ``key``: within the default level a probation block becomes protected (a held one taken out of
        the order comes back there). Raises ``KeyError`` if unknown."""
        out = self._out.pop(key, None)
        if out is not None:
            self._put_touched(key, *out)
            priority = self._priority.get(key)
        elif (priority := self._priority.get(key)) is None:
            self._segments.touch(key)
        else:
            self._levels[priority].move_to_end(key)
        if priority == PIN_LEVEL:
            self._refresh(key)

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` each of ``keys`` (head first) tail first. Raises ``KeyError`` if one is not tracked."""
        segments = self._segments
        if segments.target is None and self._all_default(keys):  # plain LRU: one C loop
            deque(map(segments.probation.move_to_end, reversed(keys)), 0)
            return
        for key in reversed(keys):
            self.touch(key)

    def remove(self, key: K) -> int:
        """Forget ``key``, held or not; return its bytes, or 0 if it was not tracked."""
        self._held.discard(key)
        size = self._segments.protected.pop(key, None)
        if size is None:
            return super().remove(key)
        self._segments.protected_bytes -= size
        self._nbytes -= size
        self._count -= 1
        return size


class AdaptivePolicy(SegmentedLRUPolicy[K]):
    """The default: LRU, or segmented LRU when a shadow of segmented LRU shows it would hit more. Needs no tuning.

    The tier runs one of two policies over its default priority level, plain
    LRU (the start) or :class:`SegmentedLRUPolicy`'s segmented LRU, and a
    shadow (``_Shadow``: keys and sizes, no data, the same capacity) runs the
    other on the same accesses. Each side scores the bytes it would have hit,
    both scores halving every :data:`SCORE_HALF_LIFE_TURNOVERS` turnovers. When
    the shadow's score passes the tier's, by :data:`SWITCH_MARGIN` when the
    tier runs LRU and by any amount when it runs segmented LRU, the two swap:
    the tier takes the shadow's policy over its own contents, and the shadow
    restarts from a copy of the tier's contents under the policy it ran. So a
    workload where LRU is best stays on LRU, paying only the shadow's upkeep,
    and one where reused blocks are worth protecting moves to segmented LRU.

    It is the set-dueling idea of adaptive insertion (Qureshi, Jaleel, Patt,
    Steely and Emer, "Adaptive insertion policies for high performance caching",
    ISCA 2007) with a whole shadow cache in place of sampled sets, as in
    Waldspurger, Saemundsson, Ahmad and Park, "Cache modeling and optimization
    using miniature simulations" (USENIX ATC 2017), without the sampling:
    prefix chains do not survive sampling by key. ``docs/simulate.md`` has the
    measurements, and the policies that were tried and did not work.

    Args:
        default_priority: the priority a block reverts to when its retention expires.
        capacity_bytes: the tier's capacity, bytes; the shadow's capacity and the
            protected segment's scale. With 0 the policy stays plain LRU.

    Raises:
        ValueError: on a bad priority or a negative capacity.
    """

    __slots__ = ("_shadow", "_lru_mode", "_tier_score", "_shadow_score", "_accessed", "_decay", "switches")

    def __init__(self, default_priority: int = DEFAULT_PRIORITY, capacity_bytes: int = 0, *,
                 clock: Callable[[], float] | None = None, pin_group: Callable[[K], Hashable] | None = None) -> None:
        super().__init__(default_priority, capacity_bytes, None, clock=clock, pin_group=pin_group)
        self._lru_mode = True
        self._shadow = _Shadow(_Segments(int(capacity_bytes * PROTECTED_FRACTION)), 0, capacity_bytes, self._held)
        self._tier_score = 0.0
        self._shadow_score = 0.0
        self._accessed = 0
        self._decay = 0.5 ** (1.0 / SCORE_HALF_LIFE_TURNOVERS)
        self.switches = 0
        """How often the tier and the shadow swapped policies."""

    @property
    def mode(self) -> str:
        """The policy the tier runs now: ``lru`` or ``slru``."""
        return "lru" if self._lru_mode else "slru"

    def _access(self, key: K, nbytes: int, hit: bool) -> None:
        if hit:
            self._tier_score += nbytes
        if self._shadow.access(key, nbytes):
            self._shadow_score += nbytes
        self._accessed += nbytes
        if self._accessed >= self.capacity_bytes > 0:
            self._turnover()

    def _turnover(self) -> None:
        """A capacity's worth of bytes was accessed: decay the scores, and swap if the shadow is ahead."""
        self._accessed = 0
        self._tier_score *= self._decay
        self._shadow_score *= self._decay
        margin = 1.0 + SWITCH_MARGIN if self._lru_mode else 1.0
        if self._shadow_score > self._tier_score * margin:
            self._swap()

    def _swap(self) -> None:
        """The tier takes the shadow's policy, and the shadow restarts from the tier's contents and old policy."""
        segments = self._segments
        old: _Segments[K] = _Segments(segments.target)
        old.probation.update((key, size) for key, size in self._ordered() if key not in segments.protected)
        old.protected.update(segments.protected)
        old.protected_bytes = segments.protected_bytes
        self._lru_mode = not self._lru_mode
        segments.set_target(None if self._lru_mode else int(self.capacity_bytes * PROTECTED_FRACTION))
        self._shadow = _Shadow(old, self._nbytes, self.capacity_bytes, self._held)
        self._shadow.trim()
        self._tier_score, self._shadow_score = self._shadow_score, self._tier_score
        self.switches += 1

    def release(self, key: K) -> None:
        """End the hold of ``key`` (see :meth:`PriorityLRUPolicy.release`); the shadow's parked keys return."""
        PriorityLRUPolicy.release(self, key)
        if self._shadow.parked:
            self._shadow.unpark()

    def release_many(self, keys: Sequence[K]) -> None:
        """:meth:`release` each of ``keys``, in order."""
        if not self._out:  # no held key was taken out of the order: a release only ends a hold
            self._held.difference_update(keys)
        else:
            for key in keys:
                PriorityLRUPolicy.release(self, key)
        if self._shadow.parked:
            self._shadow.unpark()

    def remove(self, key: K) -> int:
        """Forget ``key`` (see :meth:`SegmentedLRUPolicy.remove`); a hold ends with it: the shadow's parked keys
        return."""
        nbytes = SegmentedLRUPolicy.remove(self, key)
        if self._shadow.parked:
            self._shadow.unpark()
        return nbytes

    def remove_many(self, keys: Sequence[K]) -> int:
        """:meth:`remove` each of ``keys``; return the bytes freed."""
        if self._held:
            self._held.difference_update(keys)
        if not self._all_default(keys):
            nbytes = sum(SegmentedLRUPolicy.remove(self, key) for key in keys)
        else:
            nbytes = SegmentedLRUPolicy.remove_many(self, keys)
        if self._shadow.parked:
            self._shadow.unpark()
        return nbytes

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:
        """Track ``key`` as a new block (see :meth:`PriorityLRUPolicy.insert` for arguments and errors)."""
        super().insert(key, nbytes, priority, expires_at, ttl_s, until)
        self._access(key, nbytes, False)

    def touch(self, key: K) -> None:
        """Record a use (a hit) of ``key``; a pinned key's TTL runs again from now. Raises ``KeyError`` if unknown."""
        out = self._out.pop(key, None)
        if out is not None:  # a held key taken out of the order: back where a touch puts it
            self._put_touched(key, *out)
            nbytes = out[0]
            priority = self._priority.get(key)
        elif (priority := self._priority.get(key)) is None:
            nbytes = self._segments.touch(key)
        else:
            level = self._levels[priority]
            level.move_to_end(key)
            nbytes = level[key]
        if priority == PIN_LEVEL:
            self._refresh(key)
        self._access(key, nbytes, True)

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` each of ``keys`` (head first) tail first; the same as one call per key, only faster.

        Raises:
            KeyError: if a key is not tracked (the keys before it, tail first, are touched).
        """
        if self.capacity_bytes <= 0 or not self._all_default(keys):
            for key in reversed(keys):
                self.touch(key)
            return
        self._run(reversed(keys), True, 0)

    def insert_many(self, keys: Sequence[K], nbytes: int, priority: int = DEFAULT_PRIORITY,
                    expires_at: float = 0.0, ttl_s: float = 0.0) -> None:
        """:meth:`insert` each of ``keys`` (head first) tail first; the same as one call per key, only faster.

        Raises:
            ValueError: as :meth:`insert`; nothing is inserted then.
        """
        self._check_batch(keys, nbytes, priority)
        check_ttl(ttl_s)
        if priority != self.default_priority or self.capacity_bytes <= 0 or ttl_s:
            for key in reversed(keys):
                self.insert(key, nbytes, priority, expires_at, ttl_s)
            return
        self._run(reversed(keys), False, self._intern(nbytes))

    def _run(self, keys: Iterator[K], touch: bool, size: int) -> None:
        """Touches (``touch``) or inserts of ``size`` bytes, in order, each with its shadow access, in one loop.

        The same steps as :meth:`touch` or :meth:`insert` with :meth:`_access` per key, inlined: this is the
        simulator's hot loop (``benchmarks/bench_sim_speed.py``).
        """
        segments, capacity, pins = self._segments, self.capacity_bytes, self._held
        probation = segments.probation
        tier_lru = segments.target is None
        shadow = self._shadow
        shadow_p, shadow_q = shadow.segments.probation, shadow.segments.protected
        shadow_lru = shadow.segments.target is None
        accessed, tier_score, shadow_score = self._accessed, self._tier_score, self._shadow_score
        added = 0
        for key in keys:
            if not touch:
                probation[key] = size
                added += 1
            elif tier_lru:
                probation.move_to_end(key)
                size = probation[key]
                tier_score += size
            else:
                size = segments.touch(key)
                tier_score += size
            if key in shadow_p:  # the shadow's side: _Shadow.access, inlined
                if shadow_lru:
                    shadow_p.move_to_end(key)
                else:
                    shadow.segments.touch(key)
                shadow_score += size
            elif key in shadow_q:
                shadow_q.move_to_end(key)
                shadow_score += size
            elif shadow.parked and key in shadow.parked:
                shadow.touch_parked(key)
                shadow_score += size
            else:
                shadow_p[key] = size
                shadow.nbytes += size
                if shadow.nbytes > capacity:
                    victim, victim_size = shadow_p.popitem(last=False)
                    shadow.nbytes -= victim_size
                    if victim in pins:
                        shadow.parked[victim] = victim_size
                        shadow.nbytes += victim_size
                        shadow.trim()
                    elif shadow.nbytes > capacity:
                        shadow.trim()
            accessed += size
            if accessed >= capacity:
                self._nbytes += added * size
                self._count += added
                added = 0
                self._accessed, self._tier_score, self._shadow_score = accessed, tier_score, shadow_score
                self._turnover()
                accessed, tier_score, shadow_score = self._accessed, self._tier_score, self._shadow_score
                tier_lru = segments.target is None
                shadow = self._shadow
                shadow_p, shadow_q = shadow.segments.probation, shadow.segments.protected
                shadow_lru = shadow.segments.target is None
        self._nbytes += added * size
        self._count += added
        self._accessed, self._tier_score, self._shadow_score = accessed, tier_score, shadow_score


class SessionPolicy(AdaptivePolicy[K]):
    """The ``session`` policy of one tier: the adaptive policy's order, with the store's sessions on top.

    The session mechanisms work across tiers, in
    :class:`~kvstore.policy.sessions.SessionTracker`, which the store and the
    simulator run beside the tiers' policies when the policy is ``session``: they
    move dead chains to the front of this order (:meth:`cool`) and bound what a
    put admits. Traffic that names no session gets exactly the adaptive policy,
    the default's (``docs/agentic.md``).

    Args: as :class:`AdaptivePolicy`.
    """

    __slots__ = ()
