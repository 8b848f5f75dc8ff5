"""Bytes held per client connection and per tenant: what the reply and Put budgets share."""

from __future__ import annotations


class ByteBudget:
    """Bytes held now by each client connection (``peer``) and each tenant (``cache_salt``), against a budget each.

    A tenant's key is ``"\\0" + tenant`` in one dict with the peers' (no gRPC peer starts so). Subclasses
    (:class:`~kvstore.server.limits.ReplyBudget`, :class:`~kvstore.server.put_budget.PutBudget`) decide what
    counts and what happens past a budget. Used from the server's loop only: no locks.

    Args:
        per_connection_bytes: bytes one connection may hold; > 0.
        per_tenant_bytes: bytes one tenant may hold, over its connections; > 0.
        what: what is held, for the error (``"reply"``, ``"put"``).

    Raises:
        ValueError: if a budget is not > 0.
    """

    def __init__(self, per_connection_bytes: int, per_tenant_bytes: int, what: str) -> None:
        if per_connection_bytes <= 0 or per_tenant_bytes <= 0:
            raise ValueError(f"{what} budgets must be > 0, got {per_connection_bytes} and {per_tenant_bytes}")
        self.per_connection_bytes = per_connection_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self._held: dict[str, int] = {}  # peer, or "\0" + tenant -> bytes held

    def held_bytes(self, peer: str | None = None, tenant: str | None = None) -> int:
        """Bytes held now by ``peer``, or by ``tenant``; by every connection when both are ``None``."""
        if peer is not None:
            return self._held.get(peer, 0)
        if tenant is not None:
            return self._held.get("\0" + tenant, 0)
        return sum(n for key, n in list(self._held.items()) if not key.startswith("\0"))

    def charge(self, peer: str, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, when negative) against ``peer`` and ``tenant``; a key at 0 is dropped."""
        held = self._held
        for key in (peer, "\0" + tenant):
            left = held.get(key, 0) + nbytes
            if left > 0:
                held[key] = left
            else:
                held.pop(key, None)
