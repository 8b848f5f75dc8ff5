"""One Redis tier's link to Redis: its client (rebuilt after a cluster failure), its circuit breaker, and round trips
bounded in time, whose failures are counted and told apart (unreachable, or an error reply from a server that is up).

What :class:`kvstore.tiers.redis.RedisTier` runs every command through; the commands themselves are
:mod:`kvstore.tiers.redis_connection`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, NoReturn, TypeVar

import redis.exceptions as rexc

from kvstore.config import RedisTierConfig
from kvstore.tiers.breaker import BreakerState, CircuitBreaker
from kvstore.tiers.redis_connection import UNREACHABLE_ERRORS, RoundTripFailed

logger = logging.getLogger("kvstore.tiers.redis")  # the tier's log lines, under the tier's logger as before

_T = TypeVar("_T")


class RedisLink:
    """The client, breaker and state of one Redis tier's connection.

    Args:
        cfg: the tier's config (``cluster``, ``breaker_reset_s`` are read here).
        name: the tier's name, for log lines.
        breaker: the tier's circuit breaker.
        counts: the tier's counters, to which the link adds ``errors``, ``timeouts`` and ``breaker_open``.
        make_client: makes a new redis-py client (``kvstore.tiers.redis_connection.make_client``).
        op_bound_s: the bound of one round trip, seconds.

    Attributes:
        client: the redis-py client commands go through now.
        breaker: the circuit breaker.
        state: ``up``, or ``down`` from a failed round trip until one succeeds.
        last_error: the last failure and when it happened (UTC).
    """

    def __init__(self, cfg: RedisTierConfig, name: str, breaker: CircuitBreaker, counts: dict[str, int],
                 make_client: Callable[[], Any], op_bound_s: float) -> None:
        self.cfg = cfg
        self.name = name
        self.breaker = breaker
        self._counts = counts
        self._make_client = make_client
        self.op_bound_s = op_bound_s
        self.client: Any = make_client()
        self._client_stale = False
        self._old_clients: set[asyncio.Task[None]] = set()
        self.state = "up"
        self.last_error = ""

    async def close(self) -> None:
        """Close the client, and wait for the clients replaced before it to close."""
        await self._close_client(self.client)
        if self._old_clients:
            await asyncio.gather(*self._old_clients, return_exceptions=True)

    def admit(self) -> bool:
        """Ask the breaker; count a short-circuited call; swap in a fresh client after a failure."""
        if not self.breaker.allow():
            self._counts["breaker_open"] += 1
            return False
        self.refresh_client()
        return True

    def on_outcome(self, failure: RoundTripFailed | None) -> None:
        """Record a round trip's outcome: ``None`` for a success, else its failure."""
        if failure is None:
            self.on_success()
        else:
            self.on_failure(failure)

    def on_success(self) -> None:
        """Record a round trip that succeeded: the breaker closes, the state is ``up``."""
        if self.breaker.state is not BreakerState.CLOSED:
            logger.info("redis tier %s: Redis answers again; circuit breaker closed", self.name)
        self.breaker.record_success()
        self.state = "up"

    def on_failure(self, failure: RoundTripFailed) -> None:
        """Record a failed round trip: the state is ``down`` with ``last_error``; one that found Redis unreachable
        counts against the breaker, an error reply does not."""
        self.state = "down"
        self.last_error = f"{failure} (at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})"
        if self.cfg.cluster:
            self._client_stale = True  # also after an error reply: a failed initialize() leaves it unusable
        if not failure.unreachable:
            # An error reply: the server is up, so the breaker counts a success.
            self.breaker.record_success()
            return
        was_open = self.breaker.state is BreakerState.OPEN
        self.breaker.record_failure()
        if not was_open and self.breaker.state is BreakerState.OPEN:
            logger.warning(
                "redis tier %s: %s consecutive failures (last: %s); circuit breaker open for %ss",
                self.name, self.breaker.num_consecutive_failures, failure, self.cfg.breaker_reset_s,
            )

    def refresh_client(self) -> None:
        """Replace a cluster client that failed: its slot map and node connections may be stale."""
        if not self._client_stale:
            return
        self._client_stale = False
        old, self.client = self.client, self._make_client()
        task = asyncio.ensure_future(self._close_client(old))
        self._old_clients.add(task)
        task.add_done_callback(self._old_clients.discard)

    async def _close_client(self, client: Any) -> None:
        try:
            await asyncio.wait_for(client.aclose(), self.op_bound_s)
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            logger.debug("redis tier %s: closing a client: %s", self.name, exc)

    async def round_trip(self, work: Awaitable[_T], bound_s: float) -> _T:
        """Await one round trip under ``bound_s`` seconds; every error becomes :class:`RoundTripFailed`, counted."""
        try:
            return await asyncio.wait_for(work, bound_s)
        except rexc.ResponseError as exc:
            if isinstance(exc, rexc.ClusterError):  # CLUSTERDOWN and friends: unusable
                self._failed(exc, unreachable=True)
            # A whole-command error reply (e.g. NOAUTH, NOPERM): the server is up.
            logger.warning("redis tier %s: error reply: %s", self.name, exc)
            self._failed(exc, unreachable=False)
        except UNREACHABLE_ERRORS as exc:
            if isinstance(exc, (asyncio.TimeoutError, rexc.TimeoutError)):
                self._counts["timeouts"] += 1
            logger.debug("redis tier %s: %s: %s", self.name, type(exc).__name__, exc)
            self._failed(exc, unreachable=True)
        except Exception as exc:  # noqa: BLE001 - a cache must not fail its caller
            logger.warning("redis tier %s: unexpected error from redis-py", self.name, exc_info=True)
            self._failed(exc, unreachable=True)

    def _failed(self, exc: Exception, *, unreachable: bool) -> NoReturn:
        self._counts["errors"] += 1
        raise RoundTripFailed(f"{type(exc).__name__}: {exc}", unreachable=unreachable) from exc
