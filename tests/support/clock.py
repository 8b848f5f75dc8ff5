"""A clock that a test moves by hand, so that waiting for time to pass takes no time (cachetools' ``timer=``)."""

from __future__ import annotations

import asyncio
from typing import Callable


class FakeClock:
    """Seconds that pass only when the test calls :meth:`advance`.

    Pass the clock itself as a ``clock=`` (it is callable, as ``time.monotonic``)
    and :meth:`sleep` as a ``sleep=`` (as ``asyncio.sleep``): a sleeper wakes once
    the test has moved the clock past its time, on the loop's next turns.

    Args:
        now_s: the time to start at, seconds.
    """

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on and wake every :meth:`sleep` whose time has come."""
        self.now_s += seconds
        for wake_s, future in list(self._sleepers):
            if wake_s <= self.now_s and not future.done():
                future.set_result(None)

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has moved ``seconds`` on (one turn of the loop when ``seconds <= 0``)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        entry = (self.now_s + seconds, asyncio.get_running_loop().create_future())
        self._sleepers.append(entry)
        try:
            await entry[1]
        finally:
            self._sleepers.remove(entry)

    @property
    def num_sleeping(self) -> int:
        """Tasks in :meth:`sleep` now."""
        return len(self._sleepers)


async def turns_until(condition: Callable[[], bool], max_turns: int = 1000) -> None:
    """Let the loop run other tasks, one turn at a time, until ``condition()`` holds; no time passes.

    Raises:
        AssertionError: if it still does not hold after ``max_turns`` turns.
    """
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    assert condition(), f"still false after {max_turns} turns of the loop"
