"""Offline simulator: replay prefix-block traces through the store itself and the offline bound, and count hits.

``simulate`` replays a trace (``kvstore.tools.trace``) through ``SimNode``, the
store's own ``TieredStore`` (its placement, read path, mover, index and
policies) over metadata-only tiers (``kvstore.tiers.metadata``), a memory tier
and an optional disk tier, or through the offline bound (``belady_bound``:
Belady's MIN with bypass). ``kvstore.tools.sim.cli`` is the ``kvstore simulate``
command; ``kvstore.tools.sim.agentic`` generates synthetic agentic-coding sessions.
"""

from kvstore.tools.sim.belady import BoundResult, belady_bound, check_chains
from kvstore.tools.sim.node import RequestHits, SimNode
from kvstore.tools.sim.replay import BOUND, POLICIES, SimResult, resolve, simulate

__all__ = [
    "BOUND",
    "POLICIES",
    "BoundResult",
    "RequestHits",
    "SimNode",
    "SimResult",
    "belady_bound",
    "check_chains",
    "resolve",
    "simulate",
]
