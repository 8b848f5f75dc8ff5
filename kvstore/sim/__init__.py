"""Offline simulator: replay prefix-block traces through the store itself and the offline bound, and count hits.

``simulate`` replays a trace (``kvstore.trace``) through ``SimNode``, the
store's own ``TieredStore`` (its placement, read path, mover, index and
policies) over metadata-only tiers (``kvstore.tiers.metadata``), a memory tier
and an optional disk tier, or through the offline bound (``belady_bound``:
Belady's MIN with bypass). ``kvstore.sim.cli`` is the ``kvstore simulate``
command; ``kvstore.sim.agentic`` generates synthetic agentic-coding sessions.
"""

from kvstore.sim.belady import BoundResult, belady_bound, check_chains
from kvstore.sim.node import RequestHits, SimNode
from kvstore.sim.replay import BOUND, POLICIES, SimResult, resolve, simulate

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
