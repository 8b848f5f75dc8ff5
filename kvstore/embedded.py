"""The embedded store: a synchronous, in-process :class:`~kvstore.api.BlockClient` with no server."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine, Sequence, TypeVar

from kvstore.api import Block, LookupResult, StoreStats
from kvstore.blockcopy import check_destinations, copy_into_destinations
from kvstore.blocklease import BlockLease
from kvstore.codec import decode_block, encode_blocks
from kvstore.encoding import encode_for_put
from kvstore.config import Config, StoreConfig, load_config
from kvstore.errors import UnavailableError
from kvstore.keys import BlockHash, Namespace
from kvstore.factory import open_async_store
from kvstore.explain import BlockExplanation
from kvstore.store import TieredStore

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")


class EmbeddedStore:
    """A :class:`TieredStore` driven from synchronous code, on a private event-loop thread.

    It implements :class:`kvstore.api.BlockClient`, so a connector takes it or a
    ``KVStoreClient`` alike. Methods are thread-safe. After ``fork`` the child
    cannot use its parent's store (the loop thread does not survive fork); it
    gets :class:`UnavailableError` and should open its own.

    Args:
        config: the store configuration; defaults to one memory tier of 1 GiB.
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-embedded", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._store: TieredStore = self._call(open_async_store(config))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise

    @property
    def store(self) -> TieredStore:
        """The underlying async store (use only from :meth:`run`)."""
        return self._store

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run a coroutine on the store's loop and return its result.

        Raises:
            UnavailableError: if the store is closed or used in a forked child.
            TimeoutError: if ``timeout_s`` passes first.
        """
        return self._call(coro, timeout_s)

    def _call(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        if os.getpid() != self._pid:
            coro.close()
            raise UnavailableError("an EmbeddedStore cannot be used after fork; open a new one in the child")
        if self._closed:
            coro.close()
            raise UnavailableError("the embedded store is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
               ttl_s: float | None = None, request_id: str | None = None) -> LookupResult:
        """The longest cached prefix of ``block_hashes`` (see :meth:`TieredStore.lookup`; ``session_id``, ``ttl_s``
        and ``request_id``: ``docs/agentic.md``)."""
        return self._call(self._store.lookup(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s,
                                             request_id=request_id))

    def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
            ttl_s: float | None = None) -> list[bytes]:
        """Encoded blocks of the longest cached prefix (see :meth:`TieredStore.get`)."""
        return self._call(self._store.get(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s))

    def explain(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[BlockExplanation]:
        """Each block of a request: hit, or the cause of its miss (see :meth:`TieredStore.explain`)."""
        return self._call(self._store.explain(namespace, block_hashes))

    def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
                    ttl_s: float | None = None) -> list[torch.Tensor]:
        """Blocks of the longest cached prefix as CPU tensors of their own: copies, which the caller may write.

        Each is ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or
        ``[num_layers, 1, block_size, latent_dim]`` (``mla``). The prefix is
        leased while each block is copied, once, straight out of its tier's
        memory into its tensor, in the calling thread; a write into a tensor
        never reaches a stored block.
        """
        read = self._store.read(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s)
        blocks = self._call(read.open())
        try:
            return [decode_block(b, verify=False, copy=True) for b in blocks]
        finally:
            self._loop.call_soon_threadsafe(read.close)

    def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                 destinations: Sequence[torch.Tensor], *, verify: bool | None = None, session_id: str | None = None,
                 ttl_s: float | None = None) -> int:
        """Copy the blocks of the longest cached prefix into the caller's tensors; returns how many.

        As :meth:`kvstore.client.KVStoreClient.get_into`: each block is copied
        once, straight from its tier's leased memory into its destination (any
        device, any view), while the store holds it.

        Args:
            namespace: namespace of the blocks.
            block_hashes: chained hashes, in prefix order.
            destinations: one tensor per hash, of the block's dtype and shape
                (``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for ``kv``).
            verify: check each block's checksum first (``None``: no, as :meth:`get_tensors`: the tiers
                validated the blocks on the way in).
            session_id: the request's agentic session (``docs/agentic.md``).
            ttl_s: a TTL to pin the blocks read with, seconds.

        Raises:
            InvalidArgumentError: if there is not one tensor per hash.
            DestinationMismatchError: if a block's dtype or shape is not its destination's (those before it
                are copied).
        """
        check_destinations(destinations, len(block_hashes))

        async def copy() -> int:
            async with self._store.read(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s) as blocks:
                copied = copy_into_destinations(blocks, destinations, bool(verify))
            if copied.error is not None:
                raise copied.error
            return copied.num_copied

        return self._call(copy())

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash], *, session_id: str | None = None,
             ttl_s: float | None = None) -> BlockLease:
        """The encoded blocks of the longest cached prefix in place, held until released (a :class:`BlockLease`).

        As :meth:`kvstore.client.KVStoreClient.read`: each block is a read-only
        view of its tier's memory (or a copy, from a tier that lends nothing),
        held by the store, so eviction, delete and clear leave it as it is,
        until :meth:`BlockLease.release` (which must come, or the blocks stay
        held). ``checked``: the tiers validated the blocks on the way in.

        Raises:
            InvalidArgumentError: on a hash of the wrong length.
            UnavailableError: if the store is closed.
        """
        read = self._store.read(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s)
        blocks = self._call(read.open())

        def release() -> None:
            if not self._closed:
                self._loop.call_soon_threadsafe(read.close)

        return BlockLease(list(blocks), [release], checked=True)

    def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> int:
        """Store blocks (bytes or tensors); returns how many were new (see :meth:`TieredStore.put`; ``session_id``
        and ``ttl_s``: ``docs/agentic.md``)."""
        encoded = encode_blocks(encode_for_put(blocks, namespace), namespace.layout)  # lossy: kvstore.encoding
        return self._call(self._store.put(namespace, block_hashes, encoded, priority=priority, retention_s=retention_s,
                                          session_id=session_id, ttl_s=ttl_s))

    def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier; returns how many were found."""
        return self._call(self._store.delete(namespace, block_hashes))

    def clear(self, namespace: Namespace) -> int:
        """Delete every block of ``namespace``; returns how many local blocks went."""
        return self._call(self._store.clear(namespace))

    def stats(self) -> StoreStats:
        """Per-tier stats (see :meth:`TieredStore.stats`)."""
        async def collect() -> StoreStats:
            return self._store.stats()
        return self._call(collect())

    def drain(self) -> None:
        """Wait for background promotions and write-through puts."""
        self._call(self._store.drain())

    def close(self) -> None:
        """Close the store (LMDB is flushed) and stop its loop thread; idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self._call(self._store.close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(config: Config | StoreConfig | str | os.PathLike[str] | None = None) -> EmbeddedStore:
    """Open an embedded, in-process store: the one obvious entry point.

    Args:
        config: a :class:`StoreConfig`, a whole :class:`Config` (its ``store``
            part is used), a path to a TOML/YAML config file, or ``None`` for
            defaults plus ``KVSTORE_*`` environment variables.

    Raises:
        ConfigError: naming the field, if the configuration is invalid.

    Example:
        >>> store = open_store(StoreConfig(disk=DiskTierConfig(path="/tmp/kv")))  # doctest: +SKIP
        >>> hashes = hash_blocks(namespace, token_ids)  # doctest: +SKIP
        >>> store.put(namespace, hashes, block_tensors)  # doctest: +SKIP
    """
    if config is None or isinstance(config, (str, Path, os.PathLike)):
        config = load_config(config)
    if isinstance(config, Config):
        config = config.store
    return EmbeddedStore(config)
