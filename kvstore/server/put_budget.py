"""Bytes of Put bodies the node holds while it receives them, per client connection and per tenant.

The server buffers a whole Put stream before storing it (nothing is stored
unless the whole stream arrives), so the blocks being received are node memory
a client decides on. :class:`PutBudget` counts them: each block at its declared
size (``total_bytes`` of its first message), from the moment its first message
is read until the Put's call ends (stored, refused or cancelled). A Put whose
next block would go past its connection's or tenant's budget, counting what the
other Puts there hold, waits before it reads on: gRPC's flow control then stops
the client's sending, as HTTP/2 windows do. Its own blocks do not count against
it, so one Put larger than a budget still runs, alone. A waiting Put is bounded
by its deadline and ``limits.max_stream_s``. Used from the server's loop only.
"""

from __future__ import annotations

import asyncio

from kvstore.config import Config
from kvstore.server.budget import ByteBudget


class PutBudget(ByteBudget):
    """Bytes of Put bodies being received per connection (``peer``) and per tenant (``cache_salt``).

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
