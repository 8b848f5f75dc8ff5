"""LRU within each priority level, lowest level first: the policy the node runs above a tier it demotes into."""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import OrderedDict, deque
from functools import partial
from itertools import accumulate, islice, repeat
from operator import or_
from typing import Callable, Generic, Hashable, Iterator, Sequence

from kvstore.policy.base import DEFAULT_PRIORITY, MAX_PRIORITY, PIN_LEVEL, K, check_priority, check_ttl

def _zero() -> float:
    return 0.0


class PriorityLRUPolicy(Generic[K]):
    """LRU within each priority level, lowest level first: TensorRT-LLM's retention semantics.

    Memory: one ``OrderedDict`` node per key in its level, holding its size (size
    ints are interned, blocks mostly share a few sizes), plus small maps for keys
    off the default priority, held keys, retained keys and pinned keys only: about 110
    bytes per key beside the key itself (``benchmarks/bench_index.py``).

    **Pins** (a TTL, ``docs/agentic.md``): a key inserted or pinned with ``ttl_s``
    leaves its priority level for the pin run (:data:`~kvstore.policy.base.PIN_LEVEL`),
    which is evicted only after every other level, least recently used first. Every
    touch sets its end again to ``clock() + ttl_s``, so a TTL runs from the last
    hit or put. When it ends (:meth:`expire`, which :meth:`victims` calls), the key
    goes back to its own priority level at the front, the earliest ended first:
    the next victim there, tail first, as a retention that ends. Expiry never removes a key.

    Args:
        default_priority: the priority a block reverts to when its retention expires.
        clock: the time TTLs run on, seconds (the owner's clock; the simulator passes the trace's time).
        pin_group: maps a key to the group its pinned bytes count in (:meth:`pinned_nbytes_of`; the store
            passes the namespace tag); ``None`` for no groups.
    """

    __slots__ = ("_levels", "_priority", "_held", "_out", "_expiry", "_heap", "_heap_seq", "_nbytes", "_count",
                 "_interned", "default_priority", "_pins", "_pin_priority", "_pin_heap", "_pinned_nbytes",
                 "_pinned_groups", "_ran_out", "clock", "pin_group")

    def __init__(self, default_priority: int = DEFAULT_PRIORITY, *, clock: Callable[[], float] | None = None,
                 pin_group: Callable[[K], Hashable] | None = None) -> None:
        self.default_priority = check_priority(default_priority)
        self._levels: list[OrderedDict[K, int]] = [OrderedDict() for _ in range(PIN_LEVEL + 1)]
        self._priority: dict[K, int] = {}  # only keys whose level is not the default one (PIN_LEVEL: pinned)
        self._pins: dict[K, list[float]] = {}  # pinned key -> [ttl_s, until]
        self._pin_priority: dict[K, int] = {}  # pinned keys whose own priority is not the default
        self._pin_heap: list[tuple[float, int, K]] = []  # (until, sequence, key), lazily corrected at expiry
        self._pinned_nbytes = 0
        self._pinned_groups: dict[Hashable, int] = {}
        self._ran_out: set[K] = set()  # keys whose TTL ran out, still tracked (a miss of one reads ``expired``)
        self.clock: Callable[[], float] = clock or _zero
        self.pin_group = pin_group
        self._held: set[K] = set()
        self._out: dict[K, tuple[int, bool]] = {}  # held keys taken out of the order: (nbytes, was protected)
        self._expiry: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []  # (expires_at, insertion number, key): ties in insertion order
        self._heap_seq = 0
        self._nbytes = 0
        self._count = 0
        self._interned: dict[int, int] = {}

    def _intern(self, nbytes: int) -> int:
        return self._interned.setdefault(nbytes, nbytes) if len(self._interned) < 65536 else nbytes

    def _level_of(self, key: K) -> int:
        return self._priority.get(key, self.default_priority)

    def __contains__(self, key: object) -> bool:
        return key in self._levels[self._priority.get(key, self.default_priority)] or key in self._out

    def __len__(self) -> int:
        return self._count

    def contains_many(self, keys: Sequence[K]) -> list[bool]:
        """Whether each key is tracked; the batch form of ``in`` for hot paths (lookup of 1,024 hashes)."""
        found = list(map(self._levels[self.default_priority].__contains__, keys))  # a C loop
        others = self._priority
        if others and False in found:  # some keys hold a non-default priority
            found = list(map(or_, found, map(others.__contains__, keys)))
        if self._out and False in found:
            found = list(map(or_, found, map(self._out.__contains__, keys)))
        return found

    def __iter__(self) -> Iterator[K]:
        """Every tracked key, in eviction order: lowest priority first, least recent first, then the held keys."""
        for key, _ in self._ordered():
            yield key

    def _ordered(self) -> Iterator[tuple[K, int]]:
        """``(key, nbytes)`` of every tracked key in eviction order, then the held keys (as they would return)."""
        for run in self._runs():
            yield from run.items()
        for key, (nbytes, _) in list(self._out.items()):
            yield key, nbytes

    def is_held(self, key: K) -> bool:
        """Whether ``key`` is held (no victim)."""
        return key in self._held

    def hold(self, key: K) -> None:
        """Hold ``key``: it is no victim until :meth:`release`, and stays tracked (its bytes, priority, retention).

        Raises:
            KeyError: if ``key`` is not tracked, or already held (the index holds a key once).
        """
        if key in self._held or key not in self:
            raise KeyError(key)
        self._held.add(key)

    def hold_many(self, keys: Sequence[K]) -> None:
        """:meth:`hold` each of ``keys``. Raises ``KeyError`` as :meth:`hold` (the keys before it are held)."""
        held = self._held
        if held.isdisjoint(keys) and False not in self.contains_many(keys):  # C loops (a put's protected prefix)
            before = len(held)
            held.update(keys)
            if len(held) == before + len(keys):
                return
            held.difference_update(keys)  # a key twice: hold them one by one, to raise where :meth:`hold` does
        for key in keys:
            self.hold(key)

    def release(self, key: K) -> None:
        """End the hold of ``key``; a key not held is ignored. One taken out of the order goes back to its front."""
        if key not in self._held:
            return
        self._held.discard(key)
        out = self._out.pop(key, None)
        if out is not None:
            self._put_front(key, *out)

    def release_many(self, keys: Sequence[K]) -> None:
        """:meth:`release` each of ``keys``, in order."""
        if not self._out:  # no held key was taken out of the order: a release only ends a hold
            self._held.difference_update(keys)
            return
        for key in keys:
            self.release(key)

    def _take(self, key: K) -> tuple[int, bool]:
        """Remove ``key`` from its run; its bytes and whether it was in a protected segment. Raises ``KeyError``."""
        return self._levels[self._level_of(key)].pop(key), False

    def _put_front(self, key: K, nbytes: int, protected: bool) -> None:
        """Put a key :meth:`_take` took back at the least recent end of its run."""
        level = self._levels[self._level_of(key)]
        level[key] = nbytes
        level.move_to_end(key, last=False)

    def _put_touched(self, key: K, nbytes: int, protected: bool) -> None:
        """Put a key :meth:`_take` took back where a touch puts it: the most recent end of its run."""
        self._levels[self._level_of(key)][key] = nbytes

    def _any_out(self, keys: Sequence[K]) -> bool:
        out = self._out
        return bool(out) and True in map(out.__contains__, keys)

    def _runs(self) -> list[OrderedDict[K, int]]:
        """The non-empty levels (``key -> nbytes``, least recent first), in eviction order (for :meth:`victims`)."""
        if not self._priority:  # every key at the default level
            return [self._levels[self.default_priority]]
        return [level for level in self._levels if level]

    @property
    def nbytes(self) -> int:
        """Bytes of every tracked key."""
        return self._nbytes

    def size_of(self, key: K) -> int:
        """Bytes of ``key``. Raises ``KeyError`` if it is not tracked."""
        size = self._levels[self._level_of(key)].get(key)
        return size if size is not None else self._out[key][0]

    def priority_of(self, key: K) -> int:
        """Current priority of ``key`` (a pinned key's own, which it keeps under its pin). Raises ``KeyError`` if it
        is not tracked."""
        level = self._level_of(key)
        if key not in self._levels[level] and key not in self._out:
            raise KeyError(key)
        if level == PIN_LEVEL:
            return self._pin_priority.get(key, self.default_priority)
        return level

    # ------------------------------------------------------------------ pins (TTLs)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of the keys whose TTL runs."""
        return self._pinned_nbytes

    def pinned_nbytes_of(self, group: Hashable) -> int:
        """Bytes of the pinned keys of one ``pin_group``."""
        return self._pinned_groups.get(group, 0)

    def pin_of(self, key: K) -> tuple[float, float]:
        """``(ttl_s, until)`` of a pinned key, ``(0.0, 0.0)`` for one without a TTL."""
        pin = self._pins.get(key)
        return (pin[0], pin[1]) if pin is not None else (0.0, 0.0)

    def is_pinned(self, key: K) -> bool:
        """Whether the TTL of ``key`` runs."""
        return key in self._pins

    @property
    def uniform_priority(self) -> int | None:
        """The priority of every tracked key when all have the default one and none is pinned, else ``None``
        (batch callers skip asking key by key)."""
        return None if self._priority else self.default_priority

    @property
    def num_ran_out(self) -> int:
        """Tracked keys whose TTL ran out (:meth:`ttl_ran_out`)."""
        return len(self._ran_out)

    def ttl_ran_out(self, key: K) -> bool:
        """Whether ``key`` had a TTL that ran out (not one ended by :meth:`unpin` or :meth:`cool`)."""
        return key in self._ran_out

    def pin(self, key: K, ttl_s: float, until: float = 0.0) -> None:
        """Give a tracked ``key`` a TTL of ``ttl_s`` seconds running until ``until`` (``clock() + ttl_s`` when 0.0),
        or set a pinned key's TTL anew; it moves to the most recent end of the pin run.

        Raises:
            KeyError: if ``key`` is not tracked.
            ValueError: on a TTL that is not a finite number > 0.
        """
        check_ttl(ttl_s)
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 to pin, got {ttl_s}")
        until = until or self.clock() + ttl_s
        self._ran_out.discard(key)
        pin = self._pins.get(key)
        if pin is not None:
            if until < pin[1]:  # its heap item is due later: one more, due earlier (the later one is skipped)
                self._heap_push_pin(until, key)
            pin[0], pin[1] = ttl_s, until
            self._move_pinned(key)
            return
        level = self._level_of(key)
        out = self._out.get(key)
        if out is not None:
            nbytes = out[0]
        else:
            nbytes, _ = self._take(key)
        if level != self.default_priority:
            self._pin_priority[key] = level
        self._priority[key] = PIN_LEVEL
        self._pins[key] = [ttl_s, until]
        self._heap_push_pin(until, key)
        self._count_pinned(key, nbytes)
        if out is None:
            self._levels[PIN_LEVEL][key] = nbytes

    def pin_many(self, keys: Sequence[K], ttl_s: float) -> None:
        """:meth:`pin` each tracked key of ``keys`` (a chain segment, head first) tail first; untracked keys are
        skipped."""
        for key in reversed(keys):
            if key in self:
                self.pin(key, ttl_s)

    def unpin(self, key: K) -> None:
        """End the TTL of ``key`` now: it goes back to its priority level, at the front. A key without one is
        ignored."""
        if key in self._pins:
            self._unpin_to_front([key])

    def unpin_oldest(self, nbytes: int) -> int:
        """End the TTLs of the least recently used pinned keys until ``nbytes`` are unpinned (a held key taken out
        of the order is not met); each goes to the most recent end of its priority level, so that under one TTL
        for every key the whole order stays LRU's. Returns the bytes unpinned (fewer than ``nbytes`` when the
        pins left are out of the order).

        A bounded share of pins (``store.pins.max_tier_fraction``) keeps the most recently used pinned keys.
        """
        run = self._levels[PIN_LEVEL]
        freed, taken = 0, []
        for key, size in run.items():
            if freed >= nbytes:
                break
            taken.append(key)
            freed += size
        for key in taken:
            level = self._pin_priority.pop(key, self.default_priority)
            if level == self.default_priority:
                del self._priority[key]
            else:
                self._priority[key] = level
            size = run.pop(key)
            self._forget_pin(key, size)
            self._put_touched(key, size, False)
        return freed

    def _move_pinned(self, key: K) -> None:
        run = self._levels[PIN_LEVEL]
        if key in run:
            run.move_to_end(key)

    def _heap_push_pin(self, until: float, key: K) -> None:
        self._heap_seq += 1
        heapq.heappush(self._pin_heap, (until, self._heap_seq, key))

    def _count_pinned(self, key: K, nbytes: int) -> None:
        self._pinned_nbytes += nbytes
        if self.pin_group is not None:
            group = self.pin_group(key)
            left = self._pinned_groups.get(group, 0) + nbytes
            if left:
                self._pinned_groups[group] = left
            else:
                self._pinned_groups.pop(group, None)

    def _refresh(self, key: K) -> None:
        """A touch of a pinned key: its TTL runs again from now."""
        pin = self._pins[key]
        pin[1] = self.clock() + pin[0]

    def _forget_pin(self, key: K, nbytes: int) -> None:
        """Drop the pin bookkeeping of a key leaving the pin run (removed or unpinned)."""
        del self._pins[key]
        self._count_pinned(key, -nbytes)

    def _unpin_to_front(self, keys: list[K]) -> None:
        """Pinned ``keys`` (the first ended first) back to their priority levels, each at the front, the first
        of ``keys`` frontmost."""
        run = self._levels[PIN_LEVEL]
        for key in reversed(keys):
            level = self._pin_priority.pop(key, self.default_priority)
            if level == self.default_priority:
                del self._priority[key]
            else:
                self._priority[key] = level
            out = self._out.get(key)
            nbytes = out[0] if out is not None else run.pop(key)
            self._forget_pin(key, nbytes)
            if out is None:  # a held key taken out of the order returns to its new level when released
                self._put_front(key, nbytes, False)

    def expire_pins(self, now: float) -> int:
        """End every TTL that ran out by ``now`` (each pin's end is as of its last touch); returns how many.

        The keys go back to their priority levels at the front, the earliest ended first, then in the order
        they were pinned (a chain's tail first).
        """
        heap, pins = self._pin_heap, self._pins
        ended: list[K] = []
        while heap and heap[0][0] <= now:
            until, _, key = heapq.heappop(heap)
            pin = pins.get(key)
            if pin is None:
                continue  # unpinned or removed since
            if pin[1] > now:  # touched since: wait for its new end
                self._heap_push_pin(pin[1], key)
                continue
            ended.append(key)
        if ended:
            ended = list(dict.fromkeys(ended))
            self._unpin_to_front(ended)
            self._ran_out.update(ended)
        return len(ended)

    def expiry_of(self, key: K) -> float:
        """When the retention of ``key`` ends (0.0 when it has none)."""
        return self._expiry.get(key, 0.0)

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0,
               ttl_s: float = 0.0, until: float = 0.0) -> None:
        """Track ``key`` as the most recently used block of its priority (of the pin run, with a TTL).

        Args:
            key: the block key.
            nbytes: capacity the block occupies, bytes.
            priority: retention priority in ``[0, 100]``.
            expires_at: time (the caller's clock, seconds) when the priority reverts
                to the default; 0.0 for no retention limit.
            ttl_s: a TTL, seconds (0.0: none): the key is pinned (see the class docstring).
            until: when that TTL runs out (a block moved between tiers keeps its own); ``clock() + ttl_s``
                when 0.0.

        Raises:
            ValueError: on an out-of-range priority or TTL, negative size, or a key already tracked.
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
                self._heap_seq += 1
                heapq.heappush(self._heap, (expires_at, self._heap_seq, key))
        self._levels[priority][key] = self._intern(nbytes)
        self._nbytes += nbytes
        self._count += 1
        if ttl_s and (not until or until > self.clock()):  # a TTL that ran out on the way arrives unpinned
            self.pin(key, check_ttl(ttl_s), until)

    def touch(self, key: K) -> None:
        """Move ``key`` to the most recent end of its level; a pinned key's TTL runs again from now. Raises
        ``KeyError`` if unknown."""
        out = self._out.pop(key, None)
        if out is not None:
            self._put_touched(key, *out)
        else:
            self._levels[self._level_of(key)].move_to_end(key)
        if self._pins and key in self._pins:
            self._refresh(key)

    def _all_default(self, keys: Sequence[K]) -> bool:
        """Whether every key of ``keys`` is in the default level's run (none off it, none held out of the order):
        the condition of the batch calls' C loops."""
        others = self._priority
        return not (others and True in map(others.__contains__, keys)) and not self._any_out(keys)

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` each of ``keys`` (a chain segment, head first) tail first, so the head ends most recent.

        Raises:
            KeyError: if a key is not tracked (the keys before it, tail first, are touched).
        """
        if self._all_default(keys):  # every key at the default level: one C loop
            deque(map(self._levels[self.default_priority].move_to_end, reversed(keys)), 0)
            return
        for key in reversed(keys):
            self.touch(key)

    def cool(self, keys: Sequence[K]) -> None:
        """Move the tracked ``keys`` (a dead chain, head first) to the front of their runs, the tail frontmost: the
        next victims of their priority. A pinned key is unpinned first; held keys and untracked ones are skipped.

        The ``session`` policy's dead chains (``kvstore.policy.sessions``).
        """
        if self._pins:
            pinned = [key for key in keys if key in self._pins and key not in self._out]
            if pinned:
                self._unpin_to_front(pinned[::-1])
        default = self._levels[self.default_priority]
        present = [key for key, hit in zip(keys, map(default.__contains__, keys)) if hit]  # C loops
        others = self._priority
        if others:
            for key in keys:
                level = others.get(key)
                if level is not None and key not in self._out:
                    self._levels[level].move_to_end(key, last=False)
        deque(map(partial(default.move_to_end, last=False), present), 0)

    def insert_many(self, keys: Sequence[K], nbytes: int, priority: int = DEFAULT_PRIORITY,
                    expires_at: float = 0.0, ttl_s: float = 0.0) -> None:
        """:meth:`insert` each of ``keys`` (head first, ``nbytes`` each) tail first, so the head ends most recent.

        Raises:
            ValueError: as :meth:`insert`; nothing is inserted then.
        """
        self._check_batch(keys, nbytes, priority)
        check_ttl(ttl_s)
        if priority != self.default_priority or ttl_s:
            for key in reversed(keys):
                self.insert(key, nbytes, priority, expires_at, ttl_s)
            return
        self._levels[priority].update(zip(reversed(keys), repeat(self._intern(nbytes))))
        self._nbytes += nbytes * len(keys)
        self._count += len(keys)

    def _check_batch(self, keys: Sequence[K], nbytes: int, priority: int) -> None:
        """What :meth:`insert` checks, for a batch. Raises ``ValueError``."""
        check_priority(priority)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if True in self.contains_many(keys) or len(set(keys)) < len(keys):
            raise ValueError("a key is already tracked, or given twice")

    def remove_many(self, keys: Sequence[K]) -> int:
        """:meth:`remove` each of ``keys``; return the bytes freed."""
        if self._held:
            self._held.difference_update(keys)
        if self._ran_out:
            self._ran_out.difference_update(keys)
        if not self._all_default(keys):
            return sum(map(self.remove, keys))
        sizes = list(map(self._levels[self.default_priority].pop, keys, repeat(None)))  # a C loop
        return self._forget_sizes(sizes)

    def _forget_sizes(self, sizes: list[int | None]) -> int:
        """Account for default-level entries just popped: ``None`` where a key was not tracked."""
        found = [size for size in sizes if size is not None]
        freed = sum(found)
        self._nbytes -= freed
        self._count -= len(found)
        return freed

    def remove(self, key: K) -> int:
        """Forget ``key``, held or not; return its bytes, or 0 if it was not tracked.

        A held key is forgotten with its hold: a key stored again while an old
        reader still reads the old copy is a new block, not held (the index
        gives the old reader's references an entry of their own).
        """
        self._held.discard(key)
        out = self._out.pop(key, None)
        level = self._priority.pop(key, self.default_priority)
        nbytes = out[0] if out is not None else self._levels[level].pop(key, None)
        if nbytes is None:
            return 0
        self._expiry.pop(key, None)  # its heap item goes stale and is skipped
        if self._ran_out:
            self._ran_out.discard(key)
        if level == PIN_LEVEL:
            self._pin_priority.pop(key, None)
            self._forget_pin(key, nbytes)
        self._nbytes -= nbytes
        self._count -= 1
        return nbytes

    def expire(self, now: float) -> int:
        """Revert every retention that ended at or before ``now`` to the default priority, and end every TTL that
        ran out (:meth:`expire_pins`).

        Reverted blocks join the default level as its least recent, the earliest
        expiry first in line: their retention already kept them longer than
        plain LRU would have, so they are the next victims there (O(1) each,
        where keeping their exact rank would cost O(n)). A pinned block's retention
        that ends changes the priority it returns to when its TTL ends. Returns how many were reverted.
        """
        reverted: list[K] = []
        default = self._levels[self.default_priority]
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, key = heapq.heappop(self._heap)
            if self._expiry.get(key) != expires_at:
                continue  # removed or re-inserted since
            del self._expiry[key]
            if key in self._pins:  # it returns to the default level when its TTL ends
                self._pin_priority.pop(key, None)
                continue
            level = self._priority.pop(key)
            if key in self._out:  # it returns at the default level
                continue
            default[key] = self._levels[level].pop(key)
            reverted.append(key)
        for key in reversed(reverted):
            default.move_to_end(key, last=False)
        return len(reverted) + (self.expire_pins(now) if self._pin_heap else 0)

    def victims(self, nbytes: int, now: float = 0.0) -> list[K]:
        """Keys to evict, in order, to free at least ``nbytes``: the front of the order; held keys met there leave it.

        Args:
            nbytes: bytes to free; nothing is returned for ``nbytes <= 0``.
            now: current time on the clock of ``expires_at``; retentions that
                ended by then revert first.

        Returns:
            Lowest priority first, least recently used first within a priority.
            Fewer bytes than asked for only when the rest is held.
        """
        if nbytes <= 0:
            return []
        self.expire(now)
        chosen: list[K] = []
        freed = 0
        held = self._held
        for run in self._runs():
            if not run:
                continue
            # the common case in C loops: as many least recent keys as the first one's size says are needed,
            # none of them held
            guess = list(islice(run, -(-(nbytes - freed) // max(1, next(iter(run.values()))))))
            if not (held and True in map(held.__contains__, guess)):
                totals = list(accumulate(map(run.__getitem__, guess), initial=freed))
                if totals[-1] >= nbytes:
                    cut = bisect_left(totals, nbytes, 1)
                    chosen += guess[:cut]
                    return chosen
                chosen += guess
                freed = totals[-1]
                rest: Iterator[tuple[K, int]] = islice(run.items(), len(guess), None)
            else:
                rest = iter(run.items())
            met: list[K] = []
            for key, size in rest:
                if key in held:
                    met.append(key)
                    continue
                chosen.append(key)
                freed += size
                if freed >= nbytes:
                    break
            for key in met:  # out of the order until touched or released: no later call meets them again
                self._out[key] = self._take(key)
            if freed >= nbytes:
                return chosen
        return chosen


class LRUPolicy(PriorityLRUPolicy[K]):
    """Plain LRU: every block at one priority, whatever the caller asked for (a baseline for tests and
    comparisons; the simulator's ``lru`` is :class:`PriorityLRUPolicy`, as the node's)."""

    __slots__ = ()

    def insert(self, key: K, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None:
        """Track ``key`` as the most recently used block; priority and retention are ignored."""
        super().insert(key, nbytes, self.default_priority, 0.0)
