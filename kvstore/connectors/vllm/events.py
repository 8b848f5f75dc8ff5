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
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Sequence

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
    """One kvstore block the engine saved: the vLLM blocks it holds and, until announced, their event fields."""

    vllm_hashes: list[Any]
    order: int  # when its save was planned: a request's blocks in prefix order, parents first
    medium: str | None = None  # announced in this medium; None: waiting for the node to report it stored
    stored: BlockStored | None = None  # the event to send once the node reports it


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

    def saved(self, request: Any, namespace_tag: bytes, first_block: int, kvstore_hashes: Sequence[bytes]) -> None:
        """A save of kvstore blocks ``[first_block, first_block + len(kvstore_hashes))`` of ``request`` was planned.

        Args:
            request: vLLM's ``Request`` (its ``block_hashes``, ``all_token_ids`` and ``lora_request``).
            namespace_tag: the kvstore namespace's tag the blocks are saved under (the first rank's).
            first_block: index of the first kvstore block in the request.
            kvstore_hashes: the blocks' kvstore hashes, in order.
        """
        vllm_hashes = list(getattr(request, "block_hashes", None) or ())
        lora = getattr(request, "lora_request", None)
        ratio, size = self._ratio, self._vllm_block_size
        with self._lock:
            for i, kv_hash in enumerate(kvstore_hashes):
                start, end = (first_block + i) * ratio, (first_block + i + 1) * ratio
                if end > len(vllm_hashes):
                    break  # vLLM hashes only full blocks, and only with prefix caching on
                hashes = [maybe_convert_block_hash(h) for h in vllm_hashes[start:end]]
                event = BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=maybe_convert_block_hash(vllm_hashes[start - 1]) if start else None,
                    token_ids=list(request.all_token_ids[start * size:end * size]), block_size=size,
                    lora_id=lora.adapter_id if lora else None, medium=MEDIUM_PREFIX,
                    lora_name=lora.name if lora else None, group_idx=0, locality="REMOTE", ownership=OWNERSHIP)
                key = bytes(namespace_tag) + bytes(kv_hash)
                if key in self._saved:
                    continue
                if self._follows:
                    self._order += 1
                    self._saved[key] = _Saved(hashes, self._order, stored=event)
                    self._trim()
                else:
                    self._pending.append(event)

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
        while len(self._saved) > self._max_tracked:
            _, oldest = self._saved.popitem(last=False)
            self._announce_removed(oldest)

    def _announce_removed(self, saved: _Saved) -> None:
        if saved.medium is not None:
            self._pending.append(BlockRemoved(block_hashes=saved.vllm_hashes, medium=saved.medium, group_idx=0,
                                              locality="REMOTE", ownership=OWNERSHIP))

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
        """Turn the node's events (``kvstore.events.schema``) into vLLM events for the blocks this engine saved."""
        from kvstore.events.schema import REMOVED_MOVED, AllBlocksCleared
        from kvstore.events.schema import BlockRemoved as NodeRemoved
        from kvstore.events.schema import BlockStored as NodeStored

        with self._lock:
            saved = self._saved
            arrived: list[_Saved] = []  # announced at the end of the batch, parents first
            for event in events:
                if isinstance(event, NodeStored):
                    for h in event.block_hashes:  # a put's blocks arrive tail first (``TieredStore.put``)
                        record = saved.get(event.namespace + h)
                        if record is not None and record.stored is not None:
                            record.medium = record.stored.medium = f"{MEDIUM_PREFIX}:{event.medium}"
                            arrived.append(record)
                    continue
                if isinstance(event, NodeRemoved) and event.reason == REMOVED_MOVED:
                    continue  # its arrival follows: still in kvstore
                self._announce_stored(arrived)  # before a removal in the same batch
                arrived = []
                if isinstance(event, NodeRemoved):
                    for h in event.block_hashes:
                        record = saved.pop(event.namespace + h, None)
                        if record is not None:
                            self._announce_removed(record)
                elif isinstance(event, AllBlocksCleared):
                    gone = [k for k in saved if k.startswith(event.namespace)]  # b"": every key
                    for key in gone:
                        self._announce_removed(saved.pop(key))
            self._announce_stored(arrived)

    def _announce_stored(self, arrived: list[_Saved]) -> None:
        """Queue the ``BlockStored`` of blocks the node reported stored, in the order their saves were planned."""
        for record in sorted(arrived, key=lambda r: r.order):  # a request's blocks in prefix order
            if record.stored is not None:
                self._pending.append(record.stored)
                record.stored = None  # its tokens are not kept

    def node_event_removed_all(self) -> None:
        """Announce every block this engine saved as removed and forget them (the stream had a hole)."""
        with self._lock:
            for record in self._saved.values():
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
