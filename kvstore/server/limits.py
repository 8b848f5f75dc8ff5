"""Server-side limits: concurrent calls per client connection, and bytes per tenant (a quota).

Both are used from the server's one asyncio loop (the store's owner), so they
keep plain dicts and need no locks. Limits on one request (hashes per request,
bytes per block) are checked by the servicer and ``kvstore.server.wire``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

from kvstore.errors import ResourceExhaustedError
from kvstore.keys import Namespace

logger = logging.getLogger(__name__)


class InflightLimiter:
    """Counts the calls in flight per client connection and refuses one over the limit.

    A connection is named by ``context.peer()`` (``ipv4:10.0.0.7:51234``): one
    TCP connection, so one client channel. Several channels of one client
    process each get the limit; a network policy or a proxy bounds connections.

    Args:
        max_per_connection: calls one connection may have in flight at once.

    Raises:
        ValueError: if ``max_per_connection < 1``.
    """

    def __init__(self, max_per_connection: int) -> None:
        if max_per_connection < 1:
            raise ValueError(f"max_per_connection must be >= 1, got {max_per_connection}")
        self.max_per_connection = max_per_connection
        self._inflight: dict[str, int] = {}

    def acquire(self, peer: str) -> None:
        """Count one more call of ``peer``; pair every successful call with :meth:`release`.

        Raises:
            ResourceExhaustedError: if ``peer`` already has ``max_per_connection`` calls in flight.
        """
        num = self._inflight.get(peer, 0)
        if num >= self.max_per_connection:
            raise ResourceExhaustedError(
                f"{num} calls are in flight on this connection, the limit is "
                f"limits.max_inflight_per_connection={self.max_per_connection}; wait for replies or back off"
            )
        self._inflight[peer] = num + 1

    def release(self, peer: str) -> None:
        """Count one call of ``peer`` as finished."""
        num = self._inflight.get(peer, 0) - 1
        if num > 0:
            self._inflight[peer] = num
        else:
            self._inflight.pop(peer, None)

    def inflight(self, peer: str) -> int:
        """Calls of ``peer`` in flight now."""
        return self._inflight.get(peer, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of the calls in flight per connection (``peer -> calls``), for tests and debugging."""
        return dict(self._inflight)

    @property
    def num_connections(self) -> int:
        """Connections with at least one call in flight."""
        return len(self._inflight)


class TenantQuota:
    """Bytes each tenant (``cache_salt``) may hold in the node's local tiers; a Put over it is refused.

    A tenant's use is the sum of ``namespace_bytes(tag)`` (the store's per-namespace
    byte count, ``TieredStore.namespace_bytes``) over the namespaces it has written
    to on this node, plus the bytes of its Puts still in progress. A Put is
    admitted when ``used + incoming <= quota_bytes``, where ``incoming`` is the
    encoded size of every block in it, already stored or not (so a Put near the
    quota may be refused though it would store nothing new: look up first and
    put only the missing blocks, as connectors do).

    Notes:
        Local bytes are capacity bytes (the memory tier rounds a block up to
        whole pages); blocks demoted to the shared Redis tier no longer count
        (Redis is bounded by its own ``maxmemory``). After a restart, blocks
        restored from LMDB count once their tenant writes to their namespace
        again, because the set of a tenant's namespaces is kept in memory.

    Args:
        quota_bytes: bytes one tenant may hold; must be > 0.
        namespace_bytes: local bytes of one namespace by its tag (``TieredStore.namespace_bytes``).

    Raises:
        ValueError: if ``quota_bytes <= 0``.
    """

    def __init__(self, quota_bytes: int, namespace_bytes: Callable[[bytes], int]) -> None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be > 0, got {quota_bytes}")
        self.quota_bytes = quota_bytes
        self._namespace_bytes = namespace_bytes
        self._tags: dict[str, set[bytes]] = {}
        self._pending_bytes: dict[str, int] = {}

    def used_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds in local tiers now plus those of its Puts in progress.

        Namespaces that hold nothing any more are forgotten on the way.
        """
        tags = self._tags.get(tenant)
        used = 0
        if tags:
            for tag in list(tags):
                num = self._namespace_bytes(tag)
                if num:
                    used += num
                else:
                    tags.discard(tag)
            if not tags:
                del self._tags[tenant]
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
        self._pending_bytes[tenant] = self._pending_bytes.get(tenant, 0) + incoming_bytes
        self._tags.setdefault(tenant, set()).add(namespace.tag)  # forgotten again while it holds nothing
        try:
            yield
        finally:
            left = self._pending_bytes[tenant] - incoming_bytes
            if left:
                self._pending_bytes[tenant] = left
            else:
                del self._pending_bytes[tenant]
