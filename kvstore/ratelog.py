"""Warnings that repeat under load, logged at most once per interval per kind, with the count of those held back."""

from __future__ import annotations

import logging
import time
from typing import Callable

WARNING_INTERVAL_S = 10.0
"""Seconds between two warnings of one kind (the store's dropped demotions and refused puts)."""


class RateLimitedLog:
    """Log a kind of warning at most once per ``interval_s``; the next one says how many were held back.

    The counts themselves are kept elsewhere (``TierCounts``) and exported as
    metrics; this only keeps a node's log readable when a limit is hit
    thousands of times a second.

    Args:
        logger: where the warnings go (at ``WARNING``).
        interval_s: seconds between two warnings of one kind.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = WARNING_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a warning of ``kind`` went out less than the interval ago; whether it did."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._held_back[kind] = self._held_back.get(kind, 0) + 1
            return False
        self._last[kind] = now
        held_back = self._held_back.pop(kind, 0)
        if held_back:
            self._logger.warning(message + " (%d more like it since the last warning)", *args, held_back)
        else:
            self._logger.warning(message, *args)
        return True
