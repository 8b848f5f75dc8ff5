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

import functools
import logging
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

if TYPE_CHECKING:
    from kvstore.events.discovery import EventStream

logger = logging.getLogger(__name__)

MEDIUM_PREFIX = "kvstore"
"""The ``medium`` of kvstore's blocks in vLLM's events: ``kvstore:<tier>`` (``kvstore`` when the tier is unknown)."""

OWNERSHIP = "kvstore"
"""vLLM's ``ownership`` field (the secondary tier that generated the event)."""

MAX_TRACKED_BLOCKS = 1 << 20
"""kvstore blocks (shards, with TP/PP) the connector remembers; past it the oldest is announced removed and
forgotten (never stale). Each keeps its tokens (4 bytes each) to announce it again when it moves tier: about
64 MiB of tokens at this bound with blocks of 16 tokens, plus a few hundred bytes of record per block."""


@dataclass(slots=True)
class _Saved:
    """One kvstore block the engine saved (every rank's shard of it): the vLLM blocks it holds, their event."""

    vllm_hashes: list[Any]
    order: int  # when its save was planned: a request's blocks in prefix order, parents first
    keys: tuple[bytes, ...]  # each rank's ``tag + hash``, the first rank's first
    stored: BlockStored  # its BlockStored without tokens (a template: ``medium`` and the tokens are set per send)
    tokens: array[int]  # its tokens, 4 bytes each (``_compact``): a move announces the block again
    medium: str | None = None  # announced in this medium; None: not announced (not every shard is stored yet)
    waiting: set[bytes] = field(default_factory=set)  # keys the node has not reported stored yet
    first_medium: str | None = None  # where the node holds the first rank's shard

    def event(self) -> BlockStored:
        """Its ``BlockStored`` in :attr:`medium`, with its tokens."""
        return msgspec.structs.replace(self.stored, medium=self.medium, token_ids=self.tokens.tolist())


def _compact(tokens: Sequence[int]) -> array[int]:
    """Token ids as an array of 4-byte unsigned ints (8-byte signed for ids that do not fit)."""
    try:
        return array("I", tokens)
    except OverflowError:
        return array("q", tokens)


class ConnectorEvents:
    """vLLM events for kvstore's blocks, from the scheduler's side of the connector (module docstring).

    Args:
        vllm_block_size: tokens per vLLM block.
        block_size: tokens per kvstore block (a multiple of ``vllm_block_size``).
        events_target: the node's ``events.endpoint`` to follow; ``""``: the streams ``streams`` finds, or none.
        events_replay: its replay endpoint (``""``: derived as the node derives it; ``off``: none).
        events_token: the bearer token to subscribe to ``events_target`` with (a node with tokens sends
            the events of the tenants it covers: ``kvstore.events.access``); ``None`` for a node without.
        streams: finds the nodes' streams (``kvstore.events.discovery``: each node's ``Capabilities``), on the
            following thread; raises while a node cannot be asked (retried, backing off). When it finds none,
            blocks are announced at save time and never removed, as with neither setting.
        max_tracked_blocks: kvstore blocks (shards, with TP/PP) remembered at most.
    """

    def __init__(self, vllm_block_size: int, block_size: int, *, events_target: str = "", events_replay: str = "",
                 events_token: str | None = None, streams: Callable[[], list[EventStream]] | None = None,
                 max_tracked_blocks: int = MAX_TRACKED_BLOCKS) -> None:
        self._vllm_block_size = vllm_block_size
        self._ratio = block_size // vllm_block_size
        self._lock = threading.Lock()
        self._pending: deque[KVCacheEvent] = deque()
        self._saved: OrderedDict[bytes, _Saved] = OrderedDict()
        self._max_tracked = max_tracked_blocks
        self._order = 0
        self._stream_keys: dict[int, set[bytes]] = {}  # per followed stream, the keys it reported stored
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if events_target:
            from kvstore.events.discovery import EventStream
            from kvstore.events.publisher import replay_address

            named = EventStream(events_target, replay_address(events_target, events_replay), "", events_token)
            streams = lambda: [named]  # noqa: E731
        self._follows = streams is not None
        if streams is not None:
            self._thread = threading.Thread(target=self._follow, name="kvstore-connector-events", daemon=True,
                                            args=(streams,))
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
                record = _Saved(hashes, self._order, keys, event, _compact(tokens), waiting=set(keys))
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
            for keys in self._stream_keys.values():
                keys.discard(key)
        self._announce_removed(record)

    def _announce_removed(self, saved: _Saved) -> None:
        if saved.medium is not None:
            self._pending.append(BlockRemoved(block_hashes=saved.vllm_hashes, medium=saved.medium, group_idx=0,
                                              locality="REMOTE", ownership=OWNERSHIP))
            saved.medium = None

    # ------------------------------------------------------------------ the node's stream (a thread)

    def _follow(self, streams: Callable[[], list[EventStream]]) -> None:
        from kvstore.events.schema import KVEventBatch
        from kvstore.events.subscriber import EventStreamError, EventSubscriber

        backoff_s = 1.0
        while True:
            try:
                found = streams()
                break
            except Exception as exc:  # noqa: BLE001 - a node that is down now: ask again
                logger.warning("kvstore connector: cannot ask the nodes for their event streams (again in %.0f s): "
                               "%s", backoff_s, exc)
                if self._stop.wait(backoff_s):
                    return
                backoff_s = min(30.0, backoff_s * 2)
        if not found:
            logger.info("kvstore connector: the nodes publish no events: blocks are announced at save time and "
                        "never removed (set events.endpoint on the nodes)")
            self._stop_following()
            return
        logger.info("kvstore connector: following the nodes' events at %s", ", ".join(s.endpoint for s in found))
        subscribers = [EventSubscriber(s.endpoint, s.replay_endpoint, topic=s.topic, from_seq=None, token=s.token)
                       for s in found]
        try:
            missed = [0] * len(subscribers)
            while not self._stop.is_set():
                for i, subscriber in enumerate(subscribers):
                    try:
                        batches = subscriber.receive(0.2 / len(subscribers))
                    except (EventStreamError, TimeoutError) as exc:
                        logger.warning("kvstore connector: the node's event stream %s: %s", found[i].endpoint, exc)
                        batches = []
                    if subscriber.num_missed > missed[i]:  # a hole: what the node still holds is unsure now
                        missed[i] = subscriber.num_missed
                        self.node_event_removed_all(i)
                    for _, batch in batches:
                        self.apply(batch.events, i)
        finally:
            for subscriber in subscribers:
                subscriber.close()

    def _stop_following(self) -> None:
        """No stream to follow: announce what waits (in medium ``kvstore``) and announce at save time from now."""
        with self._lock:
            self._follows = False
            for record in sorted({id(r): r for r in self._saved.values()}.values(), key=lambda r: r.order):
                record.medium = MEDIUM_PREFIX
                self._pending.append(record.event())
            self._saved.clear()

    def apply(self, events: Sequence[Any], stream: int = 0) -> None:
        """Turn a node's events (``kvstore.events.schema``) into vLLM events for the blocks this engine saved.

        ``stream`` names the node (the index of its stream): a clear it sends
        (a namespace's, or its restart's) concerns the blocks it reported stored.

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
            mine = self._stream_keys.setdefault(stream, set())
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
                        mine.add(key)
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
                elif isinstance(event, AllBlocksCleared):  # b"": every key the node reported
                    gone = {id(saved[k]): saved[k] for k in mine if k.startswith(event.namespace) and k in saved}
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

    def node_event_removed_all(self, stream: int | None = None) -> None:
        """Announce removed, and forget, every block one node (``stream``) reported stored, or every block this
        engine saved (``None``): that node's stream had a hole."""
        with self._lock:
            if stream is None:
                for record in {id(r): r for r in self._saved.values()}.values():
                    self._announce_removed(record)
                self._saved.clear()
                for keys in self._stream_keys.values():
                    keys.clear()
                return
            keys = self._stream_keys.get(stream, set())
            for record in {id(self._saved[k]): self._saved[k] for k in keys if k in self._saved}.values():
                self._forget(record)


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
    streams = None
    if settings.events_target == "off" or (not settings.events_target and not settings.target):
        how = "announced at save time, never removed" + ("" if settings.events_target == "off" else
                                                         " (an embedded store publishes no events)")
    elif settings.events_target:
        how = f"following the node's stream at {settings.events_target}"
    else:
        how = f"following the event streams the nodes at {settings.target} offer"
        streams = functools.partial(discover_streams, settings)
    logger.info("kvstore connector: KV events on (%s)", how)
    target = settings.events_target if settings.events_target != "off" else ""
    return ConnectorEvents(vllm_block_size, block_size, events_target=target,
                           events_replay=settings.events_replay, events_token=settings.bearer_token() or None,
                           streams=streams)


def discover_streams(settings: Any) -> list[EventStream]:
    """The event streams of the nodes in ``settings.target`` that publish one (each node's ``Capabilities``).

    Raises:
        grpc.RpcError: if a node cannot be asked (down): the caller asks again later.
    """
    from kvstore.connectors.kit.stores import channel_security
    from kvstore.events.discovery import discover_events

    credentials, metadata, token = channel_security(settings)
    found = [discover_events(target, credentials=credentials, metadata=metadata, timeout_s=max(1.0, settings.timeout_s),
                             token=token or None)
             for target in settings.targets]
    return [stream for stream in found if stream is not None]
