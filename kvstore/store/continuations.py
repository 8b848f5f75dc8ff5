"""Continuations: the cached prefix a lookup found, kept for the put of the rest of its chain.

A client asks a node for the longest cached prefix of a request's chain
(lookup), reads it (get), computes the rest and stores it (put). The put names
only the new blocks, so without help the node would place them above the
prefix in recency, and evict the request's head before its tail. A
continuation remembers, under the first block the put will start at, the
prefix the lookup found; the put that starts there pins that prefix while it
makes room, and touches it again once its blocks are in, so the chain ends
ordered tail first (``kvstore.store.tiered``, which the simulator runs: ``kvstore.tools.sim.node``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)

MAX_CONTINUATIONS = 4096
"""Continuations kept at once; the oldest goes first."""

MAX_CONTINUATION_KEYS = 1 << 18
"""Prefix keys kept over all continuations; the oldest continuations go first past it."""


class Continuations(Generic[K]):
    """A bounded map from the block a put will start at to the cached prefix before it, oldest forgotten first."""

    __slots__ = ("_entries", "_num_keys")

    def __init__(self) -> None:
        self._entries: OrderedDict[K, tuple[K, ...]] = OrderedDict()
        self._num_keys = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, chain: Sequence[K], num_cached: int) -> None:
        """Remember ``chain[:num_cached]`` under ``chain[num_cached]`` (a lookup found that prefix cached).

        Nothing is kept when the whole chain or none of it is cached.
        """
        if not 0 < num_cached < len(chain):
            return
        start = chain[num_cached]
        old = self._entries.pop(start, None)
        if old is not None:
            self._num_keys -= len(old)
        self._entries[start] = tuple(chain[:num_cached])
        self._num_keys += num_cached
        while len(self._entries) > MAX_CONTINUATIONS or self._num_keys > MAX_CONTINUATION_KEYS:
            _, dropped = self._entries.popitem(last=False)
            self._num_keys -= len(dropped)

    def pop(self, start: K) -> tuple[K, ...]:
        """The prefix recorded for a put starting at ``start``, forgotten now; ``()`` if none was."""
        prefix = self._entries.pop(start, ())
        self._num_keys -= len(prefix)
        return prefix
