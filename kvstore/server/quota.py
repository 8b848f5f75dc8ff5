"""Bytes each tenant (``cache_salt``) may hold in the node's local tiers: ``limits.tenant_quota_bytes``.

Used from the server's one asyncio loop (the store's owner), so it keeps plain
dicts and needs no locks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from kvstore.config import Config
from kvstore.errors import ResourceExhaustedError
from kvstore.keys import Namespace
from kvstore.server.tenants import TenantTags


class TenantQuota:
    """Bytes each tenant (``cache_salt``) may hold in the node's local tiers; a Put over it is refused.

    A tenant's use is the sum of ``namespace_bytes(tag)`` (the store's per-namespace
    count, ``TieredStore.namespace_bytes``) over the namespaces it has written
    to on this node (:class:`~kvstore.server.tenants.TenantTags`), plus the bytes
    of its Puts still in progress. A Put is admitted when ``used + incoming <=
    quota_bytes``, where ``incoming`` is the encoded size of every block in it,
    already stored or not (so a Put near the quota may be refused though it
    would store nothing new: look up first and put only the missing blocks, as
    connectors do).

    Notes:
        A block counts the same in every local tier, before and after a restart: the most capacity a block
        of its length takes in any of the node's local tiers (``kvstore.store.charges``), whichever tier holds it
        now (the memory tier rounds a block up to whole pages, LMDB to its pages). Blocks demoted to the
        shared Redis tier no longer count (Redis is bounded by its own ``maxmemory``). A namespace tag is a
        hash and names no tenant, so with a disk tier the pairs tenant → tag are kept on disk
        (``kvstore.server.tenants``, ``tenants.json``): blocks restored from LMDB after a restart count
        against their tenant from the start. Without a disk tier nothing survives a restart to count.

    Args:
        quota_bytes: bytes one tenant may hold; must be > 0.
        namespace_bytes: bytes one namespace holds by its tag (``TieredStore.namespace_bytes``).
        tenants: the pairs tenant → namespace tag of this node; a new in-memory one when ``None``.

    Raises:
        ValueError: if ``quota_bytes <= 0``.
    """

    def __init__(self, quota_bytes: int, namespace_bytes: Callable[[bytes], int],
                 tenants: TenantTags | None = None) -> None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be > 0, got {quota_bytes}")
        self.quota_bytes = quota_bytes
        self._namespace_bytes = namespace_bytes
        self._tenants = tenants if tenants is not None else TenantTags()
        self._pending_bytes: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: Config, namespace_bytes: Callable[[bytes], int],
                    tenants: TenantTags | None = None) -> TenantQuota | None:
        """The quota of ``limits.tenant_quota_bytes`` (``None`` when 0), over ``tenants`` (when ``None``, a new
        one, its ledger in ``store.disk.path`` if set)."""
        if config.limits.tenant_quota_bytes <= 0:
            return None
        return cls(config.limits.tenant_quota_bytes, namespace_bytes,
                   tenants if tenants is not None else TenantTags.from_config(config, namespace_bytes))

    @property
    def tenants(self) -> list[str]:
        """Tenants known to hold (or to have held since they were last counted) bytes on this node."""
        return self._tenants.tenants

    def used_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds in local tiers now plus those of its Puts in progress.

        Namespaces that hold nothing any more are forgotten on the way.
        """
        used = 0
        for tag in list(self._tenants.tags_of(tenant)):
            num = self._namespace_bytes(tag)
            if num:
                used += num
            else:
                self._tenants.forget(tenant, tag)
        return used + self._pending_bytes.get(tenant, 0)

    @contextlib.contextmanager
    def reserve(self, namespace: Namespace, incoming_bytes: int) -> Iterator[None]:
        """Admit a Put of ``incoming_bytes`` into ``namespace`` and hold the bytes while it runs.

        Use as ``with quota.reserve(ns, n): await store.put(...)``. ``namespace``
        counts as the tenant's from then on (until it holds nothing).

        Raises:
            ResourceExhaustedError: if the tenant's use plus ``incoming_bytes`` is over the quota.
        """
        tenant = namespace.cache_salt
        used = self.used_bytes(tenant)
        if used + incoming_bytes > self.quota_bytes:
            raise ResourceExhaustedError(
                f"tenant {tenant!r} holds {used} bytes; {incoming_bytes} more is over "
                f"limits.tenant_quota_bytes={self.quota_bytes}"
            )
        with self._tenants.writing(namespace):  # before any block of it is stored, so a crash never loses the pair
            self._pending_bytes[tenant] = self._pending_bytes.get(tenant, 0) + incoming_bytes
            try:
                yield
            finally:
                left = self._pending_bytes[tenant] - incoming_bytes
                if left:
                    self._pending_bytes[tenant] = left
                else:
                    del self._pending_bytes[tenant]
