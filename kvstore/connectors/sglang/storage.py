"""kvstore as SGLang's HiCache storage tier: :class:`KVStoreHiCacheStorage`, a ``HiCacheStorage`` over a block store.

SGLang (0.5.23) loads it with ``--hicache-storage-backend dynamic`` and the
extra-config JSON ``{"backend_name": "kvstore", "module_path":
"kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
"interface_v1": 1, ...}`` (``docs/sglang.md``), calling ``cls(storage_config, kwargs)``;
``interface_v1`` makes its cache controller use the zero-copy pair
(``batch_get_v1`` / ``batch_set_v1``), which copy each page once between the
host pool and the store (``kvstore.connectors.sglang.pages``).

Every method runs on SGLang's storage threads (prefetch and backup) and never
raises into them: a store that is down, slow (past ``timeout_s``) or refusing
turns a read into a miss and a write into ``False``; the failure is logged,
counted, and starts a backoff during which the store is not called at all
(``kvstore.connectors.kit.stores.StoreHealth``, every connector's rule).
Settings errors, a hybrid model's extra pools and an unsupported pool are
refused at start-up instead, with an error that names the cause.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvstore.api import BlockClient
from kvstore.blocks.tensors import Layout
from kvstore.connectors.kit.fetch import FetchHandler, fetch_handler
from kvstore.connectors.kit.spec import BlockSpec
from kvstore.connectors.kit.stores import StoreHealth, open_block_store
from kvstore.connectors.sglang.config import SGLangStorageConfig, parse_config
from kvstore.connectors.sglang.pages import PageFormat, block_hashes, page_format, page_view, storage_namespace
from kvstore.connectors.sglang.stores import CounterBox, StorageCounters, clear_namespace
from kvstore.errors import CodecError
from kvstore.keys import BlockHash, Namespace

if TYPE_CHECKING:  # SGLang is untyped to mypy (kvstore.connectors.kit.bases): the base's calls this class makes
    from kvstore.connectors.kit.bases import EngineBase

    class HiCacheStorage(EngineBase):
        """SGLang's ``HiCacheStorage``, as far as this backend calls it."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Keep the host pool."""

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """Keep a named host pool."""
else:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

logger = logging.getLogger(__name__)

MAX_PAGES_PER_CALL = 256
"""Pages one store call names at most (a node's ``max_hashes_per_request`` is 8,192 by default; SGLang sends 128)."""

_KV_POOL = "kv"


@dataclass(frozen=True, slots=True)
class _Pool:
    """The registered host pool as the store sees it: the rank's namespace, the page format, and its fetch."""

    namespace: Namespace
    fmt: PageFormat
    fetch: FetchHandler


class BadPageError(CodecError):
    """A page the store returned is corrupt or not of the pool's format: it and the pages after it are misses.

    Attributes:
        num_copied: pages of the call copied into the host pool before it.
    """

    def __init__(self, message: str, num_copied: int) -> None:
        super().__init__(message)
        self.num_copied = num_copied


class HybridModelError(ValueError):
    """SGLang offered a host pool besides the KV pool (a hybrid model: Mamba, SWA, DSA...); not supported."""


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` backed by kvstore nodes (one or several, TLS, token) or an embedded store.

    Each page is one kvstore block under the rank's namespace
    (:func:`~kvstore.connectors.sglang.pages.storage_namespace`), keyed by
    SGLang's page hash. The namespace is known once SGLang registers its host
    pool (:meth:`register_mem_pool_host`, before any transfer).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; ``extra_config`` holds the settings
            (:class:`~kvstore.connectors.sglang.config.SGLangStorageConfig`).
        kwargs: the dynamic loader's extra arguments (unused).
        store: an open block store to use instead of the configured one (kept open by :meth:`close`).

    Raises:
        ConfigError: naming the key, on an unknown setting or a bad value.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict[str, Any]] = None, *,
                 store: BlockClient | None = None) -> None:
        self.storage_config = storage_config
        self.config: SGLangStorageConfig = parse_config(storage_config.extra_config)
        self._own_store = store is None
        self.store: BlockClient = open_block_store(self.config) if store is None else store
        self.health = StoreHealth(self.config.down_backoff_s)
        self.counters = CounterBox()
        self.namespace: Namespace | None = None
        self.page_format: PageFormat | None = None
        self.mem_pool_host: Any = None
        self._pool: _Pool | None = None
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool: its page format and the rank's namespace follow from it.

        Raises:
            ValueError: on a pool without a KV buffer, or a dtype kvstore cannot store.
        """
        super().register_mem_pool_host(mem_pool_host)
        fmt = page_format(mem_pool_host, bool(self.storage_config.is_mla_model))
        self.page_format = fmt
        self.namespace = storage_namespace(fmt, self.storage_config, model_id=self.config.model_id,
                                           tenant=self.config.tenant,
                                           format_tag=getattr(mem_pool_host, "storage_format_tag", None))
        self._pool = _Pool(self.namespace, fmt, fetch_handler(self.store, BlockSpec(fmt.dtype, Layout(fmt.layout),
                                                                                  fmt.shape)))
        logger.info("kvstore HiCache backend: %s pages of %s, %d bytes each (%s)", fmt.order, fmt.shape,
                    fmt.page_bytes, "one copy" if fmt.native else "through flat pages")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Accept the KV pool only.

        Raises:
            HybridModelError: for any other pool (hybrid models need the ``*_v2`` calls, which this backend refuses).
        """
        if str(host_pool_name) != _KV_POOL:
            raise HybridModelError(
                f"the kvstore HiCache backend stores KV pages only; SGLang offered the {host_pool_name!s} pool "
                "of a hybrid model (Mamba, SWA, DSA or DeepSeek-V4 state), which needs batch_*_v2: use another "
                "storage backend for this model, or none")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Refused: see :class:`HybridModelError`."""
        raise HybridModelError("the kvstore HiCache backend does not implement batch_exists_v2 (hybrid models)")

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Refused: see :class:`HybridModelError`."""
        raise HybridModelError("the kvstore HiCache backend does not implement batch_get_v2 (hybrid models)")

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Refused: see :class:`HybridModelError`."""
        raise HybridModelError("the kvstore HiCache backend does not implement batch_set_v2 (hybrid models)")

    # ------------------------------------------------------------------ the zero-copy pair

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (prefix semantics: the first miss ends the count).

        0 while the store is down or on a failure (logged, counted).
        """
        pool = self._ready("exists") if keys else None
        if pool is None:
            return 0
        hashes = block_hashes(keys)
        found = 0
        try:
            for start in range(0, len(hashes), MAX_PAGES_PER_CALL):
                chunk = hashes[start:start + MAX_PAGES_PER_CALL]
                num = self.store.lookup(pool.namespace, chunk, **self._agentic(extra_info, ttl=False)).num_blocks
                found += num
                if num < len(chunk):
                    break
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's storage threads
            return self._failed("lookup", exc, found)
        self.health.succeeded()
        self.counters.add(miss_pages=len(keys) - found)
        return found

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Copy the stored prefix of ``keys`` into the host pool's pages at ``host_indices``; one bool per key.

        Page ``i`` goes to the slots ``host_indices[i * page_size:(i + 1) * page_size]`` (SGLang allocates
        whole pages, so its first slot names the page). Result ``i`` is ``True`` for each page of the
        stored prefix, ``False`` from the first miss on (and for every page on a failure).
        """
        if not keys:
            return []
        pool = self._ready("get")
        starts = self._page_starts(pool, host_indices, len(keys)) if pool is not None else None
        if pool is None or starts is None:
            return [False] * len(keys)
        hashes = block_hashes(keys)
        extra = self._agentic(extra_info)

        def copy(first: int, end: int) -> int:
            if pool.fmt.native:
                pages = [page_view(self.mem_pool_host, pool.fmt, start) for start in starts[first:end]]
                return self._fetch(pool, hashes[first:end], pages, extra, first)
            return self._get_flat(pool, hashes[first:end], starts[first:end], extra, first)

        copied = self._read(pool, len(keys), copy)
        return [i < copied for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; one bool per key (all ``False`` on a failure).

        On an MLA model only the storage writer (``HiCacheStorageConfig.is_storage_writer``, rank 0) writes;
        the other ranks' pages are the same bytes, so they answer ``True`` without a call.
        """
        if not keys:
            return []
        if not self._writer():
            return [True] * len(keys)
        pool = self._ready("put")
        starts = self._page_starts(pool, host_indices, len(keys)) if pool is not None else None
        if pool is None or starts is None:
            return [False] * len(keys)
        if pool.fmt.native:
            pages = [page_view(self.mem_pool_host, pool.fmt, s) for s in starts]
        else:
            pages = [self.mem_pool_host.get_data_page(s, flat=True).view(pool.fmt.shape) for s in starts]
        return [self._put(pool, keys, pages, self._agentic(extra_info))] * len(keys)

    # ------------------------------------------------------------------ the older, copying interface

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        """Read one page into ``target_location`` (a flat page, ``get_dummy_flat_data_page``); ``None`` on a miss."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Read pages into flat page tensors (new ones when ``target_locations`` is ``None``).

        Returns:
            Per key, its filled tensor for each page of the stored prefix, ``None`` from the first miss on.
        """
        if not keys:
            return []
        pool = self._ready("get")
        if pool is None:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [
            self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]

        def copy(first: int, end: int) -> int:
            pages = [t.view(pool.fmt.shape) for t in targets[first:end]]
            return self._fetch(pool, block_hashes(keys[first:end]), pages, self._agentic(None), first)

        copied = self._read(pool, len(keys), copy)
        return [t if i < copied else None for i, t in enumerate(targets)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store one flat page (``get_data_page``); ``False`` on a failure."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat pages (``get_data_page(index)`` of each); ``True`` if the store took them all."""
        if not keys:
            return True
        if not self._writer():
            return True
        pool = self._ready("put")
        if pool is None or values is None or len(values) != len(keys):
            return False
        try:
            pages = [v.reshape(pool.fmt.shape) for v in values]
        except (RuntimeError, ValueError) as exc:
            logger.error("kvstore HiCache backend: a page does not have %d elements of %s: %s",
                         _page_numel(pool.fmt), pool.fmt.shape, exc)
            return False
        return self._put(pool, keys, pages, self._agentic(None))

    def exists(self, key: str) -> bool:
        """Whether the page of ``key`` is stored (``False`` on a failure)."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ housekeeping

    def clear(self) -> bool:
        """Delete every page of this rank's namespace; ``False`` on a failure."""
        if self.namespace is None:
            return True
        try:
            clear_namespace(self.store, self.namespace)
        except Exception as exc:  # noqa: BLE001 - SGLang calls it from its admin endpoint
            logger.warning("kvstore HiCache backend: clear failed: %s: %s", type(exc).__name__, exc)
            self.counters.add(errors=1)
            return False
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last one (with SGLang's storage metrics on), else
        ``None``; :meth:`stats` has kvstore's own counts. ``None`` too where SGLang's metrics module does not
        import (it is imported on first use; SGLang then logs empty metrics)."""
        if not self._metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError as exc:
            logger.warning("kvstore HiCache backend: no SGLang StorageMetrics (%s)", exc)
            return None
        return StorageMetrics(**self.take_transfer_metrics())

    def take_transfer_metrics(self) -> dict[str, list[Any]]:
        """The fields of SGLang's ``StorageMetrics`` since the last call, drained as its Mooncake backend drains them.

        Returns:
            ``prefetch_pgs`` / ``backup_pgs``: pages per read / write call; ``prefetch_bandwidth`` /
            ``backup_bandwidth``: GiB/s of each call.
        """
        taken: dict[str, list[Any]] = {"prefetch_pgs": list(self._prefetch_pgs), "backup_pgs": list(self._backup_pgs),
                                       "prefetch_bandwidth": list(self._prefetch_bandwidth),
                                       "backup_bandwidth": list(self._backup_bandwidth)}
        for values in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bandwidth, self._backup_bandwidth):
            values.clear()
        return taken

    def stats(self) -> StorageCounters:
        """This backend's counts: hits, misses, bytes, errors (:class:`~kvstore.connectors.sglang.stores.StorageCounters`)."""
        return self.counters.snapshot()

    def close(self) -> None:
        """Close the store if this backend opened it."""
        if self._own_store:
            self.store.close()

    # ------------------------------------------------------------------ internals

    def _ready(self, what: str) -> _Pool | None:
        """The registered pool, if SGLang registered one and the store is up (else counted, and ``None``)."""
        if self._pool is None:
            logger.error("kvstore HiCache backend: %s before SGLang registered its host pool", what)
            self.counters.add(errors=1)
            return None
        if not self.health.up():
            self.counters.add(skipped_calls=1)
            return None
        return self._pool

    def _writer(self) -> bool:
        return bool(getattr(self.storage_config, "is_storage_writer", True))

    def _page_starts(self, pool: _Pool, host_indices: torch.Tensor, num_pages: int) -> list[int] | None:
        size = pool.fmt.page_size
        if host_indices.numel() < num_pages * size:
            logger.error("kvstore HiCache backend: %d host slots for %d pages of %d tokens",
                         host_indices.numel(), num_pages, size)
            self.counters.add(errors=1)
            return None
        starts: list[int] = host_indices[0:num_pages * size:size].tolist()
        return starts

    def _read(self, pool: _Pool, num_pages: int, copy: Callable[[int, int], int]) -> int:
        """Read pages ``[0, num_pages)`` by ``copy(first, end)`` (pages copied of ``[first, end)``), at most
        :data:`MAX_PAGES_PER_CALL` a call, until one comes short; count them. Returns the pages copied.

        A failure is logged, counted and starts the backoff (never raised into SGLang's storage threads);
        the pages copied before it count.
        """
        started = time.perf_counter()
        copied = 0
        try:
            for first in range(0, num_pages, MAX_PAGES_PER_CALL):
                end = min(num_pages, first + MAX_PAGES_PER_CALL)
                num = copy(first, end)
                copied += num
                if num < end - first:
                    break
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's storage threads
            copied = exc.num_copied if isinstance(exc, BadPageError) else copied  # the pages before a bad one
            self._failed("get", exc, copied)
        else:
            self.health.succeeded()
        self._count_read(pool, copied, num_pages, time.perf_counter() - started)
        return copied

    def _fetch(self, pool: _Pool, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor], extra: dict[str, Any],
               num_before: int) -> int:
        """Copy the stored prefix of ``hashes`` into ``pages`` (``kvstore.connectors.kit.fetch``); how many.

        Raises:
            BadPageError: at a page that is corrupt or not of the pool's format (the pages before it are copied).
        """
        fetched = pool.fetch.fetch(pool.namespace, hashes, pages, extra)
        if fetched.bad is not None:
            raise BadPageError(f"page {num_before + fetched.num_good} is {fetched.bad}", num_before + fetched.num_good)
        return fetched.num_good

    def _get_flat(self, pool: _Pool, hashes: Sequence[BlockHash], starts: Sequence[int], extra: dict[str, Any],
                  num_before: int) -> int:
        host, shape = self.mem_pool_host, pool.fmt.shape
        pages = [host.get_dummy_flat_data_page() for _ in starts]
        try:
            num = self._fetch(pool, hashes, [p.view(shape) for p in pages], extra, num_before)
        except BadPageError as exc:
            num = exc.num_copied - num_before
            for start, page in zip(starts[:num], pages[:num]):
                host.set_from_flat_data_page(start, page)
            raise
        for start, page in zip(starts[:num], pages[:num]):
            host.set_from_flat_data_page(start, page)
        return num

    def _agentic(self, extra_info: Any, *, ttl: bool = True) -> dict[str, Any]:
        """The ``session_id`` and ``ttl_s`` keywords of a store call (``docs/agentic.md``): the call's own, from
        ``extra_info`` (SGLang's ``HiCacheStorageExtraInfo.extra_info``, or a dict, holding ``{"kvstore":
        {"session_id": ..., "ttl_s": ...}}``), else the configured ``ttl_s``; only those set. A bad value is
        logged and dropped (never raised into SGLang's storage threads)."""
        info = getattr(extra_info, "extra_info", extra_info)
        options = info.get("kvstore", info) if isinstance(info, dict) else {}
        extra: dict[str, Any] = {}
        session = options.get("session_id") if isinstance(options, dict) else None
        if isinstance(session, str) and session:
            extra["session_id"] = session
        ttl_s = options.get("ttl_s", self.config.ttl_s) if isinstance(options, dict) else self.config.ttl_s
        if ttl and ttl_s:
            if isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool) and 0 < ttl_s < float("inf"):
                extra["ttl_s"] = float(ttl_s)
            else:
                logger.warning("kvstore HiCache backend: ttl_s %r ignored (seconds > 0)", ttl_s)
        return extra

    def _put(self, pool: _Pool, keys: Sequence[str], pages: Sequence[torch.Tensor], agentic: dict[str, Any]) -> bool:
        started = time.perf_counter()
        hashes = block_hashes(keys)
        try:
            for first in range(0, len(keys), MAX_PAGES_PER_CALL):
                self.store.put(pool.namespace, hashes[first:first + MAX_PAGES_PER_CALL],
                               list(pages[first:first + MAX_PAGES_PER_CALL]), priority=self.config.priority,
                               retention_s=self.config.retention_s, **agentic)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's storage threads
            self._failed("put", exc, 0)
            return False
        self.health.succeeded()
        elapsed_s = time.perf_counter() - started
        num_bytes = len(keys) * pool.fmt.page_bytes
        self.counters.add(written_pages=len(keys), written_bytes=num_bytes)
        if self._metrics:
            self._backup_pgs.append(len(keys))
            self._backup_bandwidth.append(num_bytes / max(elapsed_s, 1e-9) / (1 << 30))
        return True

    def _count_read(self, pool: _Pool, copied: int, asked: int, elapsed_s: float) -> None:
        num_bytes = copied * pool.fmt.page_bytes
        self.counters.add(hit_pages=copied, miss_pages=asked - copied, read_bytes=num_bytes)
        if self._metrics:
            self._prefetch_pgs.append(copied)
            self._prefetch_bandwidth.append(num_bytes / max(elapsed_s, 1e-9) / (1 << 30))

    def _failed(self, what: str, exc: BaseException, done: int) -> int:
        """Count and log a failed call, start the backoff; returns ``done`` (what succeeded before it)."""
        self.counters.add(errors=1)
        self.health.failed(f"HiCache {what}", exc)
        return done


def _page_numel(fmt: PageFormat) -> int:
    """Elements of one page of ``fmt``."""
    count = 1
    for dim in fmt.shape:
        count *= dim
    return count
