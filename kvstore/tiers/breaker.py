"""A circuit breaker for a remote tier: pure state logic with an injectable clock, no I/O.

The states follow the classic pattern (Nygard, *Release It!*, "Circuit Breaker";
the same three states as resilience4j and Polly):

* ``closed``: calls go through; ``failure_threshold`` consecutive failures open it.
* ``open``: calls are refused at once, for ``reset_s`` seconds.
* ``half_open``: after ``reset_s``, exactly one trial call goes through. Its
  success closes the breaker; its failure opens it again for another ``reset_s``.

The caller asks :meth:`CircuitBreaker.allow` before a call and reports the
outcome with :meth:`record_success` or :meth:`record_failure`. A trial whose
outcome is never reported (a cancelled task) does not wedge the breaker: after
another ``reset_s`` a new trial is allowed.
"""

from __future__ import annotations

import enum
import time
from typing import Callable


class BreakerState(str, enum.Enum):
    """The three states of a :class:`CircuitBreaker`."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Counts consecutive failures and short-circuits calls while a peer is down.

    Not thread-safe: one asyncio loop owns it (see the house style's "one owner").

    Args:
        failure_threshold: consecutive failures that open the breaker; ``<= 0``
            disables it (it never opens).
        reset_s: seconds the breaker stays open before one trial call, ``>= 0``.
        clock: monotonic time in seconds; ``time.monotonic`` unless a test injects one.

    Raises:
        ValueError: if ``reset_s`` is negative.
    """

    def __init__(self, failure_threshold: int, reset_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if reset_s < 0:
            raise ValueError(f"reset_s must be >= 0, got {reset_s}")
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._num_consecutive_failures = 0
        self._opened_at = 0.0
        self._trial_started_at = 0.0
        self.num_trips = 0
        """Times the breaker went from closed or half-open to open."""

    @property
    def state(self) -> BreakerState:
        """The current state; an open breaker whose ``reset_s`` has passed still reads ``open``
        until :meth:`allow` starts the trial."""
        return self._state

    @property
    def num_consecutive_failures(self) -> int:
        """Failures recorded since the last success."""
        return self._num_consecutive_failures

    def allow(self) -> bool:
        """Whether a call may go through now; may move ``open`` to ``half_open`` and start the trial.

        Returns:
            ``True`` when closed, or for the single trial call of a half-open
            breaker; ``False`` while open, and for every other call while the
            trial is in flight (until it reports, or ``reset_s`` passes).
        """
        if self._state is BreakerState.CLOSED:
            return True
        now = self._clock()
        if self._state is BreakerState.OPEN:
            if now - self._opened_at < self.reset_s:
                return False
            self._state = BreakerState.HALF_OPEN
            self._trial_started_at = now
            return True
        # Half-open: one trial at a time; a trial that never reported expires.
        if now - self._trial_started_at >= self.reset_s:
            self._trial_started_at = now
            return True
        return False

    def record_success(self) -> None:
        """Report a call that reached the peer and got an answer: closes the breaker."""
        self._state = BreakerState.CLOSED
        self._num_consecutive_failures = 0

    def record_failure(self) -> None:
        """Report a call that failed to reach the peer (connection error, timeout).

        Opens the breaker from ``half_open`` at once, and from ``closed`` once
        ``failure_threshold`` failures in a row have been recorded.
        """
        self._num_consecutive_failures += 1
        if self.failure_threshold <= 0:
            return
        if self._state is BreakerState.HALF_OPEN or (
            self._state is BreakerState.CLOSED and self._num_consecutive_failures >= self.failure_threshold
        ):
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self.num_trips += 1
        elif self._state is BreakerState.OPEN:
            # A call admitted before the breaker opened failed late: restart the wait.
            self._opened_at = self._clock()
