"""Retries of a client's calls (:class:`Retry`, :class:`Backoff`) and its bound on calls in flight (:class:`InflightSlots`)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import grpc

from kvstore.error_codes import RETRYABLE_CODES

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.05
DEFAULT_MAX_BACKOFF_S = 2.0


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter, ``uniform(0, min(cap, base * 2^attempt))``."""
    return random.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 64)))  # 2.0 ** 1024 overflows



class InflightSlots:
    """At most ``num_slots`` calls in flight across threads: a counter under a lock, which waits only when full.

    What ``threading.BoundedSemaphore`` does, for a tenth of its cost when a slot
    is free (its acquire and release are Python methods under a ``Condition``,
    about 3 µs a call): a lock and an integer, and the condition only when a
    caller must wait.

    Args:
        num_slots: calls allowed at once, >= 1.
    """

    __slots__ = ("_lock", "_free", "_waiters", "_freed")

    def __init__(self, num_slots: int) -> None:
        self._lock = threading.Lock()
        self._free = num_slots
        self._waiters = 0
        self._freed = threading.Condition(self._lock)

    def acquire(self, timeout_s: float) -> bool:
        """Take a slot, waiting up to ``timeout_s`` seconds for one; whether one was taken."""
        with self._lock:
            if self._free:
                self._free -= 1
                return True
            self._waiters += 1
            try:
                if not self._freed.wait_for(lambda: self._free > 0, timeout_s):
                    return False
            finally:
                self._waiters -= 1
            self._free -= 1
            return True

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._free += 1
            if self._waiters:
                self._freed.notify()




@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: before retry ``n`` (0-based), ``uniform(0, min(cap_s, base_s * 2^n))``.

    From the AWS Architecture Blog's "Exponential Backoff and Jitter": full
    jitter spreads the retries of many clients that failed together.

    Attributes:
        base_s: the first pause's upper bound, seconds.
        cap_s: the largest upper bound, seconds.
    """

    base_s: float = DEFAULT_BACKOFF_S
    cap_s: float = DEFAULT_MAX_BACKOFF_S

    def pause_s(self, attempt: int) -> float:
        """The pause before retry ``attempt``, seconds."""
        return backoff_s(attempt, self.base_s, self.cap_s)


@dataclass(frozen=True, slots=True)
class Retry:
    """Which failed attempts of an idempotent call are made again, how often, and after what pause.

    Attributes:
        retries: retries per node after the first attempt (0 for none).
        backoff: the pause before each retry.
        codes: the status codes worth a retry (the node is restarting or shutting down).
    """

    retries: int = DEFAULT_RETRIES
    backoff: Backoff = Backoff()
    codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES

    def pause_s(self, attempt: int, code: grpc.StatusCode) -> float | None:
        """Seconds to wait before retrying after failed attempt ``attempt`` (0-based); ``None``: do not retry."""
        if code in self.codes and attempt < self.retries:
            return self.backoff.pause_s(attempt)
        return None
