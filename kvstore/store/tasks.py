"""The store's tasks in flight: work that runs to its end even if its caller is cancelled, and waiting for it."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")


class Tasks:
    """The operations and record deletes of one store that are in flight; one per store, on its event loop.

    Once an operation has prepared (``kvstore.store.index``), its I/O and complete step run to their end even if its
    caller goes away: :meth:`run` starts them as a task, and the store's drain (``kvstore.store.lifecycle.drain``)
    waits for every one.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def __bool__(self) -> bool:
        """Whether any task is in flight."""
        return bool(self._tasks)

    def run(self, work: Awaitable[T]) -> asyncio.Future[T]:
        """Run ``work`` (an operation's I/O and complete step) to its end even if its caller is cancelled.

        The caller awaits ``asyncio.shield`` of the returned task; :meth:`wait` waits for it.
        """
        return self.adopt(asyncio.ensure_future(work))

    def adopt(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        """Let :meth:`wait` wait for ``task`` (a read whose caller went away while its I/O ran); returns it."""
        if not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        return task

    async def wait(self) -> None:
        """Wait for the tasks in flight now (their errors are their callers'; none is raised here)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # observed: its caller (if any) got it; a task without one is logged by it
