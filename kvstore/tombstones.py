"""Deletes that background copies must respect: a copy begun before a delete never brings the block back.

The store copies blocks to and from the shared tier in the background: a
write-through put sends its blocks to Redis after placing them, a hit in Redis
is promoted into memory after the read, and an eviction from the last local
tier demotes into Redis. A delete (or a namespace clear) that runs while such a
copy is in flight could otherwise lose the race: its DEL reaches Redis before
the copy's SET, or the promotion publishes a block the delete has just removed.

Each copy opens a window with :meth:`Tombstones.begin` and closes it with
:meth:`Tombstones.end`; before it publishes a block, and after it has written
one to the shared tier, it asks :meth:`Tombstones.deleted_since`. A put's
placement opens a window too, and asks :meth:`Tombstones.delete_began_since`:
a delete that began before the put did is over for it (the put is the newer,
and a delete forgets its blocks before any await). Deletes are recorded when
they begin and again when they end, which for a delete from the shared tier is
when its DEL has landed; a copy asking meanwhile is told the block is deleted
(it may have read it before the DEL). Records are kept only while some window
is open, and a record is dropped as soon as no window that began before it is
still open, so the memory held is bounded by the deletes that overlap copies
in flight, and by the deletes in progress.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable, TypeVar

from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey


_K = TypeVar("_K", bound=Hashable)

_NONE = (-1, -1)
"""The record of a key or tag never deleted while a window was open."""


class Tombstones:
    """The deletes and namespace clears seen since each open copy window began (one store, one event loop).

    Epochs count deletes: :meth:`begin` returns the current one, and every
    :meth:`record_delete` or :meth:`record_clear` starts a new one, so a block
    was deleted since a window began exactly when its record's epoch is later.
    """

    def __init__(self) -> None:
        self._epoch = 0
        self._open: Counter[int] = Counter()  # epoch a window began at -> windows still open from it
        # block key -> (epoch its latest delete began, epoch of its latest record); namespace tags alike, for clears
        self._keys: dict[BlockKey, tuple[int, int]] = {}
        self._tags: dict[bytes, tuple[int, int]] = {}
        self._deleting: Counter[BlockKey] = Counter()  # deletes in progress, by key
        self._clearing: Counter[bytes] = Counter()  # clears in progress, by namespace tag

    def begin(self) -> int:
        """Open a copy window; returns its epoch, for :meth:`deleted_since` and :meth:`end`."""
        self._open[self._epoch] += 1
        return self._epoch

    def share(self, epoch: int) -> None:
        """Open one more window of ``epoch``, which must still be open: for a task that takes over part of a
        copy and outlives it; it closes its own with :meth:`end`.

        Raises:
            KeyError: if no window of ``epoch`` is open.
        """
        if not self._open[epoch]:
            del self._open[epoch]
            raise KeyError(f"no copy window of epoch {epoch} is open")
        self._open[epoch] += 1

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
            self._keys = {k: e for k, e in self._keys.items() if e[1] > oldest}
            self._tags = {t: e for t, e in self._tags.items() if e[1] > oldest}

    def record_delete(self, keys: Iterable[BlockKey], *, ended: bool = False) -> None:
        """Note that a delete of ``keys`` begins, or (``ended``) has ended; every delete calls both, in turn.

        Raises:
            KeyError: on an end with no delete of a key in progress.
        """
        self._epoch += 1
        keys = list(keys)
        _count(self._deleting, keys, -1 if ended else 1)
        if self._open:
            epoch = self._epoch
            records = self._keys
            for key in keys:
                records[key] = (records.get(key, _NONE)[0] if ended else epoch, epoch)

    def record_clear(self, tag: bytes, *, ended: bool = False) -> None:
        """Note that a clear of the namespace tagged ``tag`` begins, or has ended (as :meth:`record_delete`)."""
        self._epoch += 1
        _count(self._clearing, [tag], -1 if ended else 1)
        if self._open:
            self._tags[tag] = (self._tags.get(tag, _NONE)[0] if ended else self._epoch, self._epoch)

    def deleted_since(self, key: BlockKey, epoch: int) -> bool:
        """Whether ``key`` was deleted, or its namespace cleared, after the window of ``epoch`` began, or is
        being deleted now (what a copy asks: it may have read the block before the delete ended)."""
        tag = key[:NAMESPACE_TAG_BYTES]
        return (key in self._deleting or tag in self._clearing
                or self._keys.get(key, _NONE)[1] > epoch or self._tags.get(tag, _NONE)[1] > epoch)

    def delete_began_since(self, key: BlockKey, epoch: int) -> bool:
        """Whether a delete of ``key``, or a clear of its namespace, began after the window of ``epoch`` began
        (what a put's placement asks: it lost to such a delete, and wins over one that began before it)."""
        return self._keys.get(key, _NONE)[0] > epoch or self._tags.get(key[:NAMESPACE_TAG_BYTES], _NONE)[0] > epoch

    def __len__(self) -> int:
        """Records held, deleted keys and cleared namespaces, and deletes and clears in progress."""
        return len(self._keys) + len(self._tags) + len(self._deleting) + len(self._clearing)


def _count(counts: Counter[_K], items: Iterable[_K], step: int) -> None:
    """Add ``step`` to each item's count, dropping an item whose count reaches zero.

    Raises:
        KeyError: if a count would go below zero.
    """
    for item in items:
        left = counts[item] + step
        if left < 0:
            raise KeyError(f"no delete of {item!r} is in progress")
        if left:
            counts[item] = left
        else:
            del counts[item]
