"""Replay a trace through the store itself (``kvstore.tools.sim.node``) or the offline bound, and count prefix hits.

Requests are served in file order. Online policies run in :class:`SimNode`,
the store's own ``TieredStore`` over metadata-only tiers, so every touch,
insert and eviction is the store's; ``belady`` is the offline bound
(``kvstore.tools.sim.belady``); a capacity of ``None`` is an infinite cache.

Hit ratio = hit blocks / requested blocks over the whole trace. Token hit ratio
= hit tokens / prompt tokens, where a request's hit tokens are
``min(hit_blocks * block_tokens, input_tokens)``: every hit block counts as full
except the last block of a prompt, which holds only the tokens the prompt has.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvstore.errors import InvalidArgumentError
from kvstore.config import DEFAULT_HISTORY_BLOCKS
from kvstore.policy import DEFAULT_POLICY, POLICY_NAMES
from kvstore.tools.sim.baselines import ARCPolicy, SAEPolicy
from kvstore.tools.sim.belady import belady_bound
from kvstore.tools.sim.node import SimNode
from kvstore.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

logger = logging.getLogger(__name__)

BOUND = "belady"
"""The name of the offline bound (MIN with bypass) among the simulator's policies."""

BASELINES = ("arc", "sae")
"""Online policies the simulator compares with that no node runs (``kvstore.tools.sim.baselines``): memory only."""

POLICIES = (*POLICY_NAMES, *BASELINES, BOUND)
"""Policy names the simulator takes: the node's online policies, the baselines and the offline bound (and
``default``)."""


def resolve(policy: str) -> str:
    """The simulator policy ``policy`` names (``default`` is the node's default).

    Raises:
        InvalidArgumentError: for an unknown name.
    """
    if policy == "default":
        return DEFAULT_POLICY
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; known: default, {', '.join(POLICIES)}")
    return policy


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one replay measured.

    Attributes:
        policy: policy name (``lru``, ``slru``, ``adaptive``, ``belady``, or ``infinite``).
        capacity_blocks: capacity of the memory tier in blocks; ``None`` for infinite.
        disk_capacity_blocks: capacity of the disk tier in blocks; 0 when there is none.
        num_requests: requests replayed.
        num_blocks: blocks requested, over all requests.
        num_unique_blocks: distinct block ids in the trace.
        hit_blocks: prefix blocks found resident, over all requests.
        hit_blocks_per_tier: of those, how many each tier served, memory first (one
            number for the bound, which does not split tiers).
        input_tokens: prompt tokens over all requests.
        hit_tokens: prompt tokens covered by hit blocks (see the module docstring).
        evicted_blocks: blocks dropped from the last tier.
        demoted_blocks: blocks moved from the memory tier to the disk tier.
        elapsed_s: wall time of the replay itself (not of counting distinct blocks), seconds.
        bound_exact: for ``belady``, whether the bound is the exact optimum (the
            trace has the chain property; ``kvstore.tools.sim.belady``); ``None`` otherwise.
        missed_blocks: the missed blocks by cause (``kvstore.store.misses``), as a node names them; empty for the
            bound and an infinite cache.
        cpu_s: CPU time of the replay, seconds (the speed figures' clock: the machine may be shared).
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
    bound_exact: bool | None = None
    missed_blocks: dict[str, int] = field(default_factory=dict, compare=False)
    cpu_s: float = field(default=0.0, compare=False)

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
        """Each tier's hit blocks / requested blocks, memory first."""
        return tuple(h / self.num_blocks if self.num_blocks else 0.0 for h in self.hit_blocks_per_tier)

    @property
    def accesses_per_s(self) -> float:
        """Block accesses replayed per second of wall time."""
        return self.num_blocks / self.elapsed_s if self.elapsed_s > 0 else 0.0

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
            "accesses_per_s": self.accesses_per_s,
            "cpu_s": self.cpu_s,
            "bound_exact": self.bound_exact,
            "missed_blocks": dict(self.missed_blocks),
        }


def apart_by_namespace(requests: Sequence[TraceRequest]) -> Sequence[TraceRequest]:
    """``requests`` with the block ids of each namespace label (:attr:`TraceRequest.namespace`) kept apart: ids of
    a label other than ``""`` are renumbered past every id of the trace, in order of first use, as a node keys
    blocks of different namespaces apart. The trace as it is when it names no namespace."""
    if not any(r.namespace for r in requests):
        return requests
    start = max((max(r.block_ids) for r in requests if r.block_ids), default=0) + 1
    ids: dict[tuple[str, int], int] = {}
    out = []
    for r in requests:
        if r.namespace:
            renamed = tuple(ids.setdefault((r.namespace, key), start + len(ids)) for key in r.block_ids)
            r = dataclasses.replace(r, block_ids=renamed)
        out.append(r)
    return out


def _prefix_hits_infinite(requests: Sequence[TraceRequest]) -> list[int]:
    seen: set[int] = set()
    out = []
    for request in requests:
        hits = 0
        for key in request.block_ids:
            if key not in seen:
                break
            hits += 1
        seen.update(request.block_ids)
        out.append(hits)
    return out


def simulate(
    requests: Sequence[TraceRequest],
    policy: str,
    capacity_blocks: int | None,
    *,
    disk_capacity_blocks: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    history_blocks: int = DEFAULT_HISTORY_BLOCKS,
) -> SimResult:
    """Replay ``requests`` through one policy and count prefix hits.

    Args:
        requests: the trace, in replay order.
        policy: an online policy (``lru``, ``slru``, ``adaptive``, ``default``), run in
            :class:`~kvstore.tools.sim.node.SimNode`, or ``belady``, the offline bound.
        capacity_blocks: blocks the memory tier holds; ``None`` for infinite.
        disk_capacity_blocks: blocks of a disk tier below it; 0 for none. Ignored
            when ``capacity_blocks`` is ``None``. For ``belady`` the two add up.
        block_tokens: tokens per block, for the token hit ratio.
        history_blocks: removals the store remembers to name misses (the node's ``store.miss_history_blocks``).

    Returns:
        The counts and ratios of the replay.

    Raises:
        InvalidArgumentError: on an unknown policy, a negative capacity or a
            non-positive ``block_tokens``.
    """
    name = resolve(policy)
    if capacity_blocks is not None and capacity_blocks < 0:
        raise InvalidArgumentError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
    if disk_capacity_blocks < 0:
        raise InvalidArgumentError(f"disk capacity must be >= 0 blocks, got {disk_capacity_blocks}")
    if block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be > 0, got {block_tokens}")
    if capacity_blocks is None:
        disk_capacity_blocks = 0
    if name in BASELINES and disk_capacity_blocks:
        raise InvalidArgumentError(f"the {name} baseline is simulated over a memory tier only")
    requests = apart_by_namespace(requests)
    chains = [r.block_ids for r in requests]
    evicted = demoted = 0
    exact: bool | None = None
    missed: dict[str, int] = {}
    started = time.perf_counter()
    started_cpu = time.process_time()
    if capacity_blocks is None:
        per_request = _prefix_hits_infinite(requests)
        per_tier: tuple[int, ...] = (sum(per_request),)
    elif name == BOUND:
        bound = belady_bound(chains, capacity_blocks + disk_capacity_blocks)
        per_request = list(bound.hits_per_request)
        per_tier = (bound.hit_blocks,)
        exact = bound.exact
    elif capacity_blocks == 0 and disk_capacity_blocks == 0:
        per_request = [0] * len(requests)
        per_tier = (0,)
    else:
        top = None
        if name in BASELINES:
            top = (ARCPolicy if name == "arc" else SAEPolicy)(capacity_blocks)
        with SimNode("lru" if name in BASELINES else name, capacity_blocks or disk_capacity_blocks,
                     disk_capacity_blocks=disk_capacity_blocks if capacity_blocks else 0,
                     history_blocks=history_blocks, top_policy=top) as node:
            per_hits = node.replay(requests)
            memory = sum(h.memory for h in per_hits)
            disk = sum(h.disk for h in per_hits)
            per_request = [h.memory + h.disk for h in per_hits]
            per_tier = (memory, disk) if len(node.policies) > 1 else (memory,)
            evicted, demoted = node.evicted_blocks, node.demoted_blocks
            missed = dict(node.misses.by_cause)
    elapsed_s = time.perf_counter() - started
    cpu_s = time.process_time() - started_cpu
    hit_blocks = sum(per_tier)
    hit_tokens = sum(min(h * block_tokens, r.input_tokens) for h, r in zip(per_request, requests))
    result = SimResult(
        policy="infinite" if capacity_blocks is None else name,
        capacity_blocks=capacity_blocks,
        disk_capacity_blocks=disk_capacity_blocks,
        num_requests=len(requests),
        num_blocks=sum(map(len, chains)),
        num_unique_blocks=len({key for chain in chains for key in chain}),
        hit_blocks=hit_blocks,
        hit_blocks_per_tier=per_tier,
        input_tokens=sum(r.input_tokens for r in requests),
        hit_tokens=hit_tokens,
        evicted_blocks=evicted,
        demoted_blocks=demoted,
        elapsed_s=elapsed_s,
        bound_exact=exact,
        missed_blocks=missed,
        cpu_s=cpu_s,
    )
    logger.debug("simulated %s at %s blocks: hit ratio %.4f in %.2f s",
                 name, capacity_blocks, result.hit_ratio, result.elapsed_s)
    return result
