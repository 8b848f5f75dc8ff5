"""The event log: a bounded queue the store's index appends to and the publisher takes batches from.

The store never calls out (``docs/events.md``; STYLE: "events and metrics are
pulled"): its index tells an :class:`EventLog` what changed, one cheap append
per block on the store's loop, and the publisher's thread takes what is there
(:meth:`EventLog.take`), turns it into :mod:`kvstore.events.schema` events and
sends them. When the publisher falls behind and the log is full, the log drops
(and counts) everything until the publisher has taken what it holds, then puts
an ``AllBlocksCleared(reason="overflow")`` in the stream: a subscriber forgets
what it knew rather than keep a view with holes in it.

On a node with tokens each record also carries its **route**, the tenant its
namespace belongs to (``kvstore.events.access``), looked up when the change
happens (:meth:`EventLog.set_routes`): so the publisher sends each event to the
streams of that tenant, whatever the node learns or forgets about the namespace
later.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Protocol, Sequence

from kvstore.events.schema import (
    CLEARED_NAMESPACE,
    CLEARED_OVERFLOW,
    CLEARED_START,
    REMOVED_CLEARED,
    REMOVED_DELETED,
    REMOVED_EVICTED,
    REMOVED_LOST,
    REMOVED_MOVED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey

NO_TENANT = 0
"""The route of a namespace used by none of the tenants the tokens name (only a token of every tenant reads it)."""
EVERY_STREAM = 0xFFFF
"""The route of the node's own events (its start, an overflow): every stream gets them."""

DEFAULT_MAX_EVENTS = 1_000_000
"""Block events the log holds before it drops (``events.max_queue_events``): about 100 MB at worst."""

_STORED, _REMOVED, _CLEARED = 0, 1, 2
_HEADER = 5
"""Bytes before the key in a queued record: kind, tier level + 1, code (the move's source + 1, or a reason's index),
and the route (two bytes, big-endian: :data:`NO_TENANT`, a tenant's number, :data:`EVERY_STREAM`).

A record is one ``bytes`` (header + key), not a tuple: bytes are not tracked by the
garbage collector, so a full log does not make the store's process collect more often."""


class StoreObserver(Protocol):
    """What the store's index tells about changes to the local tiers (``kvstore.store.index.Index.observer``).

    Every call runs on the store's loop, synchronously, inside the step that
    made the change; none may block or raise.
    """

    def bind(self, tier_names: Sequence[str]) -> None:
        """The names of the local tiers, fastest first (the store calls this once, as it is built)."""

    def stored(self, level: int, key: BlockKey) -> None:
        """Block ``key`` became resident in local tier ``level`` (a put, a move's arrival, a restart)."""

    def removed(self, level: int, key: BlockKey, reason: str) -> None:
        """Block ``key`` left local tier ``level``; ``reason`` is a ``REMOVED_*`` constant of the schema."""

    def cleared(self, tag: bytes) -> None:
        """The namespace of ``tag`` is being cleared (its blocks' ``removed`` calls follow)."""


class EventLog:
    """A :class:`StoreObserver` that queues what it is told, bounded, for a publisher on another thread.

    The first event is ``AllBlocksCleared(reason="start")``: a node that
    restarts is announced as a clear, and the blocks it restores from disk
    follow as ``BlockStored``.

    Args:
        max_events: block events held before the log drops them (counted in :attr:`num_dropped`).

    Attributes:
        num_dropped: block events dropped because the log was full (read from any thread).
        num_overflows: times the log overflowed (each announced as one clear).
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be > 0, got {max_events}")
        self._max_events = max_events
        self._reasons: list[str] = [REMOVED_EVICTED, REMOVED_MOVED, REMOVED_DELETED, REMOVED_CLEARED, REMOVED_LOST,
                                    CLEARED_START, CLEARED_NAMESPACE]  # a record's code indexes these
        self._headers: dict[tuple[int, int, int, int], bytes] = {}
        self._routes: dict[bytes, int] = {}  # namespace tag -> route; empty: every record's route is NO_TENANT
        self._queue: deque[bytes] = deque()
        self._queue.append(self._header(_CLEARED, -1, self._reasons.index(CLEARED_START), EVERY_STREAM))
        self._moving: dict[BlockKey, int] = {}  # keys removed by a move, by the tier they left, until they arrive
        self._overflowed = False
        self._take_lock = threading.Lock()
        self._tier_names: tuple[str, ...] = ()
        self._waker: Callable[[], None] | None = None
        self.num_dropped = 0
        self.num_overflows = 0

    def bind(self, tier_names: Sequence[str]) -> None:
        """Name the local tiers, fastest first (the store calls this once); the events' ``medium``."""
        self._tier_names = tuple(tier_names)

    def set_routes(self, routes: dict[bytes, int]) -> None:
        """Route each change by ``routes`` (namespace tag -> route, ``kvstore.server.tenants``; a tag not in it:
        ``NO_TENANT``), read when the change is recorded. The owner keeps the dict up to date, on the store's loop."""
        self._routes = routes

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker()`` (on the store's loop, must not block) when an event arrives in an empty log, so the
        publisher sleeps while there is nothing to send instead of polling."""
        self._waker = waker

    # ------------------------------------------------------------------ the store's side (its loop)

    def stored(self, level: int, key: BlockKey) -> None:
        """See :meth:`StoreObserver.stored`."""
        queue = self._queue  # _append inlined: this runs once per stored block, on the store's loop
        if self._overflowed or len(queue) >= self._max_events:
            if self._moving:
                self._moving.pop(key, None)
            self._drop()
            return
        if not queue and self._waker is not None:
            self._waker()
        source = self._moving.pop(key, -1) if self._moving else -1
        routes = self._routes
        route = routes.get(key[:NAMESPACE_TAG_BYTES], NO_TENANT) if routes else NO_TENANT
        header = (self._headers.get((_STORED, level, source + 1, route))
                  or self._header(_STORED, level, source + 1, route))
        queue.append(header + key)

    def removed(self, level: int, key: BlockKey, reason: str) -> None:
        """See :meth:`StoreObserver.removed`."""
        if reason == REMOVED_MOVED:
            if len(self._moving) > 65536:  # a move whose arrival never came (it cannot, but stay bounded)
                self._moving.clear()
            self._moving[key] = level
        self._append(self._header(_REMOVED, level, self._reason_code(reason), self._route(key)) + key)

    def cleared(self, tag: bytes) -> None:
        """See :meth:`StoreObserver.cleared`."""
        self._append(self._header(_CLEARED, -1, self._reason_code(CLEARED_NAMESPACE), self._route(tag)) + bytes(tag))

    def _route(self, key: bytes) -> int:
        """The route of a key's (or a tag's) namespace now."""
        routes = self._routes
        return routes.get(bytes(key[:NAMESPACE_TAG_BYTES]), NO_TENANT) if routes else NO_TENANT

    def _reason_code(self, reason: str) -> int:
        try:
            return self._reasons.index(reason)
        except ValueError:  # a reason added later: give it a code (at most 256 of them)
            if len(self._reasons) >= 256:
                return 0
            self._reasons.append(reason)
            return len(self._reasons) - 1

    def _header(self, kind: int, level: int, code: int, route: int) -> bytes:
        """The record header of ``kind`` in tier ``level`` (-1: none) with ``code`` and ``route``, cached."""
        header = self._headers.get((kind, level, code, route))
        if header is None:
            if len(self._headers) >= 65536:  # one per kind, tier, code and tenant: never near this, but bounded
                self._headers.clear()
            header = self._headers[(kind, level, code, route)] = bytes(
                (kind, (level + 1) & 0xFF, code & 0xFF, route >> 8, route & 0xFF))
        return header

    def _drop(self) -> None:
        if not self._overflowed:
            self._overflowed = True
            self.num_overflows += 1
        self.num_dropped += 1

    def _append(self, item: bytes) -> None:
        queue = self._queue
        if self._overflowed or len(queue) >= self._max_events:
            self._drop()
            return
        if not queue and self._waker is not None:
            self._waker()
        queue.append(item)

    # ------------------------------------------------------------------ the publisher's side (any one thread)

    def __len__(self) -> int:
        """Block events waiting to be taken."""
        return len(self._queue)

    def take(self, max_items: int = 8192) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Up to ``max_items`` queued changes, oldest first, as schema events (runs of like blocks in one event).

        Safe to call from a thread other than the store's, one caller at a
        time. After an overflow, once the queue is empty, the last event is
        ``AllBlocksCleared(reason="overflow")`` and the log takes events again.
        """
        return [event for _, event in self.take_routed(max_items)]

    def take_routed(self, max_items: int = 8192) -> list[tuple[int, BlockStored | BlockRemoved | AllBlocksCleared]]:
        """:meth:`take`, each event with its route (:data:`NO_TENANT`, a tenant's number from
        ``kvstore.events.access``, or :data:`EVERY_STREAM` for the node's own events)."""
        with self._take_lock:
            queue = self._queue
            raw = []
            popleft = queue.popleft
            for _ in range(min(max_items, len(queue))):
                raw.append(popleft())
            events = self._events(raw)
            if self._overflowed and not queue:
                self._overflowed = False  # drops before this point are covered by the clear below
                events.append((EVERY_STREAM, AllBlocksCleared(reason=CLEARED_OVERFLOW)))
            return events

    def _events(self, raw: list[bytes]) -> list[tuple[int, BlockStored | BlockRemoved | AllBlocksCleared]]:
        """Routed schema events of queued records: consecutive ones of one kind, tier, code, route and namespace
        merge."""
        events: list[tuple[int, BlockStored | BlockRemoved | AllBlocksCleared]] = []
        names = self._tier_names
        reasons = self._reasons
        group = _HEADER + NAMESPACE_TAG_BYTES  # header and tag: the bytes a run shares
        last = b""
        hashes: list[bytes] = []
        for item in raw:
            kind = item[0]
            route = (item[3] << 8) | item[4]
            if kind == _CLEARED:
                events.append((route, AllBlocksCleared(namespace=item[_HEADER:], reason=reasons[item[2]])))
                last = b""
                continue
            head = item[:group]
            if head == last:
                hashes.append(item[group:])
                continue
            last = head
            hashes = [item[group:]]
            level, tag = item[1] - 1, item[_HEADER:group]
            medium = names[level] if 0 <= level < len(names) else str(level)
            if kind == _STORED:
                source = item[2] - 1
                events.append((route, BlockStored(
                    block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                    medium=medium, lora_name=None, namespace=tag,
                    from_medium=(names[source] if source < len(names) else str(source)) if source >= 0 else None)))
            else:
                events.append((route, BlockRemoved(block_hashes=hashes, medium=medium, namespace=tag,
                                                   reason=reasons[item[2]])))
        return events
