"""Tests of a worker's half: saves and loads through a real embedded store, and every way a load can fail.

The paged KV is vLLM's CPU layout over plain tensors; failures come from the
store itself (a block that is not there) or from a client that misbehaves on
purpose (corrupt bytes, a block of another shape, a call that hangs). A failed
load must report exactly the vLLM blocks from the first bad one on, write
nothing for them, and count nothing as loaded.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvstore.api import Buffer
from kvstore.blocks.copying import copy_into_destinations
from kvstore.blocks.lease import BlockLease
from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, LoadJob, SaveJob, TenantKey
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.embedded import EmbeddedStore
from kvstore.errors import UnavailableError
from tests.support.server import ThreadedServer, finished_calls, make_config
from tests.connectors.vllm.support import (
    WORKER_HEAD_SIZE as D,
    WORKER_LAYERS as LAYERS,
    WORKER_RANK as RANK,
    H,
    cpu_caches,
    cpu_worker,
)
from tests.support.waiting import wait_until

class Proxy:
    """A block client that forwards to the store, but can corrupt, replace or hold back what ``get`` returns."""

    def __init__(self, store: EmbeddedStore) -> None:
        self.store = store
        self.edit: Any = None
        self.gate: threading.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def get(self, namespace: Any, hashes: Any) -> list[Buffer]:
        if self.gate is not None:
            self.gate.wait()
        blocks = self.store.get(namespace, hashes)
        return self.edit(blocks) if self.edit else blocks

    def get_into(self, namespace: Any, hashes: Any, destinations: Any, *, verify: bool | None = None) -> int:
        """The edited blocks copied as a gRPC client's ``get_into`` copies them (``kvstore.blocks.copying``): bytes
        that crossed a network are checked unless the caller says otherwise."""
        copied = copy_into_destinations(self.get(namespace, hashes), destinations, True if verify is None else verify)
        if copied.error is not None:
            raise copied.error
        return copied.num_copied


    def read(self, namespace: Any, hashes: Any) -> BlockLease:
        """The edited blocks as a gRPC client's ``read`` gives them: received buffers, not ``checked``."""
        return BlockLease(self.get(namespace, hashes), [])


class GetOnly(Proxy):
    """A client without ``read`` or ``get_into`` (a third party's ``BlockClient``): the worker checks and decodes
    encoded blocks."""

    get_into = None  # type: ignore[assignment]  # what the worker's getattr(client, "get_into", None) sees of none
    read = None  # type: ignore[assignment]


class GetIntoOnly(Proxy):
    """A client with ``get_into`` but no ``read``: the worker fetches into a staging tensor."""

    read = None  # type: ignore[assignment]

    def close(self) -> None:
        """The test closes the store."""


@pytest.fixture()
def store() -> Any:
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20))) as store:
        yield store


HASHES = [bytes([i]) * 16 for i in range(4)]  # stand-ins: the worker stores whatever hashes the scheduler names


def _save(worker: WorkerSide, block_ids: list[int], hashes: list[bytes] = HASHES, **kwargs: Any) -> None:
    job = SaveJob("s", TenantKey(), {RANK: hashes}, block_ids, **kwargs)
    worker.save(KVStoreConnectorMetadata(saves=[job]))
    assert worker.drain(30)


def _load(worker: WorkerSide, block_ids: list[int], hashes: list[bytes] = HASHES, skip_tokens: int = 0) -> set[int]:
    job = LoadJob("l", TenantKey(), 0, {RANK: hashes}, skip_tokens, block_ids)
    worker.start_load(KVStoreConnectorMetadata(loads=[job]))
    return worker.take_load_errors()


def _units_equal(a: list[torch.Tensor], a_ids: list[int], b: list[torch.Tensor], b_ids: list[int]) -> bool:
    return all(torch.equal(x[a_ids], y[b_ids]) for x, y in zip(a, b))


@pytest.mark.parametrize("client", [EmbeddedStore, GetOnly])
def test_saved_blocks_load_into_other_blocks_of_another_worker(store: EmbeddedStore, client: Any) -> None:
    source, target = cpu_caches(1), cpu_caches(2)
    saver, loader = cpu_worker(store, source), cpu_worker(store if client is EmbeddedStore else client(store), target)
    _save(saver, [3, 4, 9, 1, 0, 7, 12, 13])  # 4 kvstore blocks
    before = [t.clone() for t in target]
    assert _load(loader, [5, 6, 10, 11, 2, 8, 14, 15]) == set()
    assert _units_equal(source, [3, 4, 9, 1, 0, 7, 12, 13], target, [5, 6, 10, 11, 2, 8, 14, 15])
    assert _units_equal(before, [3, 4, 9], target, [3, 4, 9])  # nothing else written
    stats = loader.take_stats()
    assert stats is not None and stats.data["loaded_blocks"] == 4 and stats.data["load_failed_blocks"] == 0
    assert saver.take_stats().data["saved_blocks"] == 4


def test_loads_through_a_same_host_node_come_from_shared_memory_and_match_the_saved_blocks() -> None:
    node = ThreadedServer(make_config())
    try:
        with KVStoreClient(node.target, retries=0) as saver_client, KVStoreClient(node.target, retries=0) as client:
            source, target = cpu_caches(1), cpu_caches(2)
            saver, loader = cpu_worker(saver_client, source), cpu_worker(client, target)
            _save(saver, [3, 4, 9, 1, 0, 7, 12, 13])
            assert _load(loader, [5, 6, 10, 11, 2, 8, 14, 15]) == set()
            assert _units_equal(source, [3, 4, 9, 1, 0, 7, 12, 13], target, [5, 6, 10, 11, 2, 8, 14, 15])
            assert client.shared_memory() == ("attached",)
            assert finished_calls(node, "GetShared", 1) == 1
            # the load read the blocks in place under a lease, and gave it back after the scatter
            wait_until(lambda: node.server.shm.counters()["leases"] == 0, 30, "the load's lease went back")  # type: ignore[union-attr]
            assert node.server.shm.counters()["leases_expired"] == 0  # type: ignore[union-attr]
    finally:
        node.stop()


def test_a_block_partly_in_vllms_local_cache_is_written_only_past_it(store: EmbeddedStore) -> None:
    source, target = cpu_caches(1), cpu_caches(2)
    _save(cpu_worker(store, source), [3, 4, 9, 1], HASHES[:2])
    before = [t.clone() for t in target]
    assert _load(cpu_worker(store, target), [6, 7, 8], HASHES[:2], skip_tokens=32) == set()  # vLLM has tokens 0..31
    assert _units_equal(source, [4, 9, 1], target, [6, 7, 8])
    assert _units_equal(before, [5], target, [5])


def test_a_miss_after_the_lookup_reports_the_missing_blocks_and_writes_nothing_for_them(store: EmbeddedStore) -> None:
    source, target = cpu_caches(1), cpu_caches(2)
    _save(cpu_worker(store, source), [3, 4, 9, 1], HASHES[:2])  # only 2 of the 4 blocks are in the store
    before = [t.clone() for t in target]
    loader = cpu_worker(store, target)
    assert _load(loader, [5, 6, 10, 11, 2, 8, 14, 15]) == {2, 8, 14, 15}
    assert _units_equal(source, [3, 4, 9, 1], target, [5, 6, 10, 11])
    assert _units_equal(before, [2, 8, 14, 15], target, [2, 8, 14, 15])
    stats = loader.take_stats()
    assert stats.data["loaded_blocks"] == 2 and stats.data["load_failed_blocks"] == 2
    meta = loader.take_worker_meta()
    assert meta is not None and meta.failed_loads == {"l": 2}
    assert loader.take_worker_meta() is None and loader.take_load_errors() == set()


@pytest.mark.parametrize("client", [Proxy, GetIntoOnly, GetOnly])
@pytest.mark.parametrize("damage", ["checksum", "shape", "dtype"])
def test_a_corrupt_or_mismatched_block_is_recomputed_and_deleted(store: EmbeddedStore, damage: str,
                                                                   client: type[Proxy]) -> None:
    source, target = cpu_caches(1), cpu_caches(2)
    saver = cpu_worker(store, source)
    _save(saver, [3, 4, 9, 1, 0, 7], HASHES[:3])
    proxy = client(store)

    def edit(blocks: list[Buffer]) -> list[Buffer]:
        bad = bytearray(blocks[1])
        if damage == "checksum":
            bad[-1] ^= 0xFF  # one flipped bit of payload
        elif damage == "shape":
            bad = bytearray(encode_block(torch.zeros(LAYERS + 1, 2, H, 64, D, dtype=torch.bfloat16)))
        else:
            bad = bytearray(encode_block(torch.zeros(LAYERS, 2, H, 64, D, dtype=torch.float16)))
        return [blocks[0], bytes(bad), *blocks[2:]]

    proxy.edit = edit
    before = [t.clone() for t in target]
    loader = cpu_worker(proxy, target)
    assert _load(loader, [5, 6, 10, 11, 2, 8], HASHES[:3]) == {10, 11, 2, 8}  # block 1 and all after it
    assert _units_equal(source, [3, 4], target, [5, 6])
    assert _units_equal(before, [10, 11, 2, 8], target, [10, 11, 2, 8])
    assert loader.drain(30)
    namespace = loader.namespace(TenantKey())
    assert store.lookup(namespace, HASHES[:3]).num_blocks == 1  # the bad block is gone, a new save replaces it


def test_a_load_that_hangs_is_given_up_after_the_timeout(store: EmbeddedStore) -> None:
    _save(cpu_worker(store, cpu_caches(1)), [3, 4, 9, 1], HASHES[:2])
    proxy = Proxy(store)
    proxy.gate = threading.Event()  # the store never answers until the test ends
    target = cpu_caches(2)
    before = [t.clone() for t in target]
    loader = cpu_worker(proxy, target, timeout_s=0.2, down_backoff_s=3600)
    try:
        assert _load(loader, [5, 6, 10, 11], HASHES[:2]) == {5, 6, 10, 11}
        assert _units_equal(before, [5, 6, 10, 11], target, [5, 6, 10, 11])
        # the store is now down for the backoff: the next load fails at once, without calling it
        assert _load(loader, [5, 6, 10, 11], HASHES[:2]) == {5, 6, 10, 11}
        assert loader.take_stats().data["load_failed_blocks"] == 4
    finally:
        proxy.gate.set()


def test_saves_are_dropped_and_counted_while_the_store_is_down(store: EmbeddedStore) -> None:
    class Down(Proxy):
        def put(self, *args: Any, **kwargs: Any) -> int:
            raise UnavailableError("node down")

    worker = cpu_worker(Down(store), cpu_caches(1), down_backoff_s=3600)
    _save(worker, [3, 4], HASHES[:1])
    _save(worker, [9, 1], HASHES[1:2], at_finish=True)
    assert worker.take_finished_sending() == {"s"}  # vLLM may free the blocks whatever happened to the put
    stats = worker.take_stats()
    assert stats.data["saved_blocks"] == 0 and stats.data["save_failed_blocks"] == 2


def test_saves_past_the_pending_limit_are_dropped(store: EmbeddedStore) -> None:
    proxy = Proxy(store)
    block_bytes = LAYERS * 2 * H * 64 * D * 2
    worker = cpu_worker(proxy, cpu_caches(1), max_pending_save_bytes=block_bytes)
    hold = threading.Event()
    proxy.put = lambda *a, **k: hold.wait() or 1  # the first put waits, so the queue stays full
    job = lambda i: SaveJob(f"s{i}", TenantKey(), {RANK: [HASHES[i]]}, [2 * i, 2 * i + 1])  # noqa: E731
    worker.save(KVStoreConnectorMetadata(saves=[job(0), job(1)]))
    hold.set()
    assert worker.drain(30)
    stats = worker.take_stats()
    assert stats.data["saved_blocks"] == 1 and stats.data["save_failed_blocks"] == 1


def test_a_job_with_nothing_to_fetch_reports_every_block(store: EmbeddedStore) -> None:
    worker = cpu_worker(store, cpu_caches(1))
    job = LoadJob("l", TenantKey(), 0, {}, 0, [3, 4, 5])
    worker.start_load(KVStoreConnectorMetadata(loads=[job]))
    assert worker.take_load_errors() == {3, 4, 5}


class Gated(Proxy):
    """The store's own in-place ``read``, which waits for ``gate`` first (a slow node)."""

    def read(self, namespace: Any, hashes: Any) -> BlockLease:
        assert self.gate is not None
        self.gate.wait()
        return self.store.read(namespace, hashes)


def _load_async(worker: WorkerSide, block_ids: list[int], hashes: list[bytes] = HASHES) -> None:
    worker.start_load(KVStoreConnectorMetadata(loads=[LoadJob("l", TenantKey(), 0, {RANK: hashes}, 0, block_ids)]))


def test_an_asynchronous_load_returns_at_once_and_is_reported_when_written(store: EmbeddedStore) -> None:
    source, target = cpu_caches(1), cpu_caches(2)
    _save(cpu_worker(store, source), [3, 4, 9, 1, 0, 7, 12, 13])
    proxy = Gated(store)
    proxy.gate = threading.Event()
    loader = cpu_worker(proxy, target, load_async=True)
    _load_async(loader, [5, 6, 10, 11, 2, 8, 14, 15])  # returns while the store holds the fetch back
    assert loader.take_finished_recving() == set()
    assert loader.in_flight() == {"loads": 1, "writing": 0, "failed_blocks": 0}
    proxy.gate.set()
    finished: set[str] = set()
    wait_until(lambda: finished.update(loader.take_finished_recving()) or "l" in finished, 30, "the load ended")
    assert loader.take_load_errors() == set()
    assert loader.in_flight() == {"loads": 0, "writing": 0, "failed_blocks": 0}  # reported: nothing held
    assert _units_equal(source, [3, 4, 9, 1, 0, 7, 12, 13], target, [5, 6, 10, 11, 2, 8, 14, 15])
    assert loader.take_stats().data["loaded_blocks"] == 4
    assert store.stats().tiers[0].hits == 4  # the lease went back once written


def test_an_asynchronous_load_past_its_deadline_is_reported_failed_and_never_written(store: EmbeddedStore) -> None:
    _save(cpu_worker(store, cpu_caches(1)), [3, 4, 9, 1], HASHES[:2])
    proxy = Gated(store)
    proxy.gate = threading.Event()
    target = cpu_caches(2)
    before = [t.clone() for t in target]
    loader = cpu_worker(proxy, target, load_async=True, timeout_s=0.2, down_backoff_s=3600)
    _load_async(loader, [5, 6, 10, 11], HASHES[:2])
    wait_until(lambda: loader.take_finished_recving() == {"l"}, 30, "the load was given up at its deadline")
    assert loader.in_flight() == {"loads": 0, "writing": 0, "failed_blocks": 4}  # reported next, by vLLM's order
    assert loader.take_load_errors() == {5, 6, 10, 11}  # read by vLLM in the same step as the finished receive
    proxy.gate.set()  # the fetch ends now: its lease goes back, and nothing is written
    wait_until(lambda: store.stats().tiers[0].hits == 2, 30, "the late fetch gave its lease back")
    assert _units_equal(before, [5, 6, 10, 11], target, [5, 6, 10, 11])
    assert loader.take_finished_recving() == set() and loader.take_stats().data["loaded_blocks"] == 0


def test_a_failed_asynchronous_load_reports_its_blocks_with_or_before_its_end(store: EmbeddedStore) -> None:
    _save(cpu_worker(store, cpu_caches(1)), [3, 4], HASHES[:1])  # one of the two blocks is in the store
    loader = cpu_worker(store, cpu_caches(2), load_async=True)
    _load_async(loader, [5, 6, 10, 11], HASHES[:2])
    errors: set[int] = set()

    def ended() -> bool:
        done = loader.take_finished_recving()  # vLLM's order: get_finished, then the load errors
        errors.update(loader.take_load_errors())
        return "l" in done

    wait_until(ended, 30, "the load ended")
    assert errors == {10, 11}
    assert loader.take_worker_meta().failed_loads == {"l": 1}
