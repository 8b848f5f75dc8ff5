"""The offline bound: Belady's MIN with bypass, over whole requests, with ties broken by chain depth.

MIN keeps, after each request, the blocks whose next use comes soonest; the
blocks of the request just served are candidates too, so a block that is not
needed again before every resident one is not admitted (bypass). Belady, "A
study of replacement algorithms for a virtual-storage computer", IBM Systems
Journal 5(2), 1966; with bypass it is optimal for unit-size blocks among all
policies, online or not, that may keep any subset of what was resident or
just requested (the offline caching problem; see e.g. Jain and Lin, "Back to
the future: leveraging Belady's algorithm for improved cache replacement",
ISCA 2016, for MIN as the bound of replacement studies).

The model. Between two requests the cache holds at most ``capacity`` blocks.
Request ``r`` hits the longest prefix of its blocks held before it; after it,
the cache keeps any ``capacity`` blocks of those it held and those ``r`` named.
Time is the request index; a block's next use is the next request that names
it (``NEVER`` if none).

Ties. Blocks whose next use is the same request are all in that request's
chain; the deeper one (larger position) goes first. Blocks never used again go
first of all, deepest first, then the larger id. So the order is total and
the same in every run and process.

Prefix chains, and why the bound is exact. A hit counts only if every earlier
block of the request hits too. MIN maximizes block hits, which bound prefix
hits from above. When the trace has the chain property (each block id always
appears at one position, after one parent id: true of chained hashes, and
checked by :func:`check_chains`), a block's parent is named by every request
that names the block, so the parent's next use is never later than the
child's, and the depth tie-break evicts the child first: the cache stays
closed under prefixes, every block hit is a prefix hit, and MIN's block hits
are reached by a prefix-caching policy. The bound is then exact, the optimum
of the model. On a trace without the chain property it is an upper bound.

Two tiers. Hits in either tier count the same, so the bound for memory plus
disk is this bound at their summed capacity.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

NEVER = 1 << 62
"""The next use of a block no later request names."""


def check_chains(chains: Sequence[Sequence[int]]) -> bool:
    """Whether every block id appears at one position only, always after the same parent id (the chain property)."""
    parent_of: dict[int, tuple[int, int]] = {}
    for chain in chains:
        parent = -1
        for position, key in enumerate(chain):
            seen = parent_of.setdefault(key, (position, parent))
            if seen != (position, parent):
                return False
            parent = key
    return True


@dataclass(frozen=True, slots=True)
class BoundResult:
    """The bound's counts.

    Attributes:
        hit_blocks: prefix hits of MIN with bypass, over all requests.
        block_hits: block hits (each block resident when named), an upper bound of ``hit_blocks``.
        exact: whether the trace has the chain property, so that ``hit_blocks`` is the optimum.
        hits_per_request: prefix hits of each request, in replay order.
    """

    hit_blocks: int
    block_hits: int
    exact: bool
    hits_per_request: tuple[int, ...] = ()


def belady_bound(chains: Sequence[Sequence[int]], capacity_blocks: int) -> BoundResult:
    """Replay ``chains`` through MIN with bypass at ``capacity_blocks`` and count hits; see the module docstring.

    Args:
        chains: block ids of each request, head first, in replay order; shape ``(num_requests, num_blocks_i)``.
        capacity_blocks: blocks the cache holds between requests (>= 0).

    Returns:
        Prefix hits, block hits, and whether the bound is exact for this trace.

    Raises:
        ValueError: on a negative capacity.

    Time ``O(B log C)`` for ``B`` block accesses, memory ``O(distinct blocks)``.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
    next_use: list[list[int]] = [[]] * len(chains)
    last: dict[int, int] = {}
    for index in range(len(chains) - 1, -1, -1):
        chain = chains[index]
        next_use[index] = [last.get(key, NEVER) for key in chain]
        for key in chain:
            last[key] = index
    resident: dict[int, int] = {}  # key -> next use of its live heap entry
    heap: list[tuple[int, int, int]] = []  # (-next use, -position, -key): the farthest first
    hits = block_hits = 0
    per_request = []
    for index, chain in enumerate(chains):
        prefix = True
        request_hits = 0
        for key in chain:
            if key in resident:
                block_hits += 1
                if prefix:
                    request_hits += 1
            else:
                prefix = False
        hits += request_hits
        per_request.append(request_hits)
        for position, (key, use) in enumerate(zip(chain, next_use[index])):
            resident[key] = use
            heapq.heappush(heap, (-use, -position, -key))
        while len(resident) > capacity_blocks:
            use, _, key = heapq.heappop(heap)
            if resident.get(-key) == -use:
                del resident[-key]
        if len(heap) > 4 * len(resident) + 1024:  # drop stale entries now and then: memory stays O(C)
            heap = [(u, p, k) for u, p, k in heap if resident.get(-k) == -u]
            heapq.heapify(heap)
    return BoundResult(hits, block_hits, check_chains(chains), tuple(per_request))
