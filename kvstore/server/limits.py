"""Server-side limits: concurrent calls per client connection, bytes per tenant (a quota), and stream length.

All are used from the server's one asyncio loop (the store's owner), so they
keep plain dicts and need no locks. Limits on one request (hashes per request,
bytes per block) are checked by the servicer and ``kvstore.wire``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Callable, Iterator

from kvstore.config import Config
from kvstore.errors import ResourceExhaustedError
from kvstore.keys import Namespace
from kvstore.server.budget import ByteBudget
from kvstore.server.tenants import TenantTags
from kvstore.status import DeadlineExceededError

logger = logging.getLogger(__name__)

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


class TenantQuota:
    """Bytes each tenant (``cache_salt``) may hold in the node's local tiers; a Put over it is refused.

    A tenant's use is the sum of ``namespace_bytes(tag)`` (the store's per-namespace
    count, ``TieredStore.namespace_bytes``) over the namespaces it has written
    to on this node (:class:`~kvstore.server.tenants.TenantTags`), plus the bytes
    of its Puts still in progress. A Put is admitted when ``used + incoming <=
    quota_bytes``, where ``incoming`` is the encoded size of every block in it,
    already stored or not (so a Put near the quota may be refused though it
    would store nothing new: look up first and put only the missing blocks, as
    connectors do).

    Notes:
        A block counts the same in every local tier, before and after a restart: the most capacity a block
        of its length takes in any of the node's local tiers (``kvstore.charges``), whichever tier holds it
        now (the memory tier rounds a block up to whole pages, LMDB to its pages). Blocks demoted to the
        shared Redis tier no longer count (Redis is bounded by its own ``maxmemory``). A namespace tag is a
        hash and names no tenant, so with a disk tier the pairs tenant → tag are kept on disk
        (``kvstore.server.tenants``, ``tenants.json``): blocks restored from LMDB after a restart count
        against their tenant from the start. Without a disk tier nothing survives a restart to count.

    Args:
        quota_bytes: bytes one tenant may hold; must be > 0.
        namespace_bytes: bytes one namespace holds by its tag (``TieredStore.namespace_bytes``).
        tenants: the pairs tenant → namespace tag of this node; a new in-memory one when ``None``.

    Raises:
        ValueError: if ``quota_bytes <= 0``.
    """

    def __init__(self, quota_bytes: int, namespace_bytes: Callable[[bytes], int],
                 tenants: TenantTags | None = None) -> None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be > 0, got {quota_bytes}")
        self.quota_bytes = quota_bytes
        self._namespace_bytes = namespace_bytes
        self._tenants = tenants if tenants is not None else TenantTags()
        self._pending_bytes: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: Config, namespace_bytes: Callable[[bytes], int],
                    tenants: TenantTags | None = None) -> TenantQuota | None:
        """The quota of ``limits.tenant_quota_bytes`` (``None`` when 0), over ``tenants`` (when ``None``, a new
        one, its ledger in ``store.disk.path`` if set)."""
        if config.limits.tenant_quota_bytes <= 0:
            return None
        return cls(config.limits.tenant_quota_bytes, namespace_bytes,
                   tenants if tenants is not None else TenantTags.from_config(config, namespace_bytes))

    @property
    def tenants(self) -> list[str]:
        """Tenants known to hold (or to have held since they were last counted) bytes on this node."""
        return self._tenants.tenants

    def used_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds in local tiers now plus those of its Puts in progress.

        Namespaces that hold nothing any more are forgotten on the way.
        """
        used = 0
        for tag in list(self._tenants.tags_of(tenant)):
            num = self._namespace_bytes(tag)
            if num:
                used += num
            else:
                self._tenants.forget(tenant, tag)
        return used + self._pending_bytes.get(tenant, 0)

    @contextlib.contextmanager
    def reserve(self, namespace: Namespace, incoming_bytes: int) -> Iterator[None]:
        """Admit a Put of ``incoming_bytes`` into ``namespace`` and hold the bytes while it runs.

        Use as ``with quota.reserve(ns, n): await store.put(...)``. ``namespace``
        counts as the tenant's from then on (until it holds nothing).

        Raises:
            ResourceExhaustedError: if the tenant's use plus ``incoming_bytes`` is over the quota.
        """
        tenant = namespace.cache_salt
        used = self.used_bytes(tenant)
        if used + incoming_bytes > self.quota_bytes:
            raise ResourceExhaustedError(
                f"tenant {tenant!r} holds {used} bytes; {incoming_bytes} more is over "
                f"limits.tenant_quota_bytes={self.quota_bytes}"
            )
        with self._tenants.writing(namespace):  # before any block of it is stored, so a crash never loses the pair
            self._pending_bytes[tenant] = self._pending_bytes.get(tenant, 0) + incoming_bytes
            try:
                yield
            finally:
                left = self._pending_bytes[tenant] - incoming_bytes
                if left:
                    self._pending_bytes[tenant] = left
                else:
                    del self._pending_bytes[tenant]


class ReplyBudget(ByteBudget):
    """Bytes of Get replies in flight per client connection and per tenant; a Get past either waits its turn.

    A Get's reply counts, at its full size, from the moment its blocks are read
    until its call ends (gRPC has sent the last message and the status, or the
    client went away): the bytes a reader that stops reading makes the node hold
    in its messages and gRPC's buffers. A new Get is admitted while its
    connection and its tenant (the namespace's ``cache_salt``) each hold less
    than their budget, or hold nothing (so one Get larger than a budget still
    runs, alone); otherwise it waits, before it reads anything (so it pins no
    block), first come first served, until replies end and free room: flow
    control, as HTTP/2 windows do for bytes. A waiting Get is bounded by the
    call's deadline and ``limits.max_stream_s`` (then DEADLINE_EXCEEDED), and
    holds one in-flight slot (``limits.max_inflight_per_connection``). When a
    connection ends, gRPC cancels its calls and their bytes are released at once.

    So stalled readers on one connection hold at most ``per_connection_bytes``
    plus one reply; on all of one tenant's connections, ``per_tenant_bytes``
    plus one reply per connection. Used from the server's loop only: no locks.

    Args:
        per_connection_bytes: bytes one connection's replies may hold; > 0.
        per_tenant_bytes: bytes one tenant's replies may hold, over its connections; > 0.

    Raises:
        ValueError: if a budget is not > 0.
    """

    def __init__(self, per_connection_bytes: int, per_tenant_bytes: int) -> None:
        super().__init__(per_connection_bytes, per_tenant_bytes, "reply")
        self._waiters: dict[str, collections.deque[asyncio.Future[None]]] = {}  # key -> Gets waiting for it
        self.bytes_per_block = 0  # of the latest reply: what a Get is charged per block before it reads

    @classmethod
    def from_config(cls, config: Config) -> ReplyBudget:
        """The budget of ``limits.connection_reply_bytes`` and ``limits.tenant_reply_bytes``."""
        return cls(config.limits.connection_reply_bytes, config.limits.tenant_reply_bytes)

    def estimate(self, num_blocks: int) -> int:
        """What a Get of ``num_blocks`` is charged on admission, before its blocks are read: ``num_blocks`` times
        the bytes per block of the latest reply (so Gets admitted together count before they read), bytes."""
        return num_blocks * self.bytes_per_block

    def admit(self, peer: str, tenant: str, estimate_bytes: int) -> bool:
        """Admit a Get of ``peer`` for ``tenant`` now, charging ``estimate_bytes``, if both are under budget and
        no one waits before it; pair an admitted Get with :meth:`release` of what it was last charged."""
        key = "\0" + tenant
        held = self._held
        if (held.get(peer, 0) < self.per_connection_bytes and held.get(key, 0) < self.per_tenant_bytes
                and peer not in self._waiters and key not in self._waiters):
            self.charge(peer, tenant, estimate_bytes)
            return True
        return False

    async def wait(self, peer: str, tenant: str, estimate_bytes: int) -> None:
        """Wait, first come first served, until the Get may read (after :meth:`admit` said no), then charge it.

        Once this returns, the Get counts as admitted: pair it with :meth:`release`
        of what it was charged. Cancellation (the call's deadline,
        ``max_stream_s``, the client gone) leaves the queue, charged nothing.
        """
        self.num_waited += 1
        loop = asyncio.get_running_loop()
        keys = ((peer, self.per_connection_bytes), ("\0" + tenant, self.per_tenant_bytes))
        started = loop.time()
        try:
            for key, budget in keys:
                queue = self._waiters.setdefault(key, collections.deque())
                future: asyncio.Future[None] = loop.create_future()
                queue.append(future)
                if len(queue) == 1 and self._held.get(key, 0) < budget:
                    future.set_result(None)  # no one before it, and room: through at once
                try:
                    await future
                finally:
                    if future in queue:
                        queue.remove(future)
                    if not queue:
                        del self._waiters[key]
        except asyncio.CancelledError:
            self.waits.observe(loop.time() - started, admitted=False)
            for key, budget in keys:  # it may have been woken and not used its turn: pass the turn on
                self._wake(key, budget)
            raise
        self.waits.observe(loop.time() - started, admitted=True)
        self.charge(peer, tenant, estimate_bytes)

    def settle(self, peer: str, tenant: str, estimate_bytes: int, nbytes: int, num_blocks: int) -> None:
        """An admitted Get has read its ``num_blocks`` blocks, ``nbytes`` in all: charge that instead of its estimate."""
        self.charge(peer, tenant, nbytes - estimate_bytes)
        if num_blocks:
            self.bytes_per_block = nbytes // num_blocks

    def release(self, peer: str, tenant: str, nbytes: int) -> None:
        """An admitted Get ended, its reply (``nbytes`` charged, maybe 0) sent or lost: uncount it, let the next in."""
        self.charge(peer, tenant, -nbytes)
        self._wake(peer, self.per_connection_bytes)
        self._wake("\0" + tenant, self.per_tenant_bytes)

    def _wake(self, key: str, budget: int) -> None:
        queue = self._waiters.get(key)
        if queue and self._held.get(key, 0) < budget:
            future = queue[0]
            if not future.done():
                future.set_result(None)


class StreamWatchdog:
    """Ends Get and Put streams that last longer than ``limits.max_stream_s``, with one timer for all of them.

    A stream runs inside ``async with watchdog.watch("Get"):``. One background
    task wakes every :attr:`check_every_s` seconds while streams are open and
    cancels each one past its limit, which then leaves the ``async with`` with
    :class:`~kvstore.status.DeadlineExceededError`; so a stalled reader cannot
    hold a Get's leases, or a Put's buffer, for ever. A stream may overrun the
    limit by up to :attr:`check_every_s`.

    Per stream this costs a dict insert and delete. A per-call ``asyncio.timeout``
    costs a timer-heap entry and its cancellation, about 30 µs per Get in the
    servicer (``benchmarks/bench_service.py`` measures the Get path).

    Args:
        limit_s: seconds a stream may last; > 0.

    Raises:
        ValueError: if ``limit_s <= 0``.
    """

    def __init__(self, limit_s: float) -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        self.limit_s = limit_s
        self.check_every_s = min(1.0, limit_s / 4)
        self._deadlines: dict[asyncio.Task[object], float] = {}  # open stream -> loop time it must end by
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
        loop = task.get_loop()
        self._deadlines[task] = loop.time() + self.limit_s
        if self._timer is None:
            self._timer = loop.create_task(self._check(loop))

    def _close(self, task: asyncio.Task[object]) -> bool:
        """Forget ``task``'s stream; whether the watchdog cancelled it."""
        del self._deadlines[task]
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    async def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._deadlines:
                await asyncio.sleep(self.check_every_s)
                now = loop.time()
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
        task = self._task = task or asyncio.current_task()  # type: ignore[assignment]
        self._cancelling = task.cancelling()  # type: ignore[union-attr]
        self._watchdog._open(task)  # type: ignore[arg-type]
        return self

    def open_soon(self) -> StreamWatch:
        """:meth:`open` on the loop's next turn: once the current task first waits, before anything can stall it.

        A stream is cancelled only where it waits, so this watches it as well as
        :meth:`open` does, and the work is off the way to the stream's first
        message (the service's Get). Returns ``self``.
        """
        task = asyncio.current_task()
        self._pending = task.get_loop().call_soon(self.open, task)  # type: ignore[union-attr]
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
