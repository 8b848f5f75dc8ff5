"""Which kvstore node owns a block (rendezvous hashing) and which nodes are up (membership with backoff).

Pure logic, no I/O: :class:`KVStoreClient` and :class:`AsyncKVStoreClient`
(``kvstore/client/``) use it to spread blocks over several nodes.

Rendezvous, or highest-random-weight, hashing (D. G. Thaler and C. V.
Ravishankar, "Using Name-Based Mappings to Increase Hit Rates", IEEE/ACM
Transactions on Networking 6(1), 1998): every node gets a pseudo-random
weight for every block, and the block belongs to the node of highest weight::

    seed(n)    = XXH3_64(utf8(node_id(n)))                      (seed 0)
    weight(n, h) = XXH3_64(h, seed = seed(n))                   (h: the block hash bytes)
    owner(h)   = argmax over nodes n of weight(n, h); a tie goes to the smallest node id

``XXH3_64`` is xxHash's 64-bit XXH3 (``XXH3_64bits_withSeed``; the Python
``xxhash.xxh3_64_intdigest``), read as an unsigned integer. A node id is the
target string the client was given (``host:port``), so every client must name a
node the same way to agree on owners. The namespace needs no part in the
formula: a block hash already commits to its namespace (``kvstore.keys``).

Because each block's owner depends only on its own weights, adding a node
moves exactly the blocks the new node wins (about ``1/(N+1)`` of them) and
removing one moves only that node's blocks (``tests/test_routing.py``).

Membership: a node that fails (a call cannot reach it) is marked down for a
backoff that doubles with each consecutive failure up to a cap; once the
backoff has passed it is due for a health probe, and a successful probe (or
call) marks it up again. While a node is down its blocks are misses and puts
to it are skipped; its blocks are *not* re-routed to other nodes, so a node
that flaps does not move keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import numpy as np
import xxhash

from kvstore.api import LookupResult
from kvstore.errors import InvalidArgumentError

_T = TypeVar("_T")

DEFAULT_DOWN_BACKOFF_S = 0.5
"""How long a node stays down after its first failure before it is probed, seconds."""
DEFAULT_MAX_DOWN_BACKOFF_S = 8.0
"""The longest a down node waits between probes, seconds."""


def node_seed(node_id: str) -> int:
    """``XXH3_64(utf8(node_id))``: the seed of a node's weights (see the module docstring)."""
    return xxhash.xxh3_64_intdigest(node_id.encode("utf-8"))


def node_weight(node_id: str, block_hash: bytes) -> int:
    """The rendezvous weight of ``block_hash`` on ``node_id``: ``XXH3_64(block_hash, seed=node_seed(node_id))``.

    Returns:
        An unsigned 64-bit integer.
    """
    return xxhash.xxh3_64_intdigest(block_hash, node_seed(node_id))


@dataclass(frozen=True, slots=True)
class Partition:
    """A list of block hashes split by owner, and the merging of the owners' answers back into one prefix.

    Attributes:
        owners: owner node index of each block, ``len == num_blocks``.
        positions: for each node, the (ascending) positions of the blocks it owns;
            node ``j`` is asked for ``[block_hashes[i] for i in positions[j]]``, its sub-list.
    """

    owners: tuple[int, ...]
    positions: tuple[tuple[int, ...], ...]

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole list."""
        return len(self.owners)

    def nodes_with_blocks(self) -> list[int]:
        """Indices of the nodes that own at least one block, ascending."""
        return [j for j, owned in enumerate(self.positions) if owned]

    def sub_list(self, node: int, items: Sequence[_T]) -> list[_T]:
        """The items (hashes or blocks, ``len == num_blocks``) that ``node`` owns, in order."""
        return [items[i] for i in self.positions[node]]

    def merge_prefix(self, node_prefix: Sequence[int]) -> int:
        """The global cached prefix from each node's prefix of its own sub-list.

        Block ``i`` is a hit iff its position in its owner's sub-list is below
        that owner's prefix; the global prefix ends at the first miss. Node
        ``j``'s first miss is at global position ``positions[j][node_prefix[j]]``,
        so the prefix is the smallest of those.

        Args:
            node_prefix: per node, how many leading blocks of its sub-list it has
                (0 for a node that is down or owns nothing).

        Returns:
            Length of the merged prefix, in blocks.
        """
        prefix = self.num_blocks
        for owned, hit in zip(self.positions, node_prefix):
            if hit < len(owned):
                prefix = min(prefix, owned[max(0, hit)])
        return prefix

    def merge_lookup(self, results: Sequence[LookupResult | None]) -> LookupResult:
        """One :class:`LookupResult` from each node's result over its sub-list (``None``: a miss of all).

        ``tiers[i]`` of the merge is the tier the owner of block ``i`` reported for it.
        """
        prefix = self.merge_prefix([0 if r is None else r.num_blocks for r in results])
        node_tiers = [iter(()) if r is None else iter(r.tiers) for r in results]
        return LookupResult(prefix, tuple(next(node_tiers[node], "") for node in self.owners[:prefix]))

    def merge_blocks(self, per_node: Sequence[Sequence[_T] | None]) -> list[_T]:
        """The blocks of the merged prefix, in order, from each node's blocks of its sub-list (``None``: none).

        Each node's list is a prefix of its sub-list (a get cuts at its first miss).
        """
        prefix = self.merge_prefix([0 if b is None else len(b) for b in per_node])
        node_blocks = [iter(()) if b is None else iter(b) for b in per_node]
        return [next(node_blocks[node]) for node in self.owners[:prefix]]


class RendezvousRouter:
    """The owner of every block among a fixed set of nodes, by rendezvous hashing (see the module docstring).

    Args:
        node_ids: the nodes' ids (target strings), at least one, no duplicates.
            They are kept sorted, so the owner never depends on their order.

    Raises:
        InvalidArgumentError: if ``node_ids`` is empty or has a duplicate or an empty id.
    """

    def __init__(self, node_ids: Sequence[str]) -> None:
        ids = list(node_ids)
        if not ids or any(not node_id for node_id in ids):
            raise InvalidArgumentError("give at least one node id, none empty")
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"duplicate node ids in {ids}")
        self.node_ids: tuple[str, ...] = tuple(sorted(ids))
        self._seeds = [node_seed(node_id) for node_id in self.node_ids]

    @property
    def num_nodes(self) -> int:
        """Nodes routed over."""
        return len(self.node_ids)

    def index(self, node_id: str) -> int:
        """Position of ``node_id`` in :attr:`node_ids`. Raises ``ValueError`` if it is not one of them."""
        return self.node_ids.index(node_id)

    def owner_indices(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Index (into :attr:`node_ids`) of the owner of each block hash, in order."""
        if len(self._seeds) == 1:
            return [0] * len(block_hashes)
        if not block_hashes:
            return []
        digest = xxhash.xxh3_64_intdigest
        weights = np.array([[digest(h, seed) for h in block_hashes] for seed in self._seeds], dtype=np.uint64)
        # argmax picks the first of equal weights: the smallest node id, as node_ids is sorted
        owners: list[int] = weights.argmax(axis=0).tolist()
        return owners

    def owner(self, block_hash: bytes) -> str:
        """The id of the node that owns ``block_hash``."""
        return self.node_ids[self.owner_indices([block_hash])[0]]

    def split(self, block_hashes: Sequence[bytes]) -> Partition:
        """Split ``block_hashes`` by owner, keeping each node's blocks in order."""
        owners = self.owner_indices(block_hashes)
        positions: list[list[int]] = [[] for _ in self._seeds]
        for i, node in enumerate(owners):
            positions[node].append(i)
        return Partition(tuple(owners), tuple(tuple(p) for p in positions))


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A snapshot of one node's membership state.

    Attributes:
        node_id: the node's id (its target string).
        up: whether calls go to it; a down node's blocks are misses and puts to it are skipped.
        consecutive_failures: failed calls or probes since it was last up.
        next_probe_s: clock time (seconds) from which a down node is due for a probe; 0 when up.
        probing: whether a probe of it is in flight.
    """

    node_id: str
    up: bool
    consecutive_failures: int
    next_probe_s: float
    probing: bool


class Membership:
    """Up/down state of each node, with exponential backoff between probes of a down node.

    Not thread-safe on its own: a client that calls it from several threads holds a lock.

    Args:
        node_ids: the nodes, all up at first.
        clock: seconds of a monotonic clock (``time.monotonic``; inject a fake one in tests).
        base_backoff_s: how long a node is down after its first consecutive failure, seconds.
        max_backoff_s: cap of the backoff, which doubles with each further failure, seconds.

    Raises:
        InvalidArgumentError: on a negative backoff or a cap below the base.
    """

    def __init__(
        self,
        node_ids: Sequence[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        base_backoff_s: float = DEFAULT_DOWN_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_DOWN_BACKOFF_S,
    ) -> None:
        if base_backoff_s < 0 or max_backoff_s < base_backoff_s:
            raise InvalidArgumentError("need 0 <= base_backoff_s <= max_backoff_s")
        self.node_ids = tuple(node_ids)
        self._clock = clock
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._failures = {node_id: 0 for node_id in self.node_ids}
        self._up = {node_id: True for node_id in self.node_ids}
        self._next_probe_s = {node_id: 0.0 for node_id in self.node_ids}
        self._probing: set[str] = set()

    def is_up(self, node_id: str) -> bool:
        """Whether calls should go to ``node_id``. Raises ``KeyError`` for an unknown node."""
        return self._up[node_id]

    def backoff_s(self, consecutive_failures: int) -> float:
        """Seconds a node stays down after ``consecutive_failures`` (>= 1): ``min(max, base * 2^(failures-1))``."""
        doublings = min(max(0, consecutive_failures - 1), 64)  # 2.0 ** 1024 overflows; 2 ** 64 is past any cap
        return min(self.max_backoff_s, self.base_backoff_s * 2.0 ** doublings)

    def record_success(self, node_id: str) -> bool:
        """A call or probe reached ``node_id``: it is up. Returns whether it was down before."""
        was_down = not self._up[node_id]
        self._up[node_id] = True
        self._failures[node_id] = 0
        self._next_probe_s[node_id] = 0.0
        return was_down

    def record_failure(self, node_id: str) -> float:
        """A call or probe could not reach ``node_id``: it is down until its backoff has passed.

        Returns:
            The backoff, seconds.
        """
        self._failures[node_id] += 1
        self._up[node_id] = False
        wait_s = self.backoff_s(self._failures[node_id])
        self._next_probe_s[node_id] = self._clock() + wait_s
        return wait_s

    def due_probes(self) -> list[str]:
        """The down nodes whose backoff has passed and that no probe is checking yet; marks them probing.

        The caller probes each and reports with :meth:`probe_done`.
        """
        now = self._clock()
        due = [
            node_id for node_id in self.node_ids
            if not self._up[node_id] and node_id not in self._probing and self._next_probe_s[node_id] <= now
        ]
        self._probing.update(due)
        return due

    def probe_done(self, node_id: str, ok: bool) -> None:
        """Report a probe started by :meth:`due_probes`: ``ok`` marks the node up, else down for longer."""
        self._probing.discard(node_id)
        if ok:
            self.record_success(node_id)
        else:
            self.record_failure(node_id)

    def status(self) -> tuple[NodeStatus, ...]:
        """A snapshot of every node, in :attr:`node_ids` order."""
        return tuple(
            NodeStatus(node_id, self._up[node_id], self._failures[node_id],
                       0.0 if self._up[node_id] else self._next_probe_s[node_id], node_id in self._probing)
            for node_id in self.node_ids
        )
