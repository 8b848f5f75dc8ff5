"""Replay a trace of prefix-block chains through the store's eviction policies and count prefix hits.

The replay model (kept equal to the figures in ``benchmarks/traces/README.md``):

1. Requests are served in file order.
2. A request hits the longest prefix of its blocks that is resident in any
   tier; the first block that is not ends the hit (prefix semantics).
3. Then every block of the request counts as accessed. Room is made first in
   the top tier for the blocks it lacks, with the request's own resident
   blocks pinned (the store holds leases on them). Then the chain is walked
   tail first (``reversed``), as the store records it: resident blocks are
   touched, missing ones inserted, so the head ends up the most recent.
   A block the request found in a lower tier is promoted: removed there and
   inserted in the top tier (``StoreConfig.promote_on_hit``; the tiers are
   exclusive, a block lives in exactly one).
4. Eviction is ``policy.victims(need)`` and then ``remove``, as in the store.
   Victims of the top tier are demoted to the next tier (whose own victims
   are dropped); victims of the last tier are dropped. A demoted block enters
   the second tier as its most recent block at the default priority without
   retention (a raised priority is tuned to the top tier's horizon; kept,
   it lost hits in the second tier in our runs), except that priority 0 stays 0.

Capacity is counted in ``block_bytes`` units per block: 1 for a capacity in
blocks, or the bytes of one block for a capacity in bytes; ``None`` is infinite.

Hit ratio = hit blocks / requested blocks over the whole trace. Token hit ratio
= hit tokens / prompt tokens, where a request's hit tokens are
``min(hit_blocks * block_tokens, input_tokens)``: every hit block counts as full
except the last block of a prompt, which holds only the tokens the prompt has.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from kvstore.errors import InvalidArgumentError
from kvstore.policy import DEFAULT_PRIORITY, MIN_PRIORITY, LRUPolicy, PriorityLRUPolicy
from kvstore.sim.belady import BeladyPolicy, NextUseOracle
from kvstore.sim.priority import ChainPriorityAssigner
from kvstore.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

logger = logging.getLogger(__name__)

POLICIES = ("lru", "priority", "belady")
"""Policy names the simulator knows: the store's two policies and the offline bound."""


class SimPolicy(Protocol):
    """The subset of ``kvstore.policy.EvictionPolicy`` the replay uses, plus ``priority_of``."""

    nbytes: int

    def insert(self, key: int, nbytes: int, priority: int = DEFAULT_PRIORITY, expires_at: float = 0.0) -> None: ...

    def touch(self, key: int) -> None: ...

    def remove(self, key: int) -> int: ...

    def pin(self, key: int) -> None: ...

    def unpin(self, key: int) -> None: ...

    def victims(self, nbytes: int, now: float = 0.0) -> list[int]: ...

    def priority_of(self, key: int) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class PriorityAssigner(Protocol):
    """Online rule that gives each block of a request a retention priority (TensorRT-LLM's 0..100)."""

    def priorities(self, request: TraceRequest, num_hit_blocks: int) -> Sequence[tuple[int, float]]:
        """Priorities of ``request.block_ids``, knowing only this and earlier requests.

        Args:
            request: the request being served.
            num_hit_blocks: length of its hit prefix.

        Returns:
            One ``(priority, retention_s)`` per block, head first: a priority in
            ``[0, 100]`` and the seconds after which it reverts to the default
            (0.0 for never), as ``PriorityLRUPolicy.insert`` takes them.
        """


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one replay measured.

    Attributes:
        policy: policy name (``lru``, ``priority``, ``belady``).
        capacity_blocks: capacity of the top tier in blocks; ``None`` for infinite.
        disk_capacity_blocks: capacity of the second tier in blocks; 0 when there is none.
        num_requests: requests replayed.
        num_blocks: blocks requested, over all requests.
        num_unique_blocks: distinct block ids in the trace.
        hit_blocks: prefix blocks found resident, over all requests.
        hit_blocks_per_tier: of those, how many each tier served, top tier first.
        input_tokens: prompt tokens over all requests.
        hit_tokens: prompt tokens covered by hit blocks (see the module docstring).
        evicted_blocks: blocks dropped from the last tier.
        demoted_blocks: blocks moved from the top tier to the second.
        elapsed_s: wall time of the replay, seconds.
    """

    policy: str
    capacity_blocks: int | None
    disk_capacity_blocks: int
    num_requests: int
    num_blocks: int
    num_unique_blocks: int
    hit_blocks: int
    hit_blocks_per_tier: tuple[int, ...]
    input_tokens: int
    hit_tokens: int
    evicted_blocks: int
    demoted_blocks: int
    elapsed_s: float = field(compare=False)

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks (0.0 for an empty trace)."""
        return self.hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Hit tokens / prompt tokens (0.0 for an empty trace)."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def tier_hit_ratios(self) -> tuple[float, ...]:
        """Each tier's hit blocks / requested blocks, top tier first."""
        return tuple(h / self.num_blocks if self.num_blocks else 0.0 for h in self.hit_blocks_per_tier)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field and ratio."""
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "disk_capacity_blocks": self.disk_capacity_blocks,
            "num_requests": self.num_requests,
            "num_blocks": self.num_blocks,
            "num_unique_blocks": self.num_unique_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_blocks_per_tier": list(self.hit_blocks_per_tier),
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "evicted_blocks": self.evicted_blocks,
            "demoted_blocks": self.demoted_blocks,
            "hit_ratio": self.hit_ratio,
            "token_hit_ratio": self.token_hit_ratio,
            "tier_hit_ratios": list(self.tier_hit_ratios),
            "elapsed_s": self.elapsed_s,
        }


def _make_policy(name: str, oracle: NextUseOracle | None) -> SimPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "priority":
        return PriorityLRUPolicy()
    if name == "belady":
        assert oracle is not None
        return BeladyPolicy(oracle)
    raise InvalidArgumentError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def simulate(
    requests: Sequence[TraceRequest],
    policy: str,
    capacity_blocks: int | None,
    *,
    disk_capacity_blocks: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    assigner_factory: Callable[[], PriorityAssigner] | None = None,
) -> SimResult:
    """Replay ``requests`` through one policy and count prefix hits.

    Args:
        requests: the trace, in replay order.
        policy: ``lru`` (``kvstore.policy.LRUPolicy``), ``priority``
            (``kvstore.policy.PriorityLRUPolicy`` with priorities from
            ``assigner_factory``, by default :class:`ChainPriorityAssigner`) or
            ``belady`` (:class:`BeladyPolicy`, offline MIN).
        capacity_blocks: blocks the top tier holds; ``None`` for infinite.
        disk_capacity_blocks: blocks of a second tier that takes the top tier's
            victims; 0 for none. Ignored when ``capacity_blocks`` is ``None``.
        block_tokens: tokens per block, for the token hit ratio.
        assigner_factory: builds the priority rule of the ``priority`` policy.

    Returns:
        The counts and ratios of the replay.

    Raises:
        InvalidArgumentError: on an unknown policy, a negative capacity or a
            non-positive ``block_tokens``.
    """
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if capacity_blocks is not None and capacity_blocks < 0:
        raise InvalidArgumentError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
    if disk_capacity_blocks < 0:
        raise InvalidArgumentError(f"disk capacity must be >= 0 blocks, got {disk_capacity_blocks}")
    if block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be > 0, got {block_tokens}")
    started = time.perf_counter()
    infinite = capacity_blocks is None
    if infinite:
        disk_capacity_blocks = 0
    oracle = NextUseOracle([r.block_ids for r in requests]) if policy == "belady" and not infinite else None
    ram = _make_policy(policy, oracle)
    disk = _make_policy(policy, oracle) if disk_capacity_blocks > 0 else None
    assigner: PriorityAssigner | None = None
    if policy == "priority" and not infinite:
        assigner = assigner_factory() if assigner_factory else ChainPriorityAssigner(block_tokens=block_tokens)
    ram_cap = capacity_blocks if capacity_blocks is not None else 0

    num_blocks = hit_ram = hit_disk = input_tokens = hit_tokens = evicted = demoted = 0
    seen: set[int] = set()

    def make_room_in_disk(count: int, now: float) -> None:
        nonlocal evicted
        assert disk is not None
        need = disk.nbytes + count - disk_capacity_blocks
        if need > 0:
            for key in disk.victims(need, now):
                disk.remove(key)
                evicted += 1

    def evict_ram(need: int, now: float) -> None:
        nonlocal evicted, demoted
        victims = ram.victims(need, now)
        if disk is None:
            for key in victims:
                ram.remove(key)
            evicted += len(victims)
            return
        moved = [(key, ram.priority_of(key)) for key in victims]
        for key, _ in moved:
            ram.remove(key)
        make_room_in_disk(len(moved), now)
        for key, priority in moved:
            disk.insert(key, 1, DEFAULT_PRIORITY if priority else MIN_PRIORITY)
        demoted += len(moved)

    for index, request in enumerate(requests):
        blocks = request.block_ids
        now = request.timestamp_s
        if oracle is not None:
            oracle.advance(index)
        num_blocks += len(blocks)
        input_tokens += request.input_tokens
        if infinite:
            hits = 0
            for key in blocks:
                if key not in seen:
                    break
                hits += 1
            seen.update(blocks)
            hit_ram += hits
            hit_tokens += min(hits * block_tokens, request.input_tokens)
            continue

        in_ram = in_disk = 0
        for key in blocks:
            if key in ram:
                in_ram += 1
            elif disk is not None and key in disk:
                in_disk += 1
            else:
                break
        hit_ram += in_ram
        hit_disk += in_disk
        hit_tokens += min((in_ram + in_disk) * block_tokens, request.input_tokens)
        priorities = assigner.priorities(request, in_ram + in_disk) if assigner is not None else None

        resident = [key for key in blocks if key in ram]
        if disk is not None:
            for key in blocks:
                disk.remove(key)  # promoted below; 0 when it is not there
        need = ram.nbytes + len(blocks) - len(resident) - ram_cap
        if need > 0:
            for key in resident:
                ram.pin(key)
            evict_ram(need, now)
            for key in resident:
                ram.unpin(key)

        if priorities is None:
            for key in reversed(blocks):
                if key in ram:
                    ram.touch(key)
                else:
                    ram.insert(key, 1)
        else:
            for position in range(len(blocks) - 1, -1, -1):
                key = blocks[position]
                priority, retention_s = priorities[position]
                if key in ram:
                    if not retention_s and ram.priority_of(key) == priority:
                        ram.touch(key)
                        continue
                    ram.remove(key)
                ram.insert(key, 1, priority, now + retention_s if retention_s else 0.0)
        over = ram.nbytes - ram_cap
        if over > 0:  # a chain longer than the room its pins left
            evict_ram(over, now)

    if infinite:
        unique = len(seen)
    else:
        unique = len({key for r in requests for key in r.block_ids})
    result = SimResult(
        policy=policy,
        capacity_blocks=capacity_blocks,
        disk_capacity_blocks=disk_capacity_blocks,
        num_requests=len(requests),
        num_blocks=num_blocks,
        num_unique_blocks=unique,
        hit_blocks=hit_ram + hit_disk,
        hit_blocks_per_tier=(hit_ram, hit_disk) if disk is not None else (hit_ram,),
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        evicted_blocks=evicted,
        demoted_blocks=demoted,
        elapsed_s=time.perf_counter() - started,
    )
    logger.debug("simulated %s at %s blocks: hit ratio %.4f in %.2f s",
                 policy, capacity_blocks, result.hit_ratio, result.elapsed_s)
    return result
