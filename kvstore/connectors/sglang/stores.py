"""The SGLang backend's counts, and the one call it makes beyond :class:`~kvstore.api.BlockClient` (``clear``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

from kvstore.keys import Namespace


@dataclass(slots=True)
class StorageCounters:
    """What one backend did since it opened (a rank's view; the nodes count their own as usual).

    Attributes:
        hit_pages: pages a read copied into the host pool.
        miss_pages: pages a read or an existence check asked for past the stored prefix.
        read_bytes: payload bytes copied into the host pool.
        written_pages: pages a write handed to the store.
        written_bytes: payload bytes of those pages.
        errors: store calls that failed (each also starts a backoff).
        skipped_calls: calls answered without the store because it was down (a backoff).
    """

    hit_pages: int = 0
    miss_pages: int = 0
    read_bytes: int = 0
    written_pages: int = 0
    written_bytes: int = 0
    errors: int = 0
    skipped_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every count by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CounterBox:
    """:class:`StorageCounters` behind a lock: SGLang's prefetch and backup threads call the backend at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = StorageCounters()

    def add(self, **deltas: int) -> None:
        """Add to the named counts."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + delta)

    def snapshot(self) -> StorageCounters:
        """A copy of the counts now."""
        with self._lock:
            return StorageCounters(**self._counts.as_dict())


def clear_namespace(store: object, namespace: Namespace) -> int:
    """Delete every page of ``namespace`` (``clear`` of the embedded store or the client); returns how many."""
    clear = getattr(store, "clear")
    return int(clear(namespace))
