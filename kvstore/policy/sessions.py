"""Sessions: what the requests of agentic sessions tell the eviction policy that single blocks cannot.

A client names the session a request belongs to (``session_id``: vLLM's
``kv_transfer_params``, an SGLang or HF connector argument, ``KVStoreClient``'s
keyword). The ``session`` policy (``kvstore serve --policy session``) uses three
things only sessions show, each measured in ``kvstore simulate`` on agentic
traces (``docs/agentic.md`` has the figures and the ideas that did not work):

* **A dead chain.** A session's next request normally extends its last chain. One
  that does not (compaction: the history was summarised; an edit of an early
  message) left the old chain's tail past the common prefix dead: its blocks go to
  the front of the eviction order, tail first. A subagent forks its parent's
  history (its first chain extends the parent's last chain); when the parent
  makes its next request, its subagents are done (agents wait for their
  subagents), and their chains past the fork go to the front too.
* **Admission that fits the turnover.** A put's new blocks pay only if they are
  still cached when their session comes back. The tracker measures, in lookups
  (a clock of requests, so that the node and the simulator agree whatever the
  pacing), how long the local tiers take to turn over (``T``: the lookups during
  which a capacity's worth of new blocks was placed) and how long sessions take
  to come back (``G``: the median of their gaps). When ``T < G`` a put stores
  only the first ``capacity * T / G`` bytes of its new blocks (its head, which
  the next request hits first); the rest would only push out blocks that do come
  back, such as other agents' shared system prompts.
* **TTLs** are pins (``kvstore.policy.lru``), not part of this module; a session
  idle past its TTL is unpinned, and so the next victim, tail first.

Everything here is per request or per session, never a loop per block in
Python, and the memory is bounded: at most :data:`MAX_SESSIONS` sessions and
:data:`MAX_SESSION_KEYS` chain keys (one reference each), the oldest sessions
forgotten first.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from typing import Callable, Generic, Hashable, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)

MAX_SESSIONS = 65536
"""Sessions tracked at once; the least recently active is forgotten first."""

MAX_SESSION_KEYS = 1 << 21
"""Chain keys kept over all tracked sessions (one reference each, 8 bytes); the least recently active sessions are
forgotten first past it."""

GAP_SAMPLES = 1024
"""Gaps between a session's requests kept for their median (the latest ones)."""

MIN_GAP_SAMPLES = 20
"""Gaps needed before admission is bounded at all."""

TURNOVER_POINTS = 4096
"""Placements remembered to measure the turnover; beyond it older points are merged (the turnover gets coarser)."""


class _Session:
    """One session: its last chain, when it came last (a lookup count), and its forks."""

    __slots__ = ("name", "chain", "last", "parent", "fork", "children")

    def __init__(self, name: str) -> None:
        self.name = name
        self.chain: Sequence[Hashable] = ()
        self.last = 0
        self.parent: _Session | None = None
        self.fork = 0  # blocks of the parent's chain its first chain extends
        self.children: list[_Session] = []


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Blocks two chains of chained ids share from their heads: O(log n), since equal ids at a position mean an
    equal prefix up to it (``kvstore.keys``)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high) // 2
        if a[middle] == b[middle]:
            low = middle + 1
        else:
            high = middle
    return low


class SessionTracker(Generic[K]):
    """The sessions of one node (or of the simulator's model of one): dead chains, gaps and turnover.

    Pure logic, with no clock of its own: time is the count of lookups, given by the caller.

    Args:
        capacity_bytes: the local tiers' capacity, bytes (blocks, in the simulator): what one turnover places.
        cool: called with each dead chain (head first) to move its resident blocks to the front of the eviction
            order, tail first (``Index.cool``).
    """

    def __init__(self, capacity_bytes: int, cool: Callable[[Sequence[K]], None]) -> None:
        self.capacity_bytes = capacity_bytes
        self._cool = cool
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._num_keys = 0
        self._tips: dict[K, _Session] = {}
        self._gaps: deque[int] = deque()
        self._sorted_gaps: list[int] = []
        self._placed = 0  # new bytes placed, ever
        self._points: deque[tuple[int, int]] = deque()  # (lookup count, bytes placed by then)
        self.cooled_chains = 0
        """Dead chains handed to ``cool`` (counted for stats)."""
        self.bounded_puts = 0
        """Puts whose new blocks admission cut short."""

    def __len__(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ requests

    def request(self, session: str, chain: Sequence[K], now: int) -> None:
        """A request of ``session`` for ``chain`` (head first) at lookup number ``now``: cool the chains it shows
        dead, and remember it."""
        if not session or not chain:
            return
        found = self._sessions.pop(session, None)
        if found is None:
            found = _Session(session)
            self._adopt(found, chain)
        else:
            self._gap(now - found.last)
            for child in found.children:  # the parent is back: its subagents are done
                if child.fork < len(child.chain):
                    self._cool_chain(child.chain[child.fork:])
            found.children = []
            old = found.chain
            if old and (len(chain) < len(old) or chain[len(old) - 1] != old[-1]):
                self._cool_chain(old[common_prefix(old, chain):])  # compacted or rewritten: the old tail is dead
        self._remember(found, chain, now)

    def _adopt(self, session: _Session, chain: Sequence[K]) -> None:
        """A new session whose first chain extends another session's last chain is that session's subagent."""
        tips = self._tips
        if not tips:
            return
        found = list(map(tips.__contains__, chain))  # a C loop
        if True not in found:
            return
        position = len(found) - 1 - found[::-1].index(True)
        parent = tips[chain[position]]
        session.parent = parent
        session.fork = position + 1
        parent.children.append(session)

    def _remember(self, session: _Session, chain: Sequence[K], now: int) -> None:
        tips = self._tips
        if session.chain and tips.get(session.chain[-1]) is session:
            del tips[session.chain[-1]]
        self._num_keys += len(chain) - len(session.chain)
        session.chain = chain
        session.last = now
        tips[chain[-1]] = session
        self._sessions[session.name] = session
        while len(self._sessions) > MAX_SESSIONS or self._num_keys > MAX_SESSION_KEYS:
            _, old = self._sessions.popitem(last=False)
            self._num_keys -= len(old.chain)
            if old.chain and tips.get(old.chain[-1]) is old:
                del tips[old.chain[-1]]
            if old.parent is not None and old in old.parent.children:
                old.parent.children.remove(old)
            for child in old.children:
                child.parent = None

    def _cool_chain(self, chain: Sequence[K]) -> None:
        self.cooled_chains += 1
        self._cool(chain)

    def _gap(self, gap: int) -> None:
        gaps, ordered = self._gaps, self._sorted_gaps
        gaps.append(gap)
        bisect.insort(ordered, gap)
        if len(gaps) > GAP_SAMPLES:
            del ordered[bisect.bisect_left(ordered, gaps.popleft())]

    @property
    def median_gap(self) -> int | None:
        """The median of the latest gaps between a session's requests, lookups; ``None`` before
        :data:`MIN_GAP_SAMPLES`."""
        ordered = self._sorted_gaps
        return ordered[(len(ordered) - 1) // 2] if len(ordered) >= MIN_GAP_SAMPLES else None

    # ------------------------------------------------------------------ admission

    def turnover(self, now: int) -> int | None:
        """Lookups since the new blocks placed reached a whole capacity (the local tiers' turnover time); ``None``
        before the first turnover."""
        target = self._placed - self.capacity_bytes
        points = self._points
        if target < 0 or not points or points[0][1] > target:
            return None
        index = bisect.bisect_right(points, target, key=lambda point: point[1]) - 1
        return now - points[index][0]

    def admissible(self, now: int) -> int | None:
        """Bytes of new blocks a put of a session may place now (its head first), ``None`` for no bound: a share
        ``turnover / median gap`` of the capacity when the tiers turn over faster than sessions come back."""
        gap = self.median_gap
        if gap is None or gap <= 0:
            return None
        turnover = self.turnover(now)
        if turnover is None or turnover >= gap:
            return None
        return self.capacity_bytes * turnover // gap

    def placed(self, now: int, nbytes: int) -> None:
        """Count ``nbytes`` of new blocks a put placed at lookup number ``now``."""
        if nbytes <= 0:
            return
        self._placed += nbytes
        points = self._points
        if points and points[-1][0] == now:
            points[-1] = (now, self._placed)
        else:
            points.append((now, self._placed))
        target = self._placed - self.capacity_bytes
        while len(points) > 1 and points[1][1] <= target:  # one point at or before a capacity ago is enough
            points.popleft()
        if len(points) > TURNOVER_POINTS:  # coarser: merge every second point
            kept = list(points)[::2] + ([points[-1]] if len(points) % 2 == 0 else [])
            points.clear()
            points.extend(kept)
