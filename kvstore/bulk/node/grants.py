"""The node's grants: one-time random tokens, each naming exactly one transfer's leased blocks or reserved room.

A ``BulkGet`` or ``BulkPut`` call, once the node's checks passed, issues a
grant (:meth:`GrantTable.issue`): 32 random bytes from the OS CSPRNG that
name one :class:`GetGrant` (the leased blocks of one prefix, in order) or one
:class:`PutGrant` (the room for one Put's blocks). A grant is redeemed at most
once (:meth:`GrantTable.redeem` takes it out of the table), and only before it
expires (``bulk.grant_s``); an unredeemed one is dropped at its expiry, and
what it held (a lease, staged room) is given back on the store's loop. A
connection can only move what a grant names: the blocks leased for that call,
under the tenant that call was checked for.

What outstanding and running grants hold is bounded per tenant and over the
node (:class:`GrantBudget`): a call past either is answered ``no_room`` and its
client uses Get or Put instead.

Thread-safe: calls issue grants on the store's loop; the listener's threads
redeem and finish them.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any, Callable

from kvstore.bulk.frames import GRANT_BYTES


class GrantBudget:
    """Bytes held by grants (outstanding or being transferred), per tenant and over the node.

    Args:
        tenant_bytes: the most one tenant's grants may hold, bytes.
        total_bytes: the most every grant together may hold, bytes.

    Attributes:
        held_bytes: what the grants hold now, bytes.
        refused: grants refused because a bound was reached.
    """

    def __init__(self, tenant_bytes: int, total_bytes: int) -> None:
        self.tenant_bytes = tenant_bytes
        self.total_bytes = total_bytes
        self.held_bytes = 0
        self.refused = 0
        self._tenants: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``tenant`` if both bounds allow it (one grant larger than a bound runs alone)."""
        with self._lock:
            held = self._tenants.get(tenant, 0)
            if (held and held + nbytes > self.tenant_bytes) or (
                    self.held_bytes and self.held_bytes + nbytes > self.total_bytes):
                self.refused += 1
                return False
            self._tenants[tenant] = held + nbytes
            self.held_bytes += nbytes
            return True

    def give(self, tenant: str, nbytes: int) -> None:
        """Uncharge ``nbytes`` of ``tenant``."""
        with self._lock:
            left = self._tenants.get(tenant, 0) - nbytes
            if left > 0:
                self._tenants[tenant] = left
            else:
                self._tenants.pop(tenant, None)
            self.held_bytes -= nbytes


class Grant:
    """What one grant names; :class:`GetGrant` or :class:`PutGrant`.

    Args:
        tenant: the namespace's tenant (``cache_salt``), charged in the :class:`GrantBudget`.
        nbytes: the bytes it moves.
        sizes: each block's encoded length, bytes, in transfer order.
        release: gives back what it holds (a lease, staged room); run once, on the store's loop.

    Attributes:
        expires_at: ``time.monotonic()`` after which it cannot be redeemed (set by :meth:`GrantTable.issue`).
    """

    __slots__ = ("tenant", "nbytes", "sizes", "_release", "expires_at", "_budget")

    def __init__(self, tenant: str, nbytes: int, sizes: list[int], release: Callable[[], None]) -> None:
        self.tenant = tenant
        self.nbytes = nbytes
        self.sizes = sizes
        self._release: Callable[[], None] | None = release
        self.expires_at = 0.0
        self._budget: GrantBudget | None = None

    def take_release(self) -> Callable[[], None]:
        """What gives back the grant's holdings, now the caller's to run (a Put's commit, which frees its room
        only once the store's put has ended); the grant's own :meth:`finish` then gives back its budget alone."""
        release, self._release = self._release, None
        return release if release is not None else _nothing

    def finish(self) -> None:
        """Give back what the grant holds and its budget; idempotent. On the store's loop."""
        release, self._release = self._release, None
        if release is not None:
            release()
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self.tenant, self.nbytes)


class GetGrant(Grant):
    """A leased prefix to send: ``blocks`` (each a buffer the lease keeps valid), in order.

    Attributes:
        blocks: the encoded blocks.
    """

    __slots__ = ("blocks",)

    def __init__(self, tenant: str, blocks: list[Any], sizes: list[int], release: Callable[[], None]) -> None:
        super().__init__(tenant, sum(sizes), sizes, release)
        self.blocks = blocks


class PutGrant(Grant):
    """Room for one Put's blocks, and what storing them needs once they arrived and were checked.

    Attributes:
        targets: per block, a writable buffer (a staged range of the node's pool) to receive it into; ``None``:
            the node's own memory, allocated as each block arrives.
        blocks: per block, the read-only buffer the store is given (the same memory as ``targets``), or ``None``.
        check: ``(position, block) -> None``, raising on a bad block (``kvstore.validation.BlockChecker.check``).
        commit: ``blocks -> coroutine`` storing the checked blocks (run on the store's loop), returning the
            ``PutResponse``.
    """

    __slots__ = ("targets", "blocks", "check", "commit")

    def __init__(self, tenant: str, sizes: list[int], release: Callable[[], None], targets: list[Any] | None,
                 blocks: list[Any] | None, check: Callable[[int, Any], None],
                 commit: Callable[[list[Any]], Any]) -> None:
        super().__init__(tenant, sum(sizes), sizes, release)
        self.targets = targets
        self.blocks = blocks
        self.check = check
        self.commit = commit


class GrantTable:
    """The node's outstanding grants (see the module docstring).

    Args:
        loop: the store's event loop (expiries and releases run there).
        grant_s: seconds a grant may be redeemed in.
        budget: what grants may hold.
        clock: ``time.monotonic`` (injected by tests).

    Attributes:
        issued, redeemed, expired, refused: counts since start (refused: unknown, used or expired grants presented).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, grant_s: float, budget: GrantBudget,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._loop = loop
        self.grant_s = grant_s
        self.budget = budget
        self._clock = clock
        self._grants: dict[bytes, Grant] = {}
        self._lock = threading.Lock()
        self.issued = self.redeemed = self.expired = self.refused = 0

    def __len__(self) -> int:
        return len(self._grants)

    def issue(self, grant: Grant) -> bytes | None:
        """A new grant for ``grant`` (on the loop); ``None`` when the budget has no room (nothing was taken: the
        caller gives back what the grant would have held)."""
        if not self.budget.take(grant.tenant, grant.nbytes):
            return None
        grant._budget = self.budget
        token = secrets.token_bytes(GRANT_BYTES)
        grant.expires_at = self._clock() + self.grant_s
        with self._lock:
            self._grants[token] = grant
            self.issued += 1
        self._loop.call_later(self.grant_s, self._expire, token)
        return token

    def take(self, grant: Grant) -> bool:
        """Charge ``grant`` to the budget for a transfer that starts now, on the connection its call came on (no
        token: it is never in the table); ``False`` when the budget has no room. Run :meth:`finish` once it ended."""
        if not self.budget.take(grant.tenant, grant.nbytes):
            return False
        grant._budget = self.budget
        self.issued += 1
        self.redeemed += 1
        return True

    def redeem(self, token: bytes) -> Grant | None:
        """The grant ``token`` names, taken out of the table (any thread); ``None`` if it names none now (never
        issued, redeemed already, or expired). The caller runs :meth:`finish` once the transfer has ended."""
        with self._lock:
            grant = self._grants.pop(token, None)
            if grant is None:
                self.refused += 1
                return None
            if self._clock() > grant.expires_at:
                self.expired += 1
                self._loop.call_soon_threadsafe(grant.finish)
                return None
            self.redeemed += 1
        return grant

    def finish(self, grant: Grant) -> None:
        """A redeemed grant's transfer ended: give back what it held, on the loop (any thread)."""
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(grant.finish)
        except RuntimeError:  # the loop closed meanwhile: the store is gone with what the grant held
            pass

    def _expire(self, token: bytes) -> None:
        with self._lock:
            grant = self._grants.pop(token, None)
            if grant is not None:
                self.expired += 1
        if grant is not None:
            grant.finish()

    def close(self) -> None:
        """Drop every outstanding grant, giving back what each holds (on the loop)."""
        with self._lock:
            grants, self._grants = list(self._grants.values()), {}
        for grant in grants:
            grant.finish()


def _nothing() -> None:
    """Nothing to give back."""
