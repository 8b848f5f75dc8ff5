"""Bounded waits for what happens in the background, in other processes (a node rejoining, a copy reaching Redis)."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, pause_s: float = 0.05) -> None:
    """Call ``predicate`` until it is true; fail the test with ``what`` after ``timeout_s`` seconds.

    A bounded wait for something that happens in the background (a write-through
    reaching Redis, a node rejoining), not a timing assertion: the bound is generous.

    Raises:
        AssertionError: if ``predicate`` is still false after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(pause_s)
