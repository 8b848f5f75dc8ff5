"""Streams that last too long: Get and Put streams past ``limits.max_stream_s`` are ended, one timer for all.

Used from the server's one asyncio loop (the store's owner), so it keeps plain
dicts and needs no locks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from kvstore.error_codes import DeadlineExceededError


class StreamWatchdog:
    """Ends Get and Put streams that last longer than ``limits.max_stream_s``, with one timer for all of them.

    A stream runs inside ``async with watchdog.watch("Get"):``. One background
    task wakes every :attr:`check_every_s` seconds while streams are open and
    cancels each one past its limit, which then leaves the ``async with`` with
    :class:`~kvstore.error_codes.DeadlineExceededError`; so a stalled reader cannot
    hold a Get's leases, or a Put's buffer, for ever. A stream may overrun the
    limit by up to :attr:`check_every_s`.

    Per stream this costs a dict insert and delete. A per-call ``asyncio.timeout``
    costs a timer-heap entry and its cancellation, about 30 µs per Get in the
    servicer (``benchmarks/bench_service.py`` measures the Get path).

    Args:
        limit_s: seconds a stream may last; > 0.
        clock: monotonic time, seconds; ``time.monotonic`` unless a test injects one.
        sleep: waits the given seconds on ``clock`` between checks; ``asyncio.sleep`` unless a test injects
            one (whose clock it then moves, as cachetools' ``TTLCache(timer=...)``).

    Raises:
        ValueError: if ``limit_s <= 0``.
    """

    def __init__(self, limit_s: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        self.limit_s = limit_s
        self.check_every_s = min(1.0, limit_s / 4)
        self._clock = clock
        self._sleep = sleep
        self._deadlines: dict[asyncio.Task[object], float] = {}  # open stream -> clock time it must end by
        self._expired: set[asyncio.Task[object]] = set()  # cancelled by the watchdog, not yet left
        self._timer: asyncio.Task[None] | None = None

    def watch(self, method: str) -> StreamWatch:
        """The scope of one stream of ``method`` (``Get``, ``Put``; named in the error): ``async with``."""
        return StreamWatch(self, method)

    @property
    def num_open(self) -> int:
        """Streams open now."""
        return len(self._deadlines)

    def close(self) -> None:
        """Stop the background task (the server is stopping); open streams are no longer limited."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _open(self, task: asyncio.Task[object]) -> None:
        self._deadlines[task] = self._clock() + self.limit_s
        if self._timer is None:
            self._timer = task.get_loop().create_task(self._check())

    def _close(self, task: asyncio.Task[object]) -> bool:
        """Forget ``task``'s stream; whether the watchdog cancelled it."""
        del self._deadlines[task]
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    async def _check(self) -> None:
        try:
            while self._deadlines:
                await self._sleep(self.check_every_s)
                now = self._clock()
                for task, deadline in list(self._deadlines.items()):
                    if deadline <= now and task not in self._expired:
                        self._expired.add(task)
                        task.cancel()
        finally:
            if self._timer is asyncio.current_task():
                self._timer = None


class StreamWatch:
    """One stream under a :class:`StreamWatchdog`; a plain class, since it runs on every Get.

    Used as ``async with watchdog.watch(method):``, or through :meth:`open` (or
    :meth:`open_soon`) and :meth:`close` by a scope that has its own exit (the
    servicer's ``_Call``).

    Raises:
        DeadlineExceededError: on leaving the ``async with``, if the watchdog ended the stream.
    """

    __slots__ = ("_watchdog", "_method", "_task", "_cancelling", "_pending")

    def __init__(self, watchdog: StreamWatchdog, method: str) -> None:
        self._watchdog = watchdog
        self._method = method
        self._task: asyncio.Task[object] | None = None
        self._pending: asyncio.Handle | None = None

    def open(self, task: asyncio.Task[object] | None = None) -> StreamWatch:
        """Start watching the stream of ``task`` (the current one when ``None``); returns ``self``."""
        self._pending = None
        task = self._task = task or _current_task()
        self._cancelling = task.cancelling()
        self._watchdog._open(task)
        return self

    def open_soon(self) -> StreamWatch:
        """:meth:`open` on the loop's next turn: once the current task first waits, before anything can stall it.

        A stream is cancelled only where it waits, so this watches it as well as
        :meth:`open` does, and the work is off the way to the stream's first
        message (the service's Get). Returns ``self``.
        """
        task = _current_task()
        self._pending = task.get_loop().call_soon(self.open, task)
        return self

    def close(self, exc_type: type[BaseException] | None) -> bool:
        """Stop watching; whether the stream is leaving because the watchdog ended it (then see :meth:`error`)."""
        if self._pending is not None:  # left before it first waited: never watched
            self._pending.cancel()
            self._pending = None
            return False
        task = self._task
        if task is None:
            return False
        self._task = None
        # as asyncio.timeout: the cancellation is the watchdog's own unless the task was cancelled again meanwhile
        return (self._watchdog._close(task) and task.uncancel() <= self._cancelling
                and exc_type is asyncio.CancelledError)

    def error(self) -> DeadlineExceededError:
        """The error of a stream the watchdog ended."""
        return DeadlineExceededError(
            f"the {self._method} stream took longer than limits.max_stream_s={self._watchdog.limit_s:g} s"
        )

    async def __aenter__(self) -> None:
        self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: object) -> None:
        if self.close(exc_type):
            raise self.error() from None


def _current_task() -> asyncio.Task[object]:
    """The task running now.

    Raises:
        RuntimeError: outside a task (a stream always runs in one).
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("a stream is watched from inside an asyncio task")
    return task
