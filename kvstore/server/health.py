"""The node's ``grpc.health.v1`` service: the server's status, and one status per tier that can be down (Redis).

Besides the whole server (``""``) and ``kvstore.v1.KVStore``, a node answers
``Check`` for:

* ``kvstore.tier.<name>`` (e.g. ``kvstore.tier.redis``): ``SERVING`` while that
  tier is up, ``NOT_SERVING`` while it is down (``TierStats.state``);
* ``kvstore.tiers``: ``NOT_SERVING`` while any such tier is down.

A node whose shared tier is down still serves from its local tiers, so the
server's own status stays ``SERVING``; these services let a probe or an
operator see the degraded tier without a token (health needs none), which
``kvstore health`` does. They are computed from the store's stats when asked
(the store owns the state; nothing polls), so ``Watch`` of them reports only
the values some ``Check`` has computed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from grpc_health.v1 import health, health_pb2

TIER_SERVICE_PREFIX = "kvstore.tier."
"""Health service of one tier: this prefix and the tier's name."""

TIERS_SERVICE = "kvstore.tiers"
"""Health service that is ``NOT_SERVING`` while any tier that can be down is down."""

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class NodeHealth(health.aio.HealthServicer):
    """``grpc.health.v1`` with the per-tier services above.

    Attributes:
        tier_states: returns ``{tier name: "up" | "down"}`` for the tiers that have a
            state (``kvstore.api.TierStats.state``); set once the store is open, ``None`` before.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tier_states: Callable[[], Mapping[str, str]] | None = None

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        """The status of ``request.service``, the tier services brought up to date first."""
        if self.tier_states is not None and request.service.startswith((TIER_SERVICE_PREFIX, TIERS_SERVICE)):
            states = self.tier_states()
            for name, state in states.items():
                await self.set(TIER_SERVICE_PREFIX + name, _SERVING if state == "up" else _NOT_SERVING)
            await self.set(TIERS_SERVICE, _SERVING if all(s == "up" for s in states.values()) else _NOT_SERVING)
        response: health_pb2.HealthCheckResponse = await super().Check(request, context)
        return response
