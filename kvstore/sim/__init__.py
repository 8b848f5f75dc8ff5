"""Offline simulator: replay prefix-block traces through the node's model and the offline bound, and count hits.

``simulate`` replays a trace (``kvstore.trace``) through ``NodeModel``, which
runs the store's own policies (``kvstore.policy``) in the store's per-request
order over a memory tier and an optional disk tier, or through the offline
bound (``belady_bound``: Belady's MIN with bypass). ``kvstore.sim.cli`` is the
``kvstore simulate`` command; ``kvstore.sim.agentic`` generates synthetic
agentic-coding sessions.
"""

from kvstore.sim.belady import BoundResult, belady_bound, check_chains
from kvstore.sim.model import NodeModel, RequestHits
from kvstore.sim.replay import BOUND, POLICIES, SimResult, resolve, simulate

__all__ = [
    "BOUND",
    "POLICIES",
    "BoundResult",
    "NodeModel",
    "RequestHits",
    "SimResult",
    "belady_bound",
    "check_chains",
    "resolve",
    "simulate",
]
