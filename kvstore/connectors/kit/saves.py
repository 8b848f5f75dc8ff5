"""A connector's saves, in the background: one thread runs them in order, with bounded staging and the store's health.

A connector copies what it saves out of its engine's cache first (the
engine may reuse that memory at once), then hands the put to a
:class:`SaveQueue`: the copies wait there, up to ``max_pending_bytes`` of them
(a save past the bound is refused, for the caller to count as dropped), and one
thread makes the puts. While the store is down (:class:`StoreHealth`) a queued
put is not sent but fails at once with :class:`StoreDownError`; a put that
fails starts the backoff, one that works ends it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvstore.connectors.kit.stores import StoreHealth
from kvstore.errors import UnavailableError

logger = logging.getLogger(__name__)


class StoreDownError(UnavailableError):
    """A queued save was not sent: the store was down (a backoff after a failed call)."""


@dataclass(slots=True)
class _Task:
    run: Callable[[], int]
    future: concurrent.futures.Future[int]
    nbytes: int
    guarded: bool  # a put: skipped while the store is down, and its outcome is the store's health


class SaveQueue:
    """One background thread that runs a connector's saves (and other store calls) in order.

    Args:
        health: the store's health: a guarded task is skipped while it is down and its outcome updates it;
            ``None`` for none.
        max_pending_bytes: bytes of staged copies that may wait at most (:meth:`submit` refuses past it);
            ``None`` for no bound.
        name: the thread's name.
    """

    def __init__(self, health: StoreHealth | None = None, max_pending_bytes: int | None = None,
                 name: str = "kvstore-save") -> None:
        self.health = health
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        """Bytes of the queued tasks' staged copies now."""
        with self._lock:
            return self._pending_bytes

    def submit(self, run: Callable[[], int], nbytes: int = 0, *, guarded: bool = True,
               ) -> concurrent.futures.Future[int] | None:
        """Queue ``run`` (a put, returning what it stored); ``None`` when its ``nbytes`` would pass the bound.

        Args:
            run: the call, made on the queue's thread.
            nbytes: bytes its staged copy holds until it has run.
            guarded: a put to the store: not sent while the store is down (the future fails with
                :class:`StoreDownError`), and its success or failure is the store's health. ``False`` for a call
                that must not count (a delete of a bad block).

        Returns:
            The call's future (its result, or the exception it raised), or ``None`` when it was refused.
        """
        with self._lock:
            if (self.max_pending_bytes is not None and nbytes
                    and self._pending_bytes + nbytes > self.max_pending_bytes):
                return None
            self._pending_bytes += nbytes
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._tasks.put(_Task(run, future, nbytes, guarded))
        return future

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                self._run(task)
            finally:
                with self._lock:
                    self._pending_bytes -= task.nbytes
                self._tasks.task_done()

    def _run(self, task: _Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        health = self.health if task.guarded else None
        if health is not None and not health.up():
            task.future.set_exception(StoreDownError("the store is down: save not sent"))
            return
        try:
            result = task.run()
        except Exception as exc:  # noqa: BLE001 - the thread must survive any store failure
            if health is not None:
                health.failed("save", exc)
            task.future.set_exception(exc)
            return
        if health is not None:
            health.succeeded()
        task.future.set_result(result)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued task has run (or failed); returns whether all did within ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiter = threading.Thread(target=self._tasks.join, daemon=True)
        waiter.start()
        waiter.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not waiter.is_alive()

    def close(self, timeout_s: float | None = None) -> bool:
        """Run the queued tasks (for up to ``timeout_s``), then stop the thread; idempotent. Returns whether every
        task ran; the ones left are dropped."""
        if self._closed:
            return True
        self._closed = True
        drained = self.drain(timeout_s)
        self._tasks.put(None)
        self._thread.join(timeout_s)  # its loop ends at the None: no store call left running at exit
        return drained
