"""Compare a load test with ``kvstore simulate`` on the same requests: the hit ratios should agree.

The simulator replays the trace in file order through the node's replay model
(``kvstore.sim.model``) with the node's policy, at capacities counted in blocks.
A load test with one closed-loop worker replays the same order against a node
whose memory tier holds ``capacity_blocks`` blocks (its capacity divided by the
tier's footprint of one encoded block) and whose disk tier, if any, holds
``disk_capacity_blocks``, so the two count the same hits (exactly for memory
alone: ``tests/sim/test_node_agreement.py``). Concurrent workers or the open
loop interleave requests, and the ratios can then differ a little.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore.loadtest.runner import LoadTestResult
from kvstore.sim import simulate
from kvstore.trace import TraceRequest


def compare_with_simulator(
    requests: Sequence[TraceRequest],
    result: LoadTestResult,
    capacity_blocks: int | None,
    *,
    policy: str = "default",
    disk_capacity_blocks: int = 0,
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

    Returns:
        ``{"policy", "capacity_blocks", "num_requests", "sim_hit_ratio",
        "sim_token_hit_ratio", "loadtest_hit_ratio", "hit_ratio_diff",
        "hit_ratio_ratio", "sim_hit_blocks", "loadtest_hit_blocks"}``; the diff
        is load test minus simulator, the ratio load test over simulator
        (``None`` when the simulator's is 0).

    Raises:
        InvalidArgumentError: from :func:`kvstore.sim.simulate` on a bad policy or capacity.
    """
    replayed = list(requests[: result.num_issued])
    sim = simulate(replayed, policy, capacity_blocks, disk_capacity_blocks=disk_capacity_blocks,
                   block_tokens=result.namespace.block_size)
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
    }
