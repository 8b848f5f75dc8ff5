"""The connector's KV events: vLLM ``BlockStored`` for the blocks it saves to kvstore, and ``BlockRemoved`` when
the node lets them go, published through vLLM's own event publisher (``docs/events.md``).

vLLM asks the scheduler's connector for events every step (``take_events``) and
publishes them with its own (``--kv-events-config``), so a router that indexes
vLLM's events sees kvstore's blocks with no new consumer. They carry vLLM's
block hashes (``Request.block_hashes``, converted as vLLM converts its own with
``maybe_convert_block_hash``), the tokens, and ``medium="kvstore:<tier>"``.

Where the connector's settings name the node's event stream (``events_target``,
its ``events.endpoint``), the connector follows it on a thread of its own
(:class:`~kvstore.events.subscriber.EventSubscriber`): a saved block is announced
once the node reports it stored, with the node's tier, and ``BlockRemoved`` follows
when the node evicts, deletes or clears it, or restarts. Without it, a saved block
is announced when its save is planned (``medium="kvstore"``) and never removed.

A block the node moves between tiers (a demotion or a promotion) changes
``medium``; vLLM's schema has no move, so the connector sends what a router
indexing by ``(hash, medium)`` needs: ``BlockRemoved`` in the old medium, then
``BlockStored`` (the same hashes, parent and tokens) in the new one. With tensor
or pipeline parallelism every rank saves its own shard under its own namespace:
a vLLM block is in kvstore once every rank's shard is stored, it is removed as
soon as one of them is, and its ``medium`` is the first rank's shard's.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

logger = logging.getLogger(__name__)

MEDIUM_PREFIX = "kvstore"
"""The ``medium`` of kvstore's blocks in vLLM's events: ``kvstore:<tier>`` (``kvstore`` when the tier is unknown)."""

OWNERSHIP = "kvstore"
"""vLLM's ``ownership`` field (the secondary tier that generated the event)."""

MAX_TRACKED_BLOCKS = 1 << 20
"""kvstore blocks the connector remembers; past it the oldest is announced removed and forgotten (never stale)."""


@dataclass(slots=True)
class _Saved:
    """One kvstore block the engine saved (every rank's shard of it): the vLLM blocks it holds, their event."""

    vllm_hashes: list[Any]
    order: int  # when its save was planned: a request's blocks in prefix order, parents first
    keys: tuple[bytes, ...]  # each rank's ``tag + hash``, the first rank's first
    stored: BlockStored  # its BlockStored without tokens (a template: ``medium`` and the tokens are set per send)
    tokens: array  # its tokens, compactly ("l"): a move announces the block again
    medium: str | None = None  # announced in this medium; None: not announced (not every shard is stored yet)
    waiting: set[bytes] = field(default_factory=set)  # keys the node has not reported stored yet
    first_medium: str | None = None  # where the node holds the first rank's shard

    def event(self) -> BlockStored:
        """Its ``BlockStored`` in :attr:`medium`, with its tokens."""
        return msgspec.structs.replace(self.stored, medium=self.medium, token_ids=self.tokens.tolist())


class ConnectorEvents:
    """vLLM events for kvstore's blocks, from the scheduler's side of the connector (module docstring).

    Args:
        vllm_block_size: tokens per vLLM block.
        block_size: tokens per kvstore block (a multiple of ``vllm_block_size``).
        events_target: the node's ``events.endpoint`` to follow; ``""``: announce at save time, never remove.
        events_replay: its replay endpoint (``""``: derived as the node derives it; ``off``: none).
        max_tracked_blocks: kvstore blocks remembered at most.
    """

    def __init__(self, vllm_block_size: int, block_size: int, *, events_target: str = "", events_replay: str = "",
                 max_tracked_blocks: int = MAX_TRACKED_BLOCKS) -> None:
        self._vllm_block_size = vllm_block_size
        self._ratio = block_size // vllm_block_size
        self._lock = threading.Lock()
        self._pending: deque[KVCacheEvent] = deque()
        self._saved: OrderedDict[bytes, _Saved] = OrderedDict()
        self._max_tracked = max_tracked_blocks
        self._order = 0
        self._follows = bool(events_target)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if events_target:
            from kvstore.events.publisher import replay_address

            self._thread = threading.Thread(target=self._follow, name="kvstore-connector-events", daemon=True,
                                            args=(events_target, replay_address(events_target, events_replay)))
            self._thread.start()

    # ------------------------------------------------------------------ the scheduler's side

    def saved(self, request: Any, namespace_tags: Sequence[bytes], first_block: int,
              kvstore_hashes: Sequence[Sequence[bytes]]) -> None:
        """A save of kvstore blocks ``[first_block, first_block + n)`` of ``request`` was planned, on every rank.

        Args:
            request: vLLM's ``Request`` (its ``block_hashes``, ``all_token_ids`` and ``lora_request``).
            namespace_tags: the kvstore namespace's tag of each rank (scheduler order; one for TP = PP = 1).
            first_block: index of the first kvstore block in the request.
            kvstore_hashes: per rank (as ``namespace_tags``), the blocks' kvstore hashes, in order (``n`` each).

        Raises:
            ValueError: if ``namespace_tags`` and ``kvstore_hashes`` differ in length.
        """
        if len(namespace_tags) != len(kvstore_hashes):
            raise ValueError(f"{len(namespace_tags)} namespace tags for {len(kvstore_hashes)} ranks' hashes")
        if not kvstore_hashes:
            return
        vllm_hashes = list(getattr(request, "block_hashes", None) or ())
        lora = getattr(request, "lora_request", None)
        ratio, size = self._ratio, self._vllm_block_size
        with self._lock:
            for i in range(len(kvstore_hashes[0])):
                start, end = (first_block + i) * ratio, (first_block + i + 1) * ratio
                if end > len(vllm_hashes):
                    break  # vLLM hashes only full blocks, and only with prefix caching on
                hashes = [maybe_convert_block_hash(h) for h in vllm_hashes[start:end]]
                tokens = request.all_token_ids[start * size:end * size]
                event = BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=maybe_convert_block_hash(vllm_hashes[start - 1]) if start else None,
                    token_ids=list(tokens) if not self._follows else [], block_size=size,
                    lora_id=lora.adapter_id if lora else None, medium=MEDIUM_PREFIX,
                    lora_name=lora.name if lora else None, group_idx=0, locality="REMOTE", ownership=OWNERSHIP)
                if not self._follows:
                    self._pending.append(event)
                    continue
                keys = tuple(bytes(tag) + bytes(chain[i]) for tag, chain in zip(namespace_tags, kvstore_hashes))
                if keys[0] in self._saved:
                    continue
                self._order += 1
                record = _Saved(hashes, self._order, keys, event, array("l", tokens), waiting=set(keys))
                for key in keys:
                    self._saved[key] = record
                self._trim()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order (vLLM's ``take_events``)."""
        with self._lock:
            events = list(self._pending)
            self._pending.clear()
        return events

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop following the node."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _trim(self) -> None:
        """Forget the oldest blocks past the bound (counted in shards), each announced removed."""
        while len(self._saved) > self._max_tracked:
            _, oldest = self._saved.popitem(last=False)
            self._forget(oldest)

    def _forget(self, record: _Saved) -> None:
        """Drop every rank's key of ``record`` and announce it removed (if it was announced)."""
        for key in record.keys:
            self._saved.pop(key, None)
        self._announce_removed(record)

    def _announce_removed(self, saved: _Saved) -> None:
        if saved.medium is not None:
            self._pending.append(BlockRemoved(block_hashes=saved.vllm_hashes, medium=saved.medium, group_idx=0,
                                              locality="REMOTE", ownership=OWNERSHIP))
            saved.medium = None

    # ------------------------------------------------------------------ the node's stream (a thread)

    def _follow(self, endpoint: str, replay: str | None) -> None:
        from kvstore.events.subscriber import EventStreamError, EventSubscriber

        with EventSubscriber(endpoint, replay, topic="", from_seq=None) as subscriber:
            missed = 0
            while not self._stop.is_set():
                try:
                    batches = subscriber.receive(0.2)
                except (EventStreamError, TimeoutError) as exc:
                    logger.warning("kvstore connector: the node's event stream %s: %s", endpoint, exc)
                    batches = []
                if subscriber.num_missed > missed:  # a hole: what the node still holds is unsure now
                    missed = subscriber.num_missed
                    self.node_event_removed_all()
                for _, batch in batches:
                    self.apply(batch.events)  # type: ignore[attr-defined]

    def apply(self, events: Sequence[Any]) -> None:
        """Turn the node's events (``kvstore.events.schema``) into vLLM events for the blocks this engine saved.

        A block whose every shard is stored is announced in its first shard's
        medium; a move of that shard to another tier re-announces it there
        (``BlockRemoved`` in the old medium, then ``BlockStored`` in the new); a
        removal of any shard (evicted, deleted, cleared, lost) announces it removed.
        """
        from kvstore.events.schema import REMOVED_MOVED, AllBlocksCleared
        from kvstore.events.schema import BlockRemoved as NodeRemoved
        from kvstore.events.schema import BlockStored as NodeStored

        with self._lock:
            saved = self._saved
            changed: dict[int, _Saved] = {}  # announced at the end of a run of stores, in prefix order
            for event in events:
                if isinstance(event, NodeStored):
                    medium = f"{MEDIUM_PREFIX}:{event.medium}"
                    for h in event.block_hashes:  # a put's blocks arrive tail first (``TieredStore.put``)
                        key = event.namespace + h
                        record = saved.get(key)
                        if record is None:
                            continue
                        record.waiting.discard(key)
                        if key == record.keys[0]:
                            record.first_medium = medium
                        if not record.waiting and record.medium != record.first_medium:
                            changed[id(record)] = record
                    continue
                if isinstance(event, NodeRemoved) and event.reason == REMOVED_MOVED:
                    continue  # its arrival in the other tier follows: still in kvstore
                self._announce_changed(changed)  # before a removal in the same batch
                if isinstance(event, NodeRemoved):
                    for h in event.block_hashes:
                        record = saved.get(event.namespace + h)
                        if record is not None:
                            self._forget(record)
                elif isinstance(event, AllBlocksCleared):
                    gone = {id(r): r for k, r in saved.items() if k.startswith(event.namespace)}  # b"": every key
                    for record in gone.values():
                        self._forget(record)
            self._announce_changed(changed)

    def _announce_changed(self, changed: dict[int, _Saved]) -> None:
        """Announce blocks newly stored, or moved to another medium: the moves' removals first, then every
        ``BlockStored`` in the order the saves were planned (a request's blocks in prefix order)."""
        records = sorted(changed.values(), key=lambda r: r.order)
        changed.clear()
        for record in records:
            self._announce_removed(record)  # a move: gone from the old medium (nothing for a first announcement)
        for record in records:
            record.medium = record.first_medium
            self._pending.append(record.event())

    def node_event_removed_all(self) -> None:
        """Announce every block this engine saved as removed and forget them (the stream had a hole)."""
        with self._lock:
            for record in {id(r): r for r in self._saved.values()}.values():
                self._announce_removed(record)
            self._saved.clear()


def open_connector_events(vllm_config: Any, settings: Any, vllm_block_size: int,
                          block_size: int) -> ConnectorEvents | None:
    """The connector's events when vLLM's ``kv_events_config`` has ``enable_kv_cache_events`` on, else ``None``.

    Args:
        vllm_config: the engine's ``VllmConfig``.
        settings: the connector's :class:`~kvstore.connectors.vllm.config.VLLMConnectorConfig`.
        vllm_block_size: tokens per vLLM block.
        block_size: tokens per kvstore block.
    """
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not events_config.enable_kv_cache_events:
        return None
    logger.info("kvstore connector: KV events on (%s)", f"following the node's stream at {settings.events_target}"
                if settings.events_target else "announced at save time; set events_target for removals")
    return ConnectorEvents(vllm_block_size, block_size, events_target=settings.events_target,
                           events_replay=settings.events_replay)
