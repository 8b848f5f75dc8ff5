"""Deletes that background copies must respect: a copy begun before a delete never brings the block back.

The store copies blocks to and from the shared tier in the background: a
write-through put sends its blocks to Redis after placing them, a hit in Redis
is promoted into memory after the read, and an eviction from the last local
tier demotes into Redis. A delete (or a namespace clear) that runs while such a
copy is in flight could otherwise lose the race: its DEL reaches Redis before
the copy's SET, or the promotion publishes a block the delete has just removed.

Each copy opens a window with :meth:`Tombstones.begin` and closes it with
:meth:`Tombstones.end`; before it publishes a block, and after it has written
one to the shared tier, it asks :meth:`Tombstones.deleted_since`. Deletes are
recorded only while some window is open, and a record is dropped as soon as no
window that began before it is still open, so the memory held is bounded by
the deletes that overlap copies in flight.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey


class Tombstones:
    """The deletes and namespace clears seen since each open copy window began (one store, one event loop).

    Epochs count deletes: :meth:`begin` returns the current one, and every
    :meth:`record_delete` or :meth:`record_clear` starts a new one, so a block
    was deleted since a window began exactly when its record's epoch is later.
    """

    def __init__(self) -> None:
        self._epoch = 0
        self._open: Counter[int] = Counter()  # epoch a window began at -> windows still open from it
        self._keys: dict[BlockKey, int] = {}  # block key -> epoch of its latest delete
        self._tags: dict[bytes, int] = {}  # namespace tag -> epoch of its latest clear

    def begin(self) -> int:
        """Open a copy window; returns its epoch, for :meth:`deleted_since` and :meth:`end`."""
        self._open[self._epoch] += 1
        return self._epoch

    def end(self, epoch: int) -> None:
        """Close a window opened by :meth:`begin`, dropping the records no open window needs.

        Raises:
            KeyError: if no window of ``epoch`` is open.
        """
        left = self._open[epoch] - 1
        if left < 0:
            raise KeyError(f"no copy window of epoch {epoch} is open")
        if left:
            self._open[epoch] = left
            return
        del self._open[epoch]
        if not self._open:
            self._keys.clear()
            self._tags.clear()
            return
        oldest = min(self._open)
        if epoch < oldest:  # the oldest window closed: records up to the next one concern no open window
            self._keys = {k: e for k, e in self._keys.items() if e > oldest}
            self._tags = {t: e for t, e in self._tags.items() if e > oldest}

    def record_delete(self, keys: Iterable[BlockKey]) -> None:
        """Note that ``keys`` are being deleted; call when the delete starts and again when it has finished."""
        self._epoch += 1
        if self._open:
            epoch = self._epoch
            for key in keys:
                self._keys[key] = epoch

    def record_clear(self, tag: bytes) -> None:
        """Note that every block of the namespace tagged ``tag`` is being deleted (at the start and at the end)."""
        self._epoch += 1
        if self._open:
            self._tags[tag] = self._epoch

    def deleted_since(self, key: BlockKey, epoch: int) -> bool:
        """Whether ``key`` was deleted, or its namespace cleared, after the window of ``epoch`` began."""
        return self._keys.get(key, -1) > epoch or self._tags.get(key[:NAMESPACE_TAG_BYTES], -1) > epoch

    def __len__(self) -> int:
        """Records held: deleted keys and cleared namespaces."""
        return len(self._keys) + len(self._tags)
