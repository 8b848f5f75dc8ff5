"""Bytes held per client connection and per tenant: what the reply and Put budgets share."""

from __future__ import annotations

import bisect


class ByteBudget:
    """Bytes held now by each client connection (``peer``) and each tenant (``cache_salt``), against a budget each.

    A tenant's key is ``"\\0" + tenant`` in one dict with the peers' (no gRPC peer starts so). Subclasses
    (:class:`~kvstore.server.limits.ReplyBudget`, :class:`~kvstore.server.put_budget.PutBudget`) decide what
    counts and what happens past a budget. Used from the server's loop only: no locks.

    Args:
        per_connection_bytes: bytes one connection may hold; > 0.
        per_tenant_bytes: bytes one tenant may hold, over its connections; > 0.
        what: what is held, for the error (``"reply"``, ``"put"``).

    Attributes:
        num_waited: calls that had to wait for room, since start.
        waits: how long they waited (:class:`WaitTimes`), and how many gave up.

    Raises:
        ValueError: if a budget is not > 0.
    """

    def __init__(self, per_connection_bytes: int, per_tenant_bytes: int, what: str) -> None:
        if per_connection_bytes <= 0 or per_tenant_bytes <= 0:
            raise ValueError(f"{what} budgets must be > 0, got {per_connection_bytes} and {per_tenant_bytes}")
        self.per_connection_bytes = per_connection_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self._held: dict[str, int] = {}  # peer, or "\0" + tenant -> bytes held
        self.num_waited = 0  # calls (Gets; a Put's blocks) that had to wait, since start
        self.waits = WaitTimes()  # how long they waited, and how many gave up waiting

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


WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets of the time calls waited for a budget, seconds (up to ``limits.max_stream_s``'s default)."""


class WaitTimes:
    """How long calls waited for their turn under a budget (:class:`~kvstore.server.limits.ReplyBudget`'s Gets,
    :class:`~kvstore.server.put_budget.PutBudget`'s Put blocks): a histogram, and counts by outcome.

    Counted on the server's loop; read by a scrape in another thread (copies of
    lists and ints, atomic under the GIL), as ``kvstore.server.metrics.CallStats``.

    Attributes:
        buckets: upper bounds of the buckets, seconds (``+Inf`` follows).
        counts: waits per bucket, the last one ``+Inf`` (Prometheus' ``le``: wait <= bound).
        sum_s: the waits' total, seconds.
        admitted: waits that ended in the call's turn.
        abandoned: waits that ended before it (the call's deadline, ``max_stream_s``, the client gone).
    """

    def __init__(self, buckets: tuple[float, ...] = WAIT_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum_s = 0.0
        self.admitted = 0
        self.abandoned = 0

    def observe(self, waited_s: float, *, admitted: bool) -> None:
        """Count one wait of ``waited_s`` seconds, which ended in the call's turn (``admitted``) or before it."""
        self.counts[bisect.bisect_left(self.buckets, waited_s)] += 1
        self.sum_s += waited_s
        if admitted:
            self.admitted += 1
        else:
            self.abandoned += 1
