"""Blocks read in place under a lease: what ``read`` returns (the same-host data plane, gRPC, the embedded store)."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence


class BlockLease:
    """Blocks read in place, valid until :meth:`release` (``with client.read(...) as blocks:``).

    From the same-host path, each block is a read-only ``memoryview`` of the
    node's writing in this client's get segment, held under a lease: the node
    writes nothing else there until the lease is released, or ``lease_s`` passes
    (then the views may change: copy what must outlive it). From gRPC, the
    blocks are the received buffers, and releasing does nothing. From the
    embedded store (``EmbeddedStore.read``), views of its tiers' memory, held
    by the store until released.

    Attributes:
        blocks: the encoded blocks of the longest cached prefix, in order.
        expires_at: ``time.monotonic()`` by which to release it (``inf`` for received buffers); a copy that
            ended later may hold another Get's bytes (check with :meth:`valid`).
        checked: whether the blocks come from memory the node validated at put time (same host, embedded):
            their checksums need no checking again. ``False`` for what crossed a network (gRPC).
        offsets: each block's offset in the one object all the blocks' memoryviews slice (``memoryview(b).obj``,
            the get segment's mapping), bytes, or ``None`` when they view several: with them a caller views
            all the blocks as one strided array, with no copy.
    """

    __slots__ = ("blocks", "expires_at", "checked", "offsets", "_releases")

    def __init__(self, blocks: list[bytes | memoryview], releases: list[Callable[[], None]], expires_at: float = math.inf, *,
                 checked: bool = False, offsets: list[int] | None = None) -> None:
        self.blocks = blocks
        self.expires_at = expires_at
        self.checked = checked
        self.offsets = offsets
        self._releases = releases

    @classmethod
    def merge(cls, blocks: list[bytes | memoryview], leases: Sequence[BlockLease | None]) -> BlockLease:
        """One lease of the merged blocks of several nodes' leases (checked only if every one is; no offsets)."""
        held = [lease for lease in leases if lease is not None]
        return cls(blocks, [r for lease in held for r in lease._releases],
                   min((lease.expires_at for lease in held), default=math.inf),
                   checked=bool(held) and all(lease.checked for lease in held))

    def valid(self) -> bool:
        """Whether the lease is still in force now, by this client's clock (its views hold what the node wrote)."""
        return time.monotonic() <= self.expires_at

    def release(self) -> None:
        """Give the blocks back; the views must not be used afterwards. Idempotent."""
        releases, self._releases = self._releases, []
        for release in releases:
            release()

    def __enter__(self) -> list[bytes | memoryview]:
        return self.blocks

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __len__(self) -> int:
        return len(self.blocks)
