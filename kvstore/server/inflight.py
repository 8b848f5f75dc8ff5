"""Calls in flight per client connection: a call over ``limits.max_inflight_per_connection`` is refused.

Used from the server's one asyncio loop (the store's owner), so it keeps a
plain dict and needs no lock. Limits on one request (hashes per request, bytes
per block) are checked by the servicer and ``kvstore.wire``.
"""

from __future__ import annotations

from kvstore.errors import ResourceExhaustedError


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
