"""Byte budgets per client connection and per tenant: bytes of Get replies in flight, and of Put bodies being received.

Both count bytes a client decides the node holds (:class:`ByteBudget`), and
make a call past a budget wait its turn, as HTTP/2 windows do for bytes:
:class:`ReplyBudget` (``limits.connection_reply_bytes``,
``limits.tenant_reply_bytes``) holds a Get back before it reads;
:class:`PutBudget` (``limits.connection_put_bytes``, ``limits.tenant_put_bytes``)
holds a Put back before it reads its next block. How long calls waited is
counted in :class:`WaitTimes`. Used from the server's loop only: no locks.
"""

from __future__ import annotations

import asyncio
import bisect
import collections

from kvstore.config import Config


class ByteBudget:
    """Bytes held now by each client connection (``peer``) and each tenant (``cache_salt``), against a budget each.

    A tenant's key is ``"\\0" + tenant`` in one dict with the peers' (no gRPC peer starts so). Subclasses
    (:class:`ReplyBudget`, :class:`PutBudget`) decide what
    counts and what happens past a budget. Used from the server's loop only: no locks.

    Args:
        per_connection_bytes: bytes one connection may hold; > 0.
        per_tenant_bytes: bytes one tenant may hold, over its connections; > 0.
        what: what is held, for the error (``"reply"``, ``"put"``).

    Attributes:
        num_waited: calls that had to wait for room, since start.
        waits: how long they waited (:class:`WaitTimes`), and how many gave up.

    Raises:
        ValueError: if a budget is not > 0.
    """

    def __init__(self, per_connection_bytes: int, per_tenant_bytes: int, what: str) -> None:
        if per_connection_bytes <= 0 or per_tenant_bytes <= 0:
            raise ValueError(f"{what} budgets must be > 0, got {per_connection_bytes} and {per_tenant_bytes}")
        self.per_connection_bytes = per_connection_bytes
        self.per_tenant_bytes = per_tenant_bytes
        self._held: dict[str, int] = {}  # peer, or "\0" + tenant -> bytes held
        self.num_waited = 0  # calls (Gets; a Put's blocks) that had to wait, since start
        self.waits = WaitTimes()  # how long they waited, and how many gave up waiting

    def held_bytes(self, peer: str | None = None, tenant: str | None = None) -> int:
        """Bytes held now by ``peer``, or by ``tenant``; by every connection when both are ``None``."""
        if peer is not None:
            return self._held.get(peer, 0)
        if tenant is not None:
            return self._held.get("\0" + tenant, 0)
        return sum(n for key, n in list(self._held.items()) if not key.startswith("\0"))

    def charge(self, peer: str, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, when negative) against ``peer`` and ``tenant``; a key at 0 is dropped."""
        held = self._held
        for key in (peer, "\0" + tenant):
            left = held.get(key, 0) + nbytes
            if left > 0:
                held[key] = left
            else:
                held.pop(key, None)


WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets of the time calls waited for a budget, seconds (up to ``limits.max_stream_s``'s default)."""


class WaitTimes:
    """How long calls waited for their turn under a budget (:class:`ReplyBudget`'s Gets,
    :class:`PutBudget`'s Put blocks): a histogram, and counts by outcome.

    Counted on the server's loop; read by a scrape in another thread (copies of
    lists and ints, atomic under the GIL), as ``kvstore.server.metrics.CallStats``.

    Attributes:
        buckets: upper bounds of the buckets, seconds (``+Inf`` follows).
        counts: waits per bucket, the last one ``+Inf`` (Prometheus' ``le``: wait <= bound).
        sum_s: the waits' total, seconds.
        admitted: waits that ended in the call's turn.
        abandoned: waits that ended before it (the call's deadline, ``max_stream_s``, the client gone).
    """

    def __init__(self, buckets: tuple[float, ...] = WAIT_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum_s = 0.0
        self.admitted = 0
        self.abandoned = 0

    def observe(self, waited_s: float, *, admitted: bool) -> None:
        """Count one wait of ``waited_s`` seconds, which ended in the call's turn (``admitted``) or before it."""
        self.counts[bisect.bisect_left(self.buckets, waited_s)] += 1
        self.sum_s += waited_s
        if admitted:
            self.admitted += 1
        else:
            self.abandoned += 1


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


class PutBudget(ByteBudget):
    """Bytes of Put bodies being received per connection (``peer``) and per tenant (``cache_salt``).

    The server buffers a whole Put stream before storing it (nothing is stored
    unless the whole stream arrives), so the blocks being received are node
    memory a client decides on. Each block counts at its declared size
    (``total_bytes`` of its first message), from the moment its first message
    is read until the Put's call ends (stored, refused or cancelled). A Put
    whose next block would go past its connection's or tenant's budget,
    counting what the other Puts there hold, waits before it reads on: gRPC's
    flow control then stops the client's sending. Its own blocks do not count
    against it, so one Put larger than a budget still runs, alone. A waiting
    Put is bounded by its deadline and ``limits.max_stream_s``.

    So the Puts of one connection hold at most ``per_connection_bytes`` plus one
    block each past it (the block that was read while under it); of one tenant,
    ``per_tenant_bytes`` plus as much.

    Args:
        per_connection_bytes: bytes one connection's Puts may hold while being received; > 0.
        per_tenant_bytes: bytes one tenant's Puts may hold, over its connections; > 0.

    Raises:
        ValueError: if a budget is not > 0.
    """

    def __init__(self, per_connection_bytes: int, per_tenant_bytes: int) -> None:
        super().__init__(per_connection_bytes, per_tenant_bytes, "put")
        self._changed: asyncio.Event | None = None  # set (and replaced) whenever bytes are released

    @classmethod
    def from_config(cls, config: Config) -> PutBudget:
        """The budget of ``limits.connection_put_bytes`` and ``limits.tenant_put_bytes``."""
        return cls(config.limits.connection_put_bytes, config.limits.tenant_put_bytes)

    def _full(self, peer: str, tenant: str, own_bytes: int) -> bool:
        held = self._held
        return (held.get(peer, 0) - own_bytes >= self.per_connection_bytes
                or held.get("\0" + tenant, 0) - own_bytes >= self.per_tenant_bytes)

    async def take(self, peer: str, tenant: str, nbytes: int, own_bytes: int) -> None:
        """Charge a Put's next block of ``nbytes``, once the other Puts of ``peer`` and ``tenant`` leave room.

        Args:
            peer: the call's connection.
            tenant: the namespace's ``cache_salt``.
            nbytes: the block's declared size, bytes.
            own_bytes: what this Put holds already (not counted against it), bytes.

        Cancellation (the call's deadline, ``max_stream_s``, the client gone) leaves it uncharged.
        """
        if self._full(peer, tenant, own_bytes):
            self.num_waited += 1
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                while self._full(peer, tenant, own_bytes):
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    await self._changed.wait()
            except asyncio.CancelledError:
                self.waits.observe(loop.time() - started, admitted=False)
                raise
            self.waits.observe(loop.time() - started, admitted=True)
        self.charge(peer, tenant, nbytes)

    def release(self, peer: str, tenant: str, nbytes: int) -> None:
        """A Put's call ended, holding ``nbytes`` (maybe 0): uncount them and let waiting Puts read on."""
        if nbytes:
            self.charge(peer, tenant, -nbytes)
            changed, self._changed = self._changed, None
            if changed is not None:
                changed.set()
