"""Offline eviction-policy simulator: replay prefix-block traces through the store's policies and count hits.

``simulate`` replays a trace (``kvstore.trace``) through ``kvstore.policy``'s
``LRUPolicy`` or ``PriorityLRUPolicy`` (with priorities from
``ChainPriorityAssigner``) or through ``BeladyPolicy``, the offline optimum,
over one tier or a top tier plus a second one. ``kvstore.sim.cli`` is the
``kvstore simulate`` command.
"""

from kvstore.sim.belady import BeladyPolicy, NextUseOracle
from kvstore.sim.priority import ChainPriorityAssigner
from kvstore.sim.replay import POLICIES, PriorityAssigner, SimResult, simulate

__all__ = [
    "POLICIES",
    "BeladyPolicy",
    "ChainPriorityAssigner",
    "NextUseOracle",
    "PriorityAssigner",
    "SimResult",
    "simulate",
]
