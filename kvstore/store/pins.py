"""The bounds on pinned bytes: TTLs (``docs/agentic.md``) may never fill a tier and starve eviction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.policy import EvictionPolicy


@dataclass(frozen=True, slots=True)
class PinLimits:
    """How many bytes TTLs may pin (``store.pins``).

    Attributes:
        max_tier_fraction: of each local tier's capacity, the most its pinned blocks may take.
        max_bytes: over every local tier, the most pinned bytes; 0 for no bound of its own.
        max_tenant_bytes: the most one tenant's (``cache_salt``'s) blocks may pin over every local tier; 0 for none.
    """

    max_tier_fraction: float = 0.5
    max_bytes: int = 0
    max_tenant_bytes: int = 0


class Pins:
    """Which pins the bounds allow, over one store's local tiers; counts the refused ones.

    A pin refused is a block stored (or kept) without its TTL: refused as a pin, never as a put.

    Args:
        policies: the tiers' eviction policies, fastest first (each keeps its pinned bytes, by namespace tag).
        capacities: each tier's capacity, bytes.
        limits: the bounds.

    Attributes:
        refused: pins refused, by the bound that refused them: ``tier``, ``node`` or ``tenant``.
        tenants: namespace tag -> tenant (``cache_salt``), as puts name them (``Placement.admit``).
    """

    def __init__(self, policies: Sequence[EvictionPolicy[BlockKey]], capacities: Sequence[int],
                 limits: PinLimits) -> None:
        self._policies = policies
        self._capacities = capacities
        self.limits = limits
        self.refused: dict[str, int] = {}
        self.displaced = 0
        """Pins given up for newer ones over a tier's share (each call that did: a count of events)."""
        self.tenants: dict[bytes, str] = {}

    def allow(self, level: int, key: BlockKey, nbytes: int) -> bool:
        """Whether ``nbytes`` more of ``key``'s may be pinned in tier ``level``; a refusal is counted.

        Over the tier's share the least recently used pins of the tier end first (counted as ``displaced``): the
        share holds the most recently used pinned blocks. Over the node's or the tenant's bytes the new pin is
        refused.
        """
        limits, policies = self.limits, self._policies
        bound = ""
        if limits.max_bytes and self.pinned_bytes() + nbytes > limits.max_bytes:
            bound = "node"
        elif limits.max_tenant_bytes and self.tenant_bytes(self.tenants.get(key[:NAMESPACE_TAG_BYTES], "")) \
                + nbytes > limits.max_tenant_bytes:
            bound = "tenant"
        else:
            excess = policies[level].pinned_nbytes + nbytes - int(limits.max_tier_fraction * self._capacities[level])
            if excess > 0:
                freed = policies[level].unpin_oldest(excess)
                self.displaced += freed > 0
                if freed < excess:
                    bound = "tier"
        if bound:
            self.refused[bound] = self.refused.get(bound, 0) + 1
        return not bound

    def pin(self, keys: Sequence[BlockKey], ttl_s: float, level_of: Callable[[BlockKey], int | None]) -> None:
        """Pin the resident ``keys`` (head first) with ``ttl_s``, tail first, each as :meth:`allow` allows; a key
        already pinned takes the new TTL."""
        policies = self._policies
        for key in reversed(keys):
            level = level_of(key)
            if level is None:
                continue
            policy = policies[level]
            if policy.pin_of(key)[0] or self.allow(level, key, policy.size_of(key)):
                policy.pin(key, ttl_s)

    def pinned_bytes(self) -> int:
        """Bytes pinned over every local tier."""
        return sum(policy.pinned_nbytes for policy in self._policies)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes the blocks of one tenant (``cache_salt``) pin over every local tier."""
        tags = [tag for tag, owner in self.tenants.items() if owner == tenant]
        return sum(policy.pinned_nbytes_of(tag) for policy in self._policies for tag in tags)
