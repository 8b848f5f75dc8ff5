"""Compare a load test with ``kvstore simulate`` on the same requests: the hit ratios should agree.

The simulator replays the trace in file order through the store itself over
metadata-only tiers (``kvstore.tools.sim.node``) with the node's policy, at capacities counted in blocks.
A load test with one closed-loop worker replays the same order against a node
whose memory tier holds ``capacity_blocks`` blocks (its capacity divided by the
tier's footprint of one encoded block) and whose disk tier, if any, holds
``disk_capacity_blocks``, so the two count the same hits (exactly for memory
alone: ``tests/sim/test_node_agreement.py``). Concurrent workers or the open
loop interleave requests, and the ratios can then differ a little.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore.errors import InvalidArgumentError
from kvstore.tools.loadtest.runner import LoadTestResult
from kvstore.config import DEFAULT_HISTORY_BLOCKS
from kvstore.tools.sim import simulate
from kvstore.tools.trace import TraceRequest


def compare_with_simulator(
    requests: Sequence[TraceRequest],
    result: LoadTestResult,
    capacity_blocks: int | None,
    *,
    policy: str = "default",
    disk_capacity_blocks: int = 0,
    history_blocks: int = DEFAULT_HISTORY_BLOCKS,
) -> dict[str, Any]:
    """Simulate the requests the load test started and set the two hit ratios side by side.

    Args:
        requests: the trace the load test replayed, in file order; its first
            ``result.num_issued`` requests are simulated.
        result: the load test's result.
        capacity_blocks: blocks the node's top tier holds; ``None`` for infinite.
        policy: simulator policy: the node's ``store.policy`` (``default`` unless set).
        disk_capacity_blocks: blocks of the node's disk tier (its capacity over one block's
            footprint); 0 for none. Without it a disk-backed node is compared with a
            memory-only simulation.
        history_blocks: removals the simulation remembers to name misses (the node's
            ``store.miss_history_blocks``).

    Returns:
        ``{"policy", "capacity_blocks", "num_requests", "sim_hit_ratio",
        "sim_token_hit_ratio", "loadtest_hit_ratio", "hit_ratio_diff",
        "hit_ratio_ratio", "sim_hit_blocks", "loadtest_hit_blocks", "sim_missed_blocks",
        "loadtest_missed_blocks", "causes_agree"}``; the diff is load test minus simulator, the ratio load test
        over simulator (``None`` when the simulator's is 0); the missed blocks by cause of each (the node's from
        its stats), and whether they are the same cause by cause.

    Raises:
        InvalidArgumentError: from :func:`kvstore.tools.sim.simulate` on a bad policy or capacity.
    """
    replayed = list(requests[: result.num_issued])
    sim = simulate(replayed, policy, capacity_blocks, disk_capacity_blocks=disk_capacity_blocks,
                   block_tokens=result.namespace.block_size, history_blocks=history_blocks)
    node_causes = {cause: count for cause, count in result.missed_blocks.items() if count}
    sim_causes = {cause: count for cause, count in sim.missed_blocks.items() if count}
    return {
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "disk_capacity_blocks": disk_capacity_blocks,
        "num_requests": len(replayed),
        "sim_hit_ratio": sim.hit_ratio,
        "sim_token_hit_ratio": sim.token_hit_ratio,
        "sim_hit_blocks": sim.hit_blocks,
        "loadtest_hit_ratio": result.hit_ratio,
        "loadtest_hit_blocks": result.hit_blocks,
        "hit_ratio_diff": result.hit_ratio - sim.hit_ratio,
        "hit_ratio_ratio": result.hit_ratio / sim.hit_ratio if sim.hit_ratio else None,
        "sim_missed_blocks": dict(sim.missed_blocks),
        "loadtest_missed_blocks": dict(result.missed_blocks),
        "causes_agree": bool(result.missed_blocks) and node_causes == sim_causes,
    }


def node_capacity_blocks(server_stats: dict[str, Any] | None) -> tuple[int, int, str]:
    """The blocks of the load test that the node's memory tier and disk tier hold, from its stats after the run.

    A tier's ``capacity_bytes`` is counted in its own footprint of a block, and the load
    test's blocks are all of one size, so one block's footprint is the tier's ``bytes /
    blocks`` and its capacity in blocks ``capacity_bytes // footprint``: what
    ``--sim-capacity`` (and ``--sim-disk-capacity``) should be. Exact for a node that
    holds only the load test's blocks.

    Args:
        server_stats: ``LoadTestResult.server_stats`` (``kvstore stats`` as a dict).

    Returns:
        ``(memory blocks, disk blocks or 0, a line saying how)``.

    Raises:
        InvalidArgumentError: if the stats could not be read, or the memory tier holds no block to measure.
    """
    tiers = [t for t in (server_stats or {}).get("tiers", ()) if t.get("capacity_bytes", 0) > 0]
    if not tiers:
        raise InvalidArgumentError("--sim-capacity node: the node's stats name no tier with a capacity")
    counts, parts = [], []
    for tier in tiers[:2]:  # the memory tier, then a disk tier below it
        if tier["blocks"] <= 0:
            if counts:
                break  # an empty disk tier: nothing was demoted, so the simulation needs none
            raise InvalidArgumentError(f"--sim-capacity node: the {tier['name']} tier holds no block to measure")
        footprint = tier["bytes"] / tier["blocks"]
        counts.append(int(tier["capacity_bytes"] // footprint))
        parts.append(f"{tier['name']} {tier['capacity_bytes']:,} B / {footprint:,.0f} B a block = {counts[-1]:,}")
    return counts[0], (counts[1] if len(counts) > 1 else 0), "the node's " + ", ".join(parts)
