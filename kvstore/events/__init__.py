"""KV events: the node tells routers which blocks it holds, in vLLM's event format (``docs/events.md``).

* :mod:`kvstore.events.schema`: the events (vLLM's three, with kvstore's fields).
* :mod:`kvstore.events.log`: the bounded log the store's index appends to.
* :mod:`kvstore.events.publisher`: the ZMQ publisher (vLLM's framing).
* :mod:`kvstore.events.replay`: the replay buffers and the replay socket's peers (bounded, shared, freed).
* :mod:`kvstore.events.access`: on a node with tokens, who reads which stream (authenticated, per tenant).
* :mod:`kvstore.events.subscriber`: a subscriber and a view of a node's tiers.
* :mod:`kvstore.events.discovery`: where a node publishes, asked of the node (``Capabilities``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.events.log import EventLog, StoreObserver
from kvstore.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

if TYPE_CHECKING:
    from kvstore.config import EventsConfig
    from kvstore.events.access import EventAccess
    from kvstore.events.publisher import EventPublisher

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventLog", "KVEventBatch", "NodeEvents",
           "StoreObserver", "open_node_events"]


@dataclass
class NodeEvents:
    """A node's event log and its publisher (:func:`open_node_events`).

    Attributes:
        log: pass it to the store (``open_async_store(events=...)``) before the store starts.
        publisher: sends the log's batches.
    """

    log: EventLog
    publisher: EventPublisher

    def close(self) -> None:
        """Send what is left (close the store first), then close the sockets."""
        self.publisher.close()


def open_node_events(config: EventsConfig, *, client_auth: bool, access: EventAccess | None = None,
                     routes: dict[bytes, int] | None = None) -> NodeEvents | None:
    """The node's events as ``config`` says; ``None`` when ``events.endpoint`` is empty (the default).

    Args:
        config: the ``[events]`` settings.
        client_auth: whether the node authenticates its clients in any way (tokens, client certificates): then
            only a local endpoint, unless the stream is authenticated and ``allow_remote`` is set.
        access: on a node with tokens, who reads which stream (``kvstore.events.access``); ``None``: one
            stream, unauthenticated.
        routes: with ``access``, namespace tag -> route (``kvstore.server.tenants``), kept up to date by its
            owner; each change is routed by it when it is recorded.

    Raises:
        ConfigError: naming the setting, for a refused or unbindable endpoint.
    """
    if not config.endpoint:
        return None
    from kvstore.events.publisher import EventPublisher, PublisherSettings, check_endpoint, replay_address
    from kvstore.events.replay import ReplayLimits

    authenticated = access is not None
    check_endpoint(config.endpoint, client_auth=client_auth, authenticated=authenticated,
                   allow_remote=config.allow_remote)
    replay = replay_address(config.endpoint, config.replay_endpoint)
    if replay is not None:
        check_endpoint(replay, client_auth=client_auth, authenticated=authenticated,
                       allow_remote=config.allow_remote, name="events.replay_endpoint")
    log = EventLog(config.max_queue_events)
    if access is not None and routes is not None:
        log.set_routes(routes)
    publisher = EventPublisher(log, PublisherSettings(
        endpoint=config.endpoint, replay_endpoint=config.replay_endpoint, topic=config.topic, hwm=config.hwm,
        buffer_steps=config.buffer_steps, buffer_bytes=config.buffer_bytes,
        replay=ReplayLimits(max_replays=config.max_replays, max_replays_per_stream=config.max_replays_per_stream,
                            replay_hwm=config.replay_hwm, replay_stall_s=config.replay_stall_s)), access=access)
    return NodeEvents(log, publisher)
