"""The store's factory: the tiers a ``StoreConfig`` names, built and opened as one started ``TieredStore``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Framing, Tier

if TYPE_CHECKING:
    from kvstore.events.log import StoreObserver


async def open_async_store(config: StoreConfig | None = None, *, framing: Framing | None = None,
                           events: StoreObserver | None = None, shared_pool: bool = False) -> TieredStore:
    """Build the tiers named by ``config`` and open a started :class:`TieredStore`.

    The memory tier comes first when enabled, then the LMDB tier when
    ``disk.path`` is set, then Redis as the shared tier when ``redis.url`` is set.

    Args:
        config: the store's configuration; the defaults when ``None``.
        framing: the server's value encoding (``kvstore serve`` passes its Get
            reply's head, ``kvstore.wire.reply_head``); with it, a ``cpu`` memory
            tier of ``storage: auto`` is the heap tier, which stores every block
            behind its framing, so the server sends it with no copy of its own.
        events: the store's observer (``kvstore.events.EventLog``), told of blocks restored at start too.
        shared_pool: the node offers the same-host data plane: a ``cpu`` memory tier of ``storage: auto`` is
            the shared pool (``kvstore.shm.node.pool``), which same-host clients read in place.

    Raises:
        ConfigError: if no tier is enabled.
    """
    from kvstore.errors import ConfigError

    config = config or StoreConfig()
    tiers: list[Tier] = []
    memory = config.memory
    if memory.enabled and memory.capacity_bytes > 0:
        if memory.device == "cpu":
            from kvstore.host_memory import warn_if_larger_than_memory

            warn_if_larger_than_memory(memory.capacity_bytes)
        auto_host = memory.storage == "auto" and memory.device == "cpu"
        if memory.storage == "shared" or (auto_host and shared_pool):
            from kvstore.shm.node.pool import SharedPool

            tiers.append(SharedPool(memory.capacity_bytes))
        elif memory.storage == "heap" or (auto_host and framing is not None):
            from kvstore.tiers.heap import HeapTier

            tiers.append(HeapTier.from_config(memory, framing=framing))
        else:
            from kvstore.tiers.memory import MemoryTier

            tiers.append(MemoryTier.from_config(memory))
    if config.disk.path:
        from kvstore.tiers.lmdb import LMDBTier

        tiers.append(LMDBTier.from_config(config.disk))
    shared = None
    if config.redis.url:
        from kvstore.tiers.redis import RedisTier

        shared = RedisTier.from_config(config.redis)
    if not tiers and shared is None:
        raise ConfigError("store", "no tier is enabled: enable memory, or set disk.path or redis.url")
    store = TieredStore(tiers, config, shared=shared, events=events)
    await store.start()
    return store
