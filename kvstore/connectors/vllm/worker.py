"""A worker's half of the connector: loads blocks into vLLM's paged KV before the forward pass, saves them after.

Loads (``start_load_kv``, before the step's forward pass; synchronous unless
``load_async``, so vLLM calls it first and the step waits): the step's
:class:`~kvstore.connectors.vllm.jobs.LoadJob` s are fetched concurrently, each
within the connector's ``timeout_s`` of the step's start. Every fetched block
is checked before it is used: its checksum (``kvstore.blocks.tensors.verify_block``), its
dtype, layout and shape against this worker's page format. The blocks are
written up to the first one that is missing, late, corrupt or mismatched; every
vLLM block from there on is reported by ``get_block_ids_with_load_errors``, so
vLLM recomputes it, and is never counted as loaded. A block that failed its
checks is also deleted from the store, so a recomputed one can replace it.
With ``load_async`` each load runs on a fetch thread instead (fetch, checks and
scatter), vLLM keeps stepping the other requests, and ``get_finished`` reports
the load once it has ended (:meth:`WorkerSide.take_finished_recving`): its
failed blocks are reported before or with it, and a load past ``timeout_s``
that has not begun writing is given up, reported failed, and never written.
Nothing is written into vLLM's cache but checked blocks, and only into the
blocks vLLM allocated for the load. Loading is not pipelined layer by layer:
one block holds every layer, so the whole load is one fetch, then the copies;
``wait_for_layer_load`` has nothing to wait for.

The hit path on a CPU cache, with a client that can ``read`` (every kvstore
client, and the embedded store): the prefix is leased where it is, in the
node's shared-memory segment (same host) or the embedded store's own memory;
its headers are checked as a batch and its payloads viewed as numpy arrays, with
no copy (``kvstore.connectors.kit.leased``); and ``PagedKV.scatter_arrays``
copies them straight into the paged cache, one strided copy per layer: the
scatter is this side's one copy. The lease is released after the scatter; one
that ran out meanwhile (the node may have reused its range) fails the whole
load, so it is recomputed, never served half-written. Checksums are checked as
the client checks them: what crossed a network (gRPC) is, what the node
validated at put time and serves from its memory is not (``docs/shared-memory.md``).
The fetch is chosen once, by the client and the cache's device
(``kvstore.connectors.kit.fetch.fetch_handler``). On a CUDA cache the blocks go
through ``get_into`` into one pinned staging tensor ``[num_blocks,
*block_shape]`` and from there to the device. A corrupt
block in a staged fetch makes the worker fetch the encoded blocks to find which one it was.

Saves (``wait_for_save``, after the forward pass): the blocks of the step's
:class:`~kvstore.connectors.vllm.jobs.SaveJob` s are copied out of vLLM's cache
at once (one ``index_select`` per layer, to host memory), so vLLM may reuse the
blocks as soon as the step ends; one background thread then puts them. A save
planned at a request's end is reported in ``finished_sending`` right after the
copy. Saves are dropped (and counted) while the store is down or when
``max_pending_save_bytes`` of KV already wait.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvstore.api import BlockClient
from kvstore.blocks.tensors import torch_dtype
from kvstore.connectors.kit.fetch import Fetched, fetch_handler
from kvstore.connectors.kit.saves import SaveQueue
from kvstore.connectors.kit.stores import StoreHealth, agentic, open_client
from kvstore.connectors.vllm.config import VLLMConnectorConfig
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, KVStoreWorkerMetadata, LoadJob, RankKey, SaveJob, TenantKey
from kvstore.connectors.vllm.layout import PagedKV
from kvstore.connectors.vllm.metrics import KVStoreConnectorStats
from kvstore.connectors.vllm.namespaces import ModelIdentity, RankInfo, storage_namespace
from kvstore.connectors.vllm.stores import LookupEndpoint, embedded_config
from kvstore.embedded import EmbeddedStore
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHash, HashAlgorithm, Namespace

logger = logging.getLogger(__name__)

MAX_CONCURRENT_FETCHES = 4
"""Load jobs of one step fetched at once."""

SHUTDOWN_DRAIN_S = 10.0
"""Longest wait at shutdown for saves already queued, seconds."""


def _log_failed_delete(future: concurrent.futures.Future[int]) -> None:
    """Log a delete of a bad block that failed (the block stays a miss: it fails its checks again)."""
    exc = future.exception()
    if exc is not None:
        logger.warning("deleting a bad kvstore block failed: %s", exc)


def _release_late(future: concurrent.futures.Future[Fetched]) -> None:
    """Give back the lease of a fetch that ended after its load was given up."""
    if not future.cancelled() and future.exception() is None:
        future.result().release()


@dataclass(slots=True)
class _AsyncLoad:
    """One asynchronous load: its job, times (``time.monotonic()``, seconds) and state, guarded by ``lock``."""

    job: LoadJob
    started: float
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    writing: bool = False
    abandoned: bool = False
    done: bool = False


class WorkerSide:
    """One worker's connector logic, independent of vLLM's class hierarchy (see the module docstring).

    Args:
        config: the connector's settings.
        identity: the engine's model identity.
        paged: this worker's paged KV (``kvstore.connectors.vllm.layout.paged_kv``).
        rank: ``(pp_rank, tp_rank)`` of this worker.
        vllm_block_size: tokens per vLLM block.
        client: the store (a ``KVStoreClient``, or an embedded store), which this object closes.
        endpoint: the embedded store's lookup endpoint, if any; closed with it.
        writer: whether this rank saves (MLA blocks are saved by TP rank 0 only).
    """

    def __init__(self, config: VLLMConnectorConfig, identity: ModelIdentity, paged: PagedKV, rank: RankKey,
                 vllm_block_size: int, client: BlockClient, *, endpoint: LookupEndpoint | None = None,
                 writer: bool = True) -> None:
        self.config = config
        self.identity = identity
        self.paged = paged
        self.rank = rank
        self.block_size = config.block_size or vllm_block_size
        self.vllm_block_size = vllm_block_size
        self.client = client
        self.endpoint = endpoint
        self.writer = writer
        self.info = RankInfo(rank[0], rank[1], paged.page_format,
                             endpoint.target if endpoint else None, endpoint.token if endpoint else None)
        self.health = StoreHealth(config.down_backoff_s)
        self.units_per_kv_block = self.block_size // paged.page_format.unit_tokens
        self._block_shape = paged.page_format.block_shape(self.block_size)
        self._block_dtype = torch_dtype(paged.page_format.dtype)
        self._fetch_blocks = fetch_handler(client, paged.page_format.block_spec(self.block_size),
                                           in_place=paged.device.type == "cpu", pin_memory=paged.device.type == "cuda")
        self._hash_algorithm = HashAlgorithm(config.hash_algorithm)
        if config.kv_encoding and self._block_dtype in (torch.float16, torch.bfloat16, torch.float32):
            from kvstore.blocks.encoding import warm_up  # numba's first compile here, not in the first load's timeout

            warm_up(config.kv_encoding, self._block_dtype, paged.page_format.layout.value)
        self._namespaces: dict[TenantKey, Namespace] = {}
        self._stats = KVStoreConnectorStats()
        self._stats_lock = threading.Lock()
        self._failed_block_ids: set[int] = set()
        self._failed_loads: dict[str, int] = {}
        self._fail_lock = threading.Lock()  # loads fail on the step and, when asynchronous, on fetch threads
        self._async_loads: list[_AsyncLoad] = []
        self._async_lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._fetcher = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_FETCHES, thread_name_prefix="kvstore-load")
        self._saves = SaveQueue(self.health, config.max_pending_save_bytes)
        self._closed = False

    # ------------------------------------------------------------------ helpers

    def namespace(self, tenant: TenantKey) -> Namespace:
        """This worker's namespace for a tenant and adapter (cached)."""
        namespace = self._namespaces.get(tenant)
        if namespace is None:
            namespace = storage_namespace(self.identity, self.info, block_size=self.block_size,
                                          hash_algorithm=self._hash_algorithm, cache_salt=tenant.cache_salt,
                                          adapter=tenant.adapter, kv_encoding=self.config.kv_encoding)
            self._namespaces[tenant] = namespace
        return namespace

    def _count(self, **amounts: int) -> None:
        with self._stats_lock:
            for name, amount in amounts.items():
                self._stats.add(name, amount)

    def _observe(self, name: str, seconds: float) -> None:
        with self._stats_lock:
            self._stats.observe(name, seconds)

    # ------------------------------------------------------------------ loads

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Fetch, check and write every load job of the step (see the module docstring); never raises."""
        if not meta.loads:
            return
        if self.config.load_async:
            for job in meta.loads:
                self._start_async(job)
            return
        started = time.monotonic()
        if not self.health.up():
            for job in meta.loads:
                self._fail(job, 0, len(job.hashes.get(self.rank, ())))
            return
        futures = {}
        for job in meta.loads:
            if job.hashes.get(self.rank):
                futures[self._fetcher.submit(self._fetch, job)] = job
            else:  # nothing to fetch for blocks vLLM counts as loaded: all of them are recomputed
                self._fail(job, 0, 0)
        deadline = started + self.config.timeout_s
        for future, job in futures.items():
            num_blocks = len(job.hashes.get(self.rank, ()))
            try:
                buffers = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                future.add_done_callback(_release_late)  # a lease that comes after the deadline goes back
                self.health.failed("load", None)
                self._fail(job, 0, num_blocks)
                continue
            except (KVStoreError, OSError) as exc:
                self.health.failed("load", exc)
                self._fail(job, 0, num_blocks)
                continue
            except Exception:  # noqa: BLE001 - a bug in a fetch must not take the engine down
                logger.exception("kvstore load of request %s failed", job.req_id)
                self._fail(job, 0, num_blocks)
                continue
            self.health.succeeded()
            self._write(job, buffers)
        self._observe("load_seconds", time.monotonic() - started)

    # ------------------------------------------------------------------ asynchronous loads

    def _start_async(self, job: LoadJob) -> None:
        """Start one load on a fetch thread and return (``load_async``); :meth:`take_finished_recving` reports it."""
        now = time.monotonic()
        load = _AsyncLoad(job, now, now + self.config.timeout_s)
        num_blocks = len(job.hashes.get(self.rank, ()))
        if not self.health.up() or not num_blocks:  # nothing to fetch: every block is recomputed
            self._fail(job, 0, num_blocks)
            load.done = True
        else:
            self._fetcher.submit(self._load_async, load)
        with self._async_lock:
            self._async_loads.append(load)

    def _load_async(self, load: _AsyncLoad) -> None:
        """A fetch thread's load: fetch, then write unless the load was given up meanwhile (never raises)."""
        job = load.job
        num_blocks = len(job.hashes[self.rank])
        fetched: Fetched | None = None
        try:
            fetched = self._fetch(job)
        except (KVStoreError, OSError) as exc:
            self.health.failed("load", exc)
        except Exception:  # noqa: BLE001 - a bug in a fetch must not take the engine down
            logger.exception("kvstore load of request %s failed", job.req_id)
        with load.lock:
            if load.abandoned:  # reported as failed at its deadline: vLLM may have reused its blocks
                if fetched is not None:
                    fetched.release()
                return
            if fetched is None:
                self._fail(job, 0, num_blocks)
                load.done = True
                return
            load.writing = True  # from here the deadline waits for the write: it is a memory copy
        try:
            self.health.succeeded()
            self._write(job, fetched)
        except Exception:  # noqa: BLE001 - never leave a half-written load counted as loaded
            logger.exception("writing kvstore blocks of request %s into vLLM's cache failed", job.req_id)
            self._fail(job, 0, num_blocks)
        finally:
            self._observe("load_seconds", time.monotonic() - load.started)
            with load.lock:
                load.done = True

    def take_finished_recving(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call (vLLM's ``finished_recving``).

        A load past its deadline that has not begun writing is given up here:
        its blocks are reported as failed (``get_block_ids_with_load_errors``,
        which vLLM reads after this in the same step) and nothing is ever
        written for it; one that is writing is waited for, a memory copy.
        """
        now = time.monotonic()
        with self._async_lock:
            loads, self._async_loads = self._async_loads, []
        finished, pending = set(), []
        for load in loads:
            with load.lock:
                if not load.done and not load.writing and now > load.deadline:
                    load.abandoned = True
                    self.health.failed("load", None)
                    self._fail(load.job, 0, len(load.job.hashes.get(self.rank, ())))
                    load.done = True
                if load.done:
                    finished.add(load.job.req_id)
                else:
                    pending.append(load)
        with self._async_lock:
            self._async_loads[:0] = pending
        return finished

    def in_flight(self) -> dict[str, int]:
        """What this worker holds for loads now (read-only; tests count leaks with it).

        Returns:
            ``loads``: asynchronous loads not yet reported in ``finished_recving``;
            ``writing``: those of them scattering into vLLM's cache now (each under its lease);
            ``failed_blocks``: vLLM blocks that failed to load, not yet reported.
        """
        with self._async_lock:
            loads = list(self._async_loads)
        with self._fail_lock:
            failed_blocks = len(self._failed_block_ids)
        return {"loads": len(loads), "writing": sum(load.writing and not load.done for load in loads),
                "failed_blocks": failed_blocks}

    def _fetch(self, job: LoadJob) -> Fetched:
        """The job's blocks, by the fetch this worker's client and cache take (``kvstore.connectors.kit.fetch``):
        leased in place on a CPU cache, else copied into a staging tensor, else decoded."""
        return self._fetch_blocks.fetch(self.namespace(job.tenant), job.hashes[self.rank], None,
                                        agentic(job.session_id, job.ttl_s))

    def _write(self, job: LoadJob, fetched: Fetched) -> None:
        """Write the good prefix of the fetched blocks into vLLM's cache; report the rest, delete the bad one."""
        try:
            self._write_good(job, fetched)
        finally:
            fetched.release()

    def _write_good(self, job: LoadJob, fetched: Fetched) -> None:
        """Scatter the checked blocks (each ``block_shape``) into the job's vLLM blocks; delete the bad one, if any.

        The blocks are tensors, or numpy arrays over leased memory (``kvstore.connectors.kit.leased``); a lease
        that ran out during the scatter (its memory may hold another Get's bytes) fails the whole load, so it is
        recomputed, never served half-written. Blocks the lookup found and the store no longer had (evicted or
        deleted in between) are counted as ``lost_blocks``.
        """
        expected = job.hashes[self.rank]
        fmt = self.paged.page_format
        num_good = fetched.num_good
        if fetched.bad is not None:
            logger.warning("kvstore block %d of request %s is %s: recomputing it, and deleting it from the store",
                           job.first_block + num_good, job.req_id, fetched.bad)
            self._delete(self.namespace(job.tenant), [expected[num_good]])
        if num_good:
            skip_units = job.skip_tokens // fmt.unit_tokens
            num_units = num_good * self.units_per_kv_block - skip_units
            units = self.paged.units_of(job.block_ids)[:num_units]
            first_units = [skip_units] + [0] * (num_good - 1)
            try:
                if fetched.arrays is not None:
                    self.paged.scatter_arrays(units, fetched.arrays, self.units_per_kv_block, first_units)
                else:
                    assert fetched.tensors is not None
                    self.paged.scatter(units, fetched.tensors, self.units_per_kv_block, first_units)
            except Exception:  # noqa: BLE001 - never leave a half-written load counted as loaded
                logger.exception("writing kvstore blocks of request %s into vLLM's cache failed", job.req_id)
                self._fail(job, 0, len(expected))
                return
            if not fetched.still_valid():
                logger.warning("the lease on kvstore blocks of request %s ran out while they were copied: "
                               "recomputing them", job.req_id)
                self._fail(job, 0, len(expected))
                return
            self._count(loaded_blocks=num_good, loaded_tokens=num_good * self.block_size)
        if fetched.num_found < len(expected):
            lost = len(expected) - fetched.num_found
            logger.warning("kvstore blocks %d-%d of request %s were found by its lookup but gone at its load "
                           "(evicted or deleted in between): recomputing them", job.first_block + fetched.num_found,
                           job.first_block + len(expected) - 1, job.req_id)
            self._count(lost_blocks=lost)
        if num_good < len(expected):
            self._fail(job, num_good, len(expected))

    def _fail(self, job: LoadJob, first_bad: int, num_blocks: int) -> None:
        """Report the vLLM blocks of kvstore blocks ``first_bad`` onwards of a load as not loaded."""
        ratio = self.block_size // self.vllm_block_size
        skipped = job.skip_tokens // self.vllm_block_size
        start = max(0, first_bad * ratio - skipped)
        with self._fail_lock:
            self._failed_block_ids.update(job.block_ids[start:])
            self._failed_loads[job.req_id] = min(job.first_block + first_bad,
                                                 self._failed_loads.get(job.req_id, job.first_block + first_bad))
        self._count(load_failed_blocks=max(0, num_blocks - first_bad))

    def take_load_errors(self) -> set[int]:
        """vLLM blocks that failed to load since the last call (vLLM recomputes them)."""
        with self._fail_lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_worker_meta(self) -> KVStoreWorkerMetadata | None:
        """The failed loads since the last call, for the scheduler (``None`` when there were none)."""
        with self._fail_lock:
            if not self._failed_loads:
                return None
            failed, self._failed_loads = self._failed_loads, {}
        return KVStoreWorkerMetadata(failed_loads=failed)

    # ------------------------------------------------------------------ saves

    def save(self, meta: KVStoreConnectorMetadata) -> None:
        """Copy the step's save jobs out of vLLM's cache and queue their puts; never raises."""
        for job in meta.saves:
            if job.at_finish:
                self._finished_sending.add(job.req_id)
            hashes = job.hashes.get(self.rank, [])
            if not self.writer or not hashes:
                continue
            if not self.health.up():
                self._count(save_failed_blocks=len(hashes))
                continue
            try:
                blocks = self.paged.gather(self.paged.units_of(job.block_ids), self.units_per_kv_block)
                if blocks.device.type != "cpu":
                    blocks = blocks.to("cpu")
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never an engine failure
                logger.exception("copying blocks of request %s out of vLLM's cache failed", job.req_id)
                self._count(save_failed_blocks=len(hashes))
                continue
            nbytes = blocks.numel() * blocks.element_size()
            put = self._put(self.namespace(job.tenant), hashes, blocks, agentic(job.session_id, job.ttl_s))
            future = self._saves.submit(put, nbytes)
            if future is None:
                logger.warning("kvstore save queue is full (%d bytes waiting): dropping %d blocks of request %s",
                               self._saves.pending_bytes, len(hashes), job.req_id)
                self._count(save_failed_blocks=len(hashes))
                continue
            future.add_done_callback(functools.partial(self._saved, len(hashes)))

    def _put(self, namespace: Namespace, hashes: list[BlockHash], blocks: torch.Tensor,
             extra: dict[str, Any]) -> Callable[[], int]:
        """The put of a save's copied blocks ``[num_blocks, *block_shape]``, counted when it is done."""
        def put() -> int:
            started = time.monotonic()
            stored = self.client.put(namespace, hashes, list(blocks), priority=self.config.priority,
                                     retention_s=self.config.retention_s, **extra)
            self._count(saved_blocks=len(hashes), saved_tokens=len(hashes) * self.block_size)
            self._observe("save_seconds", time.monotonic() - started)
            return stored

        return put

    def _saved(self, num_blocks: int, future: concurrent.futures.Future[int]) -> None:
        """Count a save that failed, or was not sent while the store was down (the queue logged the failure)."""
        if future.exception() is not None:
            self._count(save_failed_blocks=num_blocks)

    def _delete(self, namespace: Namespace, hashes: list[BlockHash]) -> None:
        """Delete a bad block from the store, after the saves queued before it (never raises)."""
        future = self._saves.submit(lambda: self.client.delete(namespace, hashes), guarded=False)
        assert future is not None  # no staged bytes: never refused
        future.add_done_callback(_log_failed_delete)

    def take_finished_sending(self) -> set[str]:
        """Requests whose end-of-request save has been copied out, so vLLM may free their blocks."""
        finished, self._finished_sending = self._finished_sending, set()
        return finished

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save and delete has reached the store (or failed); returns whether all did."""
        return self._saves.drain(timeout_s)

    def take_stats(self) -> KVStoreConnectorStats | None:
        """This worker's counts since the last call."""
        with self._stats_lock:
            return self._stats.take()

    def close(self) -> None:
        """Finish queued saves (for up to :data:`SHUTDOWN_DRAIN_S`), then close the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._saves.close(SHUTDOWN_DRAIN_S):  # no torch call left running at exit
            logger.warning("kvstore saves still queued at shutdown were dropped")
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        if self.endpoint is not None:
            self.endpoint.close()
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - shutting down
            logger.debug("closing the kvstore client failed", exc_info=True)


def open_worker_store(config: VLLMConnectorConfig) -> tuple[BlockClient, LookupEndpoint | None]:
    """The worker's store: a client of the nodes, or an embedded store with its lookup endpoint.

    Raises:
        ConfigError: on a bad config file, TLS or token file.
    """
    if not config.embedded:
        return open_client(config), None
    whole = embedded_config(config)
    store = EmbeddedStore(whole.store)
    try:
        return store, LookupEndpoint(store, whole)
    except BaseException:
        store.close()
        raise


def on_worker(fn: Callable[[WorkerSide], Any]) -> Callable[[Any], Any]:
    """A function for ``LLM.collective_rpc`` that runs ``fn`` on each worker's :class:`WorkerSide`.

    Example: ``llm.collective_rpc(on_worker(lambda w: w.drain(30)))`` waits for every worker's saves.
    vLLM sends a function to its workers only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
    (it is pickled), so use this between processes you own (tests, benchmarks).
    """
    def call(_worker: Any) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        side = getattr(connector, "worker_side", None)
        if side is None:
            raise RuntimeError("the engine's KV connector is not kvstore's, or its worker is not set up")
        return fn(side)

    return call
