"""Eviction policies: pure ordering state that answers "which blocks, for N bytes?".

A policy never touches a tier. The index asks it for victims, holds them while
the mover demotes or drops them, then removes them (see ``kvstore.store.index``). The
same code drives the offline simulator (``kvstore.tools.sim``).

Semantics follow TensorRT-LLM's KV-cache retention config
(``tensorrt_llm.llmapi.KvCacheRetentionConfig``): a priority in ``[0, 100]``
(default 35) and an optional retention duration after which the priority
reverts to the default. Victims are taken lowest priority first and least
recently used first within a priority.

Held blocks are never victims. The policy keeps no reference count: the index
counts a block's references (``Index.hold``), holds the key here on the first
and releases it on the last. A held key leaves the eviction order when taking
victims reaches it at the front, so that it is passed over once per hold, never
scanned again (as a referenced block leaves vLLM's free queue,
``vllm/v1/core/block_pool.py``). A touch puts it back at the most recent end,
where a touch puts any key; released untouched, it goes back to the front it
was taken from. So the order is the one the policy would keep if held keys
stayed in place and were skipped.

Tail before head: callers record the blocks of a prefix chain from its tail
to its head (``reversed(keys)``), as vLLM frees blocks in reverse order
(``vllm/v1/core/block_pool.py``), so within one priority the head is the more
recent and the tail is evicted first.
"""

from __future__ import annotations

from typing import Callable, Hashable

from kvstore.policy.base import DEFAULT_PRIORITY, MAX_PRIORITY, MAX_TTL_S, MIN_PRIORITY, PIN_LEVEL, EvictionPolicy, \
    K, check_priority, check_ttl
from kvstore.policy.lru import LRUPolicy, PriorityLRUPolicy
from kvstore.policy.segmented import PROTECTED_FRACTION, SCORE_HALF_LIFE_TURNOVERS, SWITCH_MARGIN, AdaptivePolicy, \
    SegmentedLRUPolicy, SessionPolicy

__all__ = ["DEFAULT_POLICY", "DEFAULT_PRIORITY", "MAX_PRIORITY", "MAX_TTL_S", "MIN_PRIORITY", "PIN_LEVEL",
           "POLICY_NAMES", "PROTECTED_FRACTION", "SCORE_HALF_LIFE_TURNOVERS", "SWITCH_MARGIN", "AdaptivePolicy",
           "EvictionPolicy", "LRUPolicy", "PriorityLRUPolicy", "SegmentedLRUPolicy", "SessionPolicy", "check_priority", "check_ttl",
           "make_policy", "resolve_policy_name"]

DEFAULT_POLICY = "adaptive"
"""The policy a node runs when its config names none, and what ``default`` means."""

POLICY_NAMES = ("lru", "slru", "adaptive", "session")
"""Names of the online policies, as ``kvstore serve --policy`` and ``kvstore simulate --policy`` take them."""


def resolve_policy_name(name: str) -> str:
    """The policy ``name`` stands for: itself, or :data:`DEFAULT_POLICY` for ``default``.

    Raises:
        ValueError: for a name that is not ``default`` or in :data:`POLICY_NAMES`.
    """
    if name == "default":
        return DEFAULT_POLICY
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; known: default, {', '.join(POLICY_NAMES)}")
    return name


def make_policy(name: str, *, default_priority: int = DEFAULT_PRIORITY, capacity_bytes: int = 0,
                demotes: bool = False, clock: Callable[[], float] | None = None,
                pin_group: Callable[[K], Hashable] | None = None) -> PriorityLRUPolicy[K]:
    """A new, empty eviction policy for one tier.

    Args:
        name: ``lru`` (:class:`PriorityLRUPolicy`), ``slru`` (:class:`SegmentedLRUPolicy`),
            ``adaptive`` (:class:`AdaptivePolicy`), ``session`` (:class:`SessionPolicy`, with the store's
            :class:`~kvstore.policy.sessions.SessionTracker`) or ``default`` (:data:`DEFAULT_POLICY`).
        default_priority: priority of blocks inserted without one, and after retention ends.
        capacity_bytes: the tier's capacity, bytes (the segmented policies size their segments by it).
        demotes: whether the tier's victims are demoted into a local tier below it. The adaptive
            policy then keeps LRU order in this tier: its victims are not lost, and the choice that
            matters is made in the last tier, where they are. (Adapting the memory tier above a disk
            tier cost up to 1.8 % of all hits in our runs, ``docs/simulate.md``.)

    Raises:
        ValueError: for an unknown name or a bad priority.
    """
    name = resolve_policy_name(name)
    if name == "lru" or (name == "adaptive" and demotes):
        return PriorityLRUPolicy(default_priority, clock=clock, pin_group=pin_group)
    if name == "slru":
        return SegmentedLRUPolicy(default_priority, capacity_bytes, clock=clock, pin_group=pin_group)
    if name == "session":
        return SessionPolicy(default_priority, 0 if demotes else capacity_bytes, clock=clock, pin_group=pin_group)
    return AdaptivePolicy(default_priority, capacity_bytes, clock=clock, pin_group=pin_group)
