"""The embedded store: a synchronous, in-process :class:`~kvstore.api.BlockClient` with no server."""

from __future__ import annotations

import asyncio
import os
import selectors
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence, TypeVar, cast

from kvstore.api import Block, Buffer, LookupResult, StoreStats
from kvstore.blocks.copying import check_destinations, copy_lent_into, tensor_blocks
from kvstore.blocks.lease import BlockLease
from kvstore.blocks.tensors import decode_block
from kvstore.blocks.encoding import encode_for_put
from kvstore.config import Config, StoreConfig, load_config
from kvstore.errors import UnavailableError
from kvstore.keys import BlockHash, Namespace
from kvstore.store.factory import open_async_store
from kvstore.store.explain import BlockExplanation
from kvstore.store.reads import BlockRead
from kvstore.store.tiered import TieredStore

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")


class _ParkingSelector(selectors.DefaultSelector):
    """The embedded store's loop's selector: the loop thread holds the store's lock except while it waits here.

    So a caller thread that takes the lock finds the loop parked (waiting for
    I/O or a timer, no callback running) and may run a synchronous step of the
    store itself (:meth:`EmbeddedStore._run_now`), exactly as a callback on the
    loop would, with no hand-off to the loop thread and back: on a busy host each
    hand-off waits for the scheduler to run the other thread.
    """

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._lock = lock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self._lock.release()
        try:
            return super().select(timeout)
        finally:
            self._lock.acquire()


class EmbeddedStore:
    """A :class:`TieredStore` driven from synchronous code, on a private event-loop thread.

    It implements :class:`kvstore.api.BlockClient`, so a connector takes it or a
    ``KVStoreClient`` alike. Methods are thread-safe. After ``fork`` the child
    cannot use its parent's store (the loop thread does not survive fork); it
    gets :class:`UnavailableError` and should open its own.

    The loop owns the store. A call that awaits (a put, a delete) runs on it as
    a coroutine; a lookup and the lease of a read, which never wait when the
    memory tier holds the whole prefix, run in the caller's own thread while
    the loop is parked (:class:`_ParkingSelector`'s lock), and the caller copies
    the blocks out itself, the release going back to the loop without a wait.

    Args:
        config: the store configuration; defaults to one memory tier of 1 GiB.
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()  # held by the loop thread but while it waits for events
        self._loop = asyncio.SelectorEventLoop(_ParkingSelector(self._lock))
        self._thread = threading.Thread(target=self._run_loop, name="kvstore-embedded", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._store: TieredStore = self._call(open_async_store(config))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise

    def _run_loop(self) -> None:
        with self._lock:  # released only inside the selector's select()
            self._loop.run_forever()

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
        located = None
        if not (session_id or ttl_s or request_id):
            located = self._run_now(lambda: self._store.locate_now(namespace, block_hashes))
        if located is None:  # a shared tier to ask, or a session, TTL or request to note
            return self._call(self._store.lookup(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s,
                                                 request_id=request_id))
        return LookupResult.from_block_tiers(located, self._store.tier_names)

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
        blocks = self._open(read)
        try:
            return [decode_block(b, verify=False, copy=True) for b in blocks]
        finally:
            self._close_read(read)

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
        read = self._store.read(namespace, block_hashes, session_id=session_id, ttl_s=ttl_s)
        blocks = self._open(read)
        try:
            pool = cast("torch.Tensor | None", read.pool)  # a tier's page pool is a tensor (``TierLoan.pool``)
            copied = copy_lent_into(blocks, destinations, bool(verify), pool, read.offsets)
        finally:
            self._close_read(read)
        if copied.error is not None:
            raise copied.error
        return copied.num_copied

    def _open(self, read: BlockRead) -> list[Buffer]:
        """Enter ``read``: in this thread while the loop is parked where the top tier lends the whole prefix
        (:meth:`BlockRead.open_now`), else with a coroutine on the loop. The caller copies out of it in its own
        thread (the store holds the blocks) and gives it back with :meth:`_close_read`."""
        blocks = self._run_now(read.open_now)
        return blocks if blocks is not None else self._call(read.open())

    def _close_read(self, read: BlockRead) -> None:
        """Give ``read`` back on the store's loop, without waiting (a later call of this thread comes after it):
        the loop's thread does the release's work while this one goes on (``benchmarks/bench_embedded.py``)."""
        if not self._closed and os.getpid() == self._pid:
            self._loop.call_soon_threadsafe(read.close)

    def _run_now(self, function: Callable[[], _T]) -> _T:
        """Run a synchronous step of the store in this thread, the loop parked meanwhile, and return its result.

        ``function`` must not wait, nor call asyncio (it runs as a callback of the loop would, outside it); what
        it sets in motion on the loop goes with ``call_soon_threadsafe``.

        Raises:
            UnavailableError: if the store is closed or used in a forked child.
        """
        if os.getpid() != self._pid:
            raise UnavailableError("an EmbeddedStore cannot be used after fork; open a new one in the child")
        with self._lock:
            if self._closed:
                raise UnavailableError("the embedded store is closed")
            return function()

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
        blocks = self._open(read)

        def release() -> None:
            self._close_read(read)

        return BlockLease(list(blocks), [release], checked=True, offsets=read.offsets)  # offsets: in the pool

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
        and ``ttl_s``: ``docs/agentic.md``).

        A tensor is encoded where the store keeps it: into the memory tier's pool, one copy of its payload and
        its checksum taken there (``kvstore.blocks.copying.TensorBlock``); into ``bytes`` for any other tier. A
        namespace with a lossy KV encoding (``kvstore.blocks.encoding``) encodes each tensor first.

        Raises:
            InvalidArgumentError, UnknownDtypeError, ElementCountError: on a block that is not bytes, a tensor
                or an array, or a tensor whose dtype or shape does not fit the codec and layout.
            As :meth:`TieredStore.put` otherwise.
        """
        staged = tensor_blocks(encode_for_put(blocks, namespace), namespace.layout)  # lossy: kvstore.blocks.encoding
        return self._call(self._store.put(namespace, block_hashes, staged,
                                          priority=priority, retention_s=retention_s, session_id=session_id,
                                          ttl_s=ttl_s))

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
