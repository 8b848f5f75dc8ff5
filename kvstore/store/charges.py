"""What each namespace's blocks count for in a tenant's quota: the same for a block in every local tier, before
and after a restart (issue 39, item 8).

A tier's capacity bytes depend on the tier: the memory tier rounds a block up to
whole pages, the heap tier adds its overhead, LMDB rounds to its own pages and
adds its records' overhead, a compressing tier counts the compressed length. A
quota that summed them counted the same blocks 1.6-12.6 % higher after a clean
restart (the memory tier flushed into LMDB). So a block is **charged** by its
length as put (the encoded block, what a Put sends, whatever a tier does with
it), through one function for the whole store: the most capacity a block of
that length takes in any of the store's local tiers (``TieredStore``), so a
charge never counts less than what the block may take.

The index tells this which blocks are resident in some local tier and their
lengths (:meth:`NamespaceCharges.added` when a block becomes resident in a tier,
:meth:`NamespaceCharges.removed` when it leaves; a move is one of each, with the
same length). To give back a block's charge when it goes, its length must be
known then; the blocks of one namespace nearly always have one length (the
model's shape), so this keeps one length per namespace (its first block's) and
a per-block length only for the blocks whose length differs: no per-block cost
for a namespace of like blocks. Used from the store's loop only.
"""

from __future__ import annotations

from typing import Callable

from kvstore.keys import NAMESPACE_TAG_BYTES


class NamespaceCharges:
    """Charged bytes per namespace tag, of the blocks resident in local tiers (module docstring).

    Args:
        charge: bytes a block of a given length (as put) counts for; the identity when ``None``.
    """

    __slots__ = ("_charge", "_charges", "_tags", "_odd")

    def __init__(self, charge: Callable[[int], int] | None = None) -> None:
        self._charge = charge or (lambda nbytes: nbytes)
        self._charges: dict[int, int] = {}  # length -> charge, cached (a few distinct lengths)
        # tag -> [resident blocks, charged bytes, the length of (nearly) all its blocks, that length's charge]
        self._tags: dict[bytes, list[int]] = {}
        self._odd: dict[bytes, int] = {}  # key -> its length, where that is not its namespace's usual one

    def charge_of(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` (as put) counts for."""
        charge = self._charges.get(nbytes)
        if charge is None:
            if len(self._charges) >= 4096:
                self._charges.clear()
            charge = self._charges[nbytes] = self._charge(nbytes)
        return charge

    def added(self, key: bytes, nbytes: int) -> None:
        """Block ``key`` of ``nbytes`` (as put) became resident in a local tier (it was in none)."""
        tag = key[:NAMESPACE_TAG_BYTES]
        state = self._tags.get(tag)
        if state is None:
            charge = self.charge_of(nbytes)
            self._tags[tag] = [1, charge, nbytes, charge]
            return
        state[0] += 1
        if nbytes == state[2]:
            state[1] += state[3]
        else:
            self._odd[key] = nbytes
            state[1] += self.charge_of(nbytes)

    def removed(self, key: bytes) -> None:
        """Block ``key`` left the local tier it was resident in."""
        tag = key[:NAMESPACE_TAG_BYTES]
        state = self._tags.get(tag)
        if state is None:  # never added: nothing to give back
            return
        odd = self._odd.pop(key, None) if self._odd else None
        if state[0] == 1:
            del self._tags[tag]
            return
        state[0] -= 1
        state[1] -= state[3] if odd is None else self.charge_of(odd)

    def namespace_bytes(self, tag: bytes) -> int:
        """Charged bytes of the namespace of ``tag``'s resident blocks."""
        state = self._tags.get(tag)
        return state[1] if state is not None else 0

    def num_odd(self) -> int:
        """Blocks whose length is kept one by one (their namespace's blocks differ in length)."""
        return len(self._odd)
