"""The worker's hit path in place: leases checked as a batch, payloads viewed with no copy, scattered by numpy."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.blocks.lease import BlockLease
from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, LoadJob, TenantKey
from kvstore.connectors.vllm.layout import KVFamily, PagedKV, PageFormat, canonical_view
from kvstore.connectors.vllm.loading import view_leased
from kvstore.embedded import EmbeddedStore
from kvstore.keys import Namespace
from tests.connectors.vllm.support import NUM_UNITS, WORKER_FORMAT as FORMAT, WORKER_RANK as RANK, cpu_caches, cpu_worker, page_format, random_cache
from tests.support.server import ThreadedServer, make_config
from tests.support.waiting import wait_until

H, N, D, LAYERS = 2, 32, 32, 2
SHAPE = FORMAT.block_shape(N)
NAMESPACE = Namespace(model="test/loading", dtype="bfloat16", block_size=N)
HASHES = [bytes([i + 1]) * 16 for i in range(6)]


def _blocks(seed: int, num_blocks: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*SHAPE, generator=generator).bfloat16() for _ in range(num_blocks)]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).view(torch.bfloat16)  # a copy: the leased memory is read-only


@pytest.fixture()
def node() -> Any:
    server = ThreadedServer(make_config())
    yield server
    server.stop()


def test_a_same_host_lease_is_one_strided_view_of_the_segment_with_no_copy(node: ThreadedServer) -> None:
    blocks = _blocks(1)
    with KVStoreClient(node.target, retries=0) as client:
        client.put(NAMESPACE, HASHES, blocks)
        lease = client.read(NAMESPACE, HASHES)
        try:
            assert client.shared_memory() == ("attached",) and lease.checked and lease.offsets is not None
            viewed = view_leased(lease, FORMAT, SHAPE)
            assert viewed.num_good == 6 and viewed.bad is None
            assert isinstance(viewed.arrays, np.ndarray) and viewed.arrays.shape == (6, *SHAPE)
            assert not viewed.arrays.flags.owndata and not viewed.arrays.flags.writeable  # the read-only segment
            assert all(torch.equal(_as_tensor(viewed.arrays[i]), blocks[i]) for i in range(6))
        finally:
            lease.release()
        wait_until(lambda: node.server.shm.counters()["leases"] == 0, 30, "the lease went back")  # type: ignore[union-attr]


def test_an_embedded_lease_views_the_blocks_in_the_stores_memory_as_one_array() -> None:
    blocks = _blocks(2)
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20))) as store:
        store.put(NAMESPACE, HASHES, blocks)  # one put: its blocks lie one after another in the page pool
        lease = store.read(NAMESPACE, HASHES)
        store.delete(NAMESPACE, HASHES)  # held by the read: the views stay what was stored
        store.clear(NAMESPACE)
        try:
            assert lease.checked and lease.offsets is not None and len(lease) == 6
            viewed = view_leased(lease, FORMAT, SHAPE)
            assert viewed.num_good == 6 and not isinstance(viewed.arrays, list)
            assert not viewed.arrays.flags.writeable  # a view of the pool a reader cannot write through
            assert all(torch.equal(_as_tensor(a), b) for a, b in zip(viewed.arrays, blocks))
        finally:
            lease.release()
        assert store.lookup(NAMESPACE, HASHES).num_blocks == 0


@pytest.mark.parametrize("damage", ["checksum", "shape", "dtype", "truncated"])
def test_a_network_lease_is_checked_block_by_block_and_ends_at_the_first_bad_one(damage: str) -> None:
    encoded = [encode_block(b) for b in _blocks(3)]
    bad = bytearray(encoded[3])
    if damage == "checksum":
        bad[-1] ^= 0x01
    elif damage == "shape":
        bad = bytearray(encode_block(torch.zeros(LAYERS, 2, H, 2 * N, D, dtype=torch.bfloat16)))
    elif damage == "dtype":
        bad = bytearray(encode_block(torch.zeros(*SHAPE, dtype=torch.float16)))
    else:
        bad = bad[:-2]
    viewed = view_leased(BlockLease([*encoded[:3], bytes(bad), *encoded[4:]], []), FORMAT, SHAPE)
    assert viewed.num_good == 3 and viewed.bad is not None
    assert ("corrupt" in viewed.bad) == (damage in ("checksum", "truncated"))


def test_a_checked_lease_compares_headers_so_another_shape_still_ends_the_prefix() -> None:
    encoded = [encode_block(b) for b in _blocks(4)]
    encoded[2] = encode_block(torch.zeros(LAYERS, 2, H, N, 2 * D, dtype=torch.bfloat16))
    viewed = view_leased(BlockLease(encoded, [], checked=True), FORMAT, SHAPE)
    assert viewed.num_good == 2 and viewed.bad == "of bfloat16/kv [2, 2, 2, 32, 64], not bfloat16/kv [2, 2, 2, 32, 32]"
    first = view_leased(BlockLease([encode_block(torch.zeros(*SHAPE))], [], checked=True), FORMAT, SHAPE)
    assert first.num_good == 0 and "float32" in (first.bad or "")


@pytest.mark.parametrize("units", [[5, 6, 7, 8], [9, 2, 14, 3]], ids=["a run", "scattered"])
def test_scatter_arrays_writes_exactly_the_units_named(units: list[int]) -> None:
    caches = cpu_caches(5)
    paged = PagedKV(FORMAT, [canonical_view(c, KVFamily.SPLIT_TOKENS, H, D, N) for c in caches], 1)
    before = [c.clone() for c in caches]
    blocks = torch.stack(_blocks(6, 4))
    strided = blocks.view(torch.int16).numpy()
    paged.scatter_arrays(units, strided, 1)
    assert torch.equal(paged.gather(units, 1), blocks)
    others = [u for u in range(16) if u not in units]
    assert all(torch.equal(c[others], b[others]) for c, b in zip(caches, before))
    listed = _blocks(7, 4)
    paged.scatter_arrays(units, [b.view(torch.int16).numpy() for b in listed], 1)
    assert torch.equal(paged.gather(units, 1), torch.stack(listed))


def test_a_lease_that_ran_out_during_the_scatter_is_recomputed_whole() -> None:
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20))) as store:
        saver = cpu_worker(store, cpu_caches(1))
        namespace = saver.namespace(TenantKey())
        store.put(namespace, HASHES[:2], [torch.randn(LAYERS, 2, H, 2 * N, D).bfloat16() for _ in range(2)])

        class RunsOut:
            """The store's own read, whose lease the client's clock says has ended (``lease_s`` passed)."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def read(self, ns: Namespace, hashes: Any) -> BlockLease:
                lease = store.read(ns, hashes)
                lease.expires_at = time.monotonic() - 1.0
                return lease

        loader = cpu_worker(RunsOut(), cpu_caches(2))
        job = LoadJob("l", TenantKey(), 0, {RANK: HASHES[:2]}, 0, [5, 6, 10, 11])
        loader.start_load(KVStoreConnectorMetadata(loads=[job]))
        assert loader.take_load_errors() == {5, 6, 10, 11}
        assert loader.take_stats().data["load_failed_blocks"] == 2
        # the read went back: a store's read counts its hits when it is closed (``BlockRead.close``)
        assert store.stats().tiers[0].hits == 2


@pytest.mark.parametrize("family", [KVFamily.SPLIT_TOKENS, KVFamily.SPLIT_CHANNELS, KVFamily.LATENT])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ids", [([1, 2, 3], [4, 5, 6]), ([6, 0, 3], [2, 7, 1])], ids=["runs", "scattered"])
def test_whole_vllm_blocks_gather_and_scatter_by_numpy_in_every_family(family: KVFamily, dtype: torch.dtype,
                                                                       ids: tuple[list[int], list[int]]) -> None:
    """kvstore blocks of one vLLM block each (one strided numpy copy per layer for a run of units)."""
    head_size = 3 * D if family is KVFamily.LATENT else D
    heads = 1 if family is KVFamily.LATENT else H
    content = head_size if family is KVFamily.LATENT else 2 * D
    source, target = ([random_cache(NUM_UNITS, heads, N, content, dtype=torch.float32).to(dtype) for _ in range(2)]
                      for _ in range(2))
    before = [t.clone() for t in target]
    fmt = page_format(family, dtype=str(dtype).removeprefix("torch."), heads=heads, head_size=head_size)
    src, dst = (PagedKV(fmt, [canonical_view(t, family, heads, head_size, N) for t in layers], 1)
                for layers in (source, target))
    blocks = src.gather(ids[0], 1)
    dst.scatter(ids[1], blocks, 1)
    for layer in range(2):
        for s, d in zip(*ids):
            assert torch.equal(source[layer][s].view(torch.uint8), target[layer][d].view(torch.uint8))
        untouched = [u for u in range(NUM_UNITS) if u not in ids[1]]
        assert torch.equal(target[layer][untouched].view(torch.uint8), before[layer][untouched].view(torch.uint8))
