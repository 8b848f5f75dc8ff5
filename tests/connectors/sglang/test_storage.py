"""The SGLang HiCache backend against SGLang's real ABC and host pools (on CPU), with embedded stores and real nodes."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvstore import open_store
from kvstore.config import StoreConfig
from kvstore.connectors.sglang import HybridModelError, KVStoreHiCacheStorage
from kvstore.errors import ConfigError
from tests.connectors.sglang.harness import (
    LAYOUTS,
    fill_random,
    host_indices,
    mha_pool,
    mla_pool,
    page_keys,
    pages_of,
    storage_config,
)

PAGE = 4
NUM_PAGES = 5


@pytest.fixture
def store():
    with open_store(StoreConfig()) as opened:
        yield opened


def backend(store, pool, **config_kwargs) -> KVStoreHiCacheStorage:
    """A backend over ``store`` with ``pool`` registered, as SGLang's cache controller sets it up."""
    extra = config_kwargs.pop("extra", None)
    storage = KVStoreHiCacheStorage(storage_config(extra, **config_kwargs), {}, store=store)
    storage.register_mem_pool_host(pool)
    return storage


def round_trip(store, make_pool, layout, dtype, *, is_mla):
    writer_pool, reader_pool = make_pool(layout, dtype), make_pool(layout, dtype)
    fill_random(writer_pool, seed=1)
    keys = page_keys(NUM_PAGES, PAGE)
    src, dst = host_indices(1, NUM_PAGES, PAGE), host_indices(7, NUM_PAGES, PAGE)
    writer = backend(store, writer_pool, is_mla=is_mla, page_first=layout == "page_first")
    reader = backend(store, reader_pool, is_mla=is_mla, page_first=layout == "page_first")
    assert writer.batch_set_v1(keys, src) == [True] * NUM_PAGES
    assert reader.batch_exists(keys) == NUM_PAGES
    assert reader.batch_get_v1(keys, dst) == [True] * NUM_PAGES
    for got, want in zip(pages_of(reader_pool, dst, NUM_PAGES), pages_of(writer_pool, src, NUM_PAGES)):
        assert torch.equal(got, want)
    stats = reader.stats()
    assert stats.hit_pages == NUM_PAGES and stats.errors == 0
    assert stats.read_bytes == NUM_PAGES * writer_pool.get_data_page(0).numel() * writer_pool.dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mha_pages_round_trip_in_every_layout(store, layout, dtype):
    round_trip(store, mha_pool, layout, dtype, is_mla=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_round_trip_in_every_layout(store, layout, dtype):
    round_trip(store, mla_pool, layout, dtype, is_mla=True)


def test_it_is_a_real_hicache_storage_with_every_abstract_method(store):
    storage = backend(store, mha_pool("page_first"))
    assert isinstance(storage, HiCacheStorage)
    assert not KVStoreHiCacheStorage.__abstractmethods__


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_copying_interface_shares_pages_with_the_zero_copy_pair(store, layout):
    pool = mha_pool(layout)
    fill_random(pool, seed=2)
    storage = backend(store, pool)
    keys = page_keys(3, PAGE)
    src = host_indices(0, 3, PAGE)
    assert storage.batch_set(keys, [pool.get_data_page(int(src[i * PAGE])) for i in range(3)])
    assert [storage.exists(k) for k in keys] == [True] * 3
    dst = host_indices(4, 3, PAGE)
    assert storage.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(pool, dst, 3), pages_of(pool, src, 3)))
    got = storage.batch_get(keys + page_keys(1, PAGE, first_token=999), [pool.get_dummy_flat_data_page()
                                                                         for _ in range(4)])
    assert got[3] is None and all(torch.equal(g, w) for g, w in zip(got[:3], pages_of(pool, src, 3)))
    single = storage.get(keys[0], pool.get_dummy_flat_data_page())
    assert torch.equal(single, pages_of(pool, src, 1)[0])


def test_batch_exists_counts_the_stored_prefix(store):
    pool = mha_pool("page_first")
    fill_random(pool, seed=3)
    storage = backend(store, pool)
    keys = page_keys(6, PAGE)
    indices = host_indices(0, 6, PAGE)
    assert storage.batch_set_v1(keys[:3], indices[:3 * PAGE]) == [True] * 3
    assert storage.batch_set_v1(keys[4:], indices[4 * PAGE:]) == [True] * 2  # page 3 is missing
    assert storage.batch_exists(keys) == 3
    assert storage.batch_exists(keys[4:]) == 2
    assert storage.batch_get_v1(keys, host_indices(8, 6, PAGE)) == [True] * 3 + [False] * 3


def test_tp_ranks_are_kept_apart_and_mla_pages_are_shared(store):
    keys = page_keys(2, PAGE)
    indices = host_indices(0, 2, PAGE)
    mha = [mha_pool("page_first") for _ in range(2)]
    fill_random(mha[0], seed=4)
    rank0, rank1 = (backend(store, mha[r], tp_rank=r, tp_size=2) for r in range(2))
    assert rank0.batch_set_v1(keys, indices) == [True, True]
    assert rank1.batch_exists(keys) == 0
    assert rank0.batch_exists(keys) == 2

    mla = [mla_pool("page_first") for _ in range(2)]
    fill_random(mla[0], seed=5)
    fill_random(mla[1], seed=6)
    mla0, mla1 = (backend(store, mla[r], tp_rank=r, tp_size=2, is_mla=True) for r in range(2))
    assert mla1.batch_set_v1(keys, indices) == [True, True]  # not the writer: nothing stored
    assert mla0.batch_exists(keys) == 0
    assert mla0.batch_set_v1(keys, indices) == [True, True]
    dst = host_indices(4, 2, PAGE)
    assert mla1.batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(mla[1], dst, 2), pages_of(mla[0], indices, 2)))


@pytest.mark.parametrize("other", [
    {"model": "test/other-model"},
    {"pool": lambda: mha_pool("page_first", torch.bfloat16)},
    {"pool": lambda: mha_pool("page_first", page_size=8)},
    {"pool": lambda: mha_pool("page_first", num_heads=4)},
    {"pool": lambda: mha_pool("layer_first")},
    {"extra": {"tenant": "someone-else"}},
    {"tp": (0, 2)},
], ids=["model", "dtype", "page-size", "heads", "byte-order", "tenant", "tp-size"])
def test_engines_that_differ_never_share_pages(store, other):
    keys = page_keys(2, PAGE)
    pool = mha_pool("page_first")
    fill_random(pool, seed=7)
    assert backend(store, pool).batch_set_v1(keys, host_indices(0, 2, PAGE)) == [True, True]
    other_pool = other.get("pool", lambda: mha_pool("page_first"))()
    tp_rank, tp_size = other.get("tp", (0, 1))
    reader = backend(store, other_pool, model=other.get("model", "test/model"), extra=other.get("extra"),
                     tp_rank=tp_rank, tp_size=tp_size)
    assert reader.batch_exists(keys) == 0
    assert backend(store, mha_pool("page_first")).batch_exists(keys) == 2  # the same engine again shares them


def test_layer_first_and_page_first_direct_pages_are_the_same_bytes_and_shared(store):
    keys = page_keys(2, PAGE)
    first, direct = mha_pool("layer_first"), mha_pool("page_first_direct")
    fill_random(first, seed=8)
    src, dst = host_indices(0, 2, PAGE), host_indices(4, 2, PAGE)
    assert backend(store, first).batch_set_v1(keys, src) == [True, True]
    assert backend(store, direct).batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(direct, dst, 2), pages_of(first, src, 2)))


def test_an_unknown_setting_stops_start_up_naming_it(store):
    with pytest.raises(ConfigError, match="hicache_storage_backend_extra_config.tagret"):
        KVStoreHiCacheStorage(storage_config({"tagret": "127.0.0.1:1"}), {}, store=store)
    with pytest.raises(ConfigError, match="priority"):
        KVStoreHiCacheStorage(storage_config({"priority": 101}), {}, store=store)


def test_a_hybrid_model_is_refused_at_registration(store):
    storage = backend(store, mha_pool("page_first"))
    storage.register_mem_host_pool_v2(mha_pool("page_first"), "kv")
    with pytest.raises(HybridModelError, match="mamba"):
        storage.register_mem_host_pool_v2(mha_pool("page_first"), "mamba")
    with pytest.raises(HybridModelError):
        storage.batch_get_v2([])


def test_sglang_storage_metrics_report_pages_and_bandwidth(store):
    pool = mha_pool("page_first")
    storage = backend(store, pool, metrics=True)
    keys = page_keys(3, PAGE)
    storage.batch_set_v1(keys, host_indices(0, 3, PAGE))
    storage.batch_get_v1(keys, host_indices(4, 3, PAGE))
    metrics = storage.take_transfer_metrics()
    assert metrics["backup_pgs"] == [3] and metrics["prefetch_pgs"] == [3]
    assert len(metrics["backup_bandwidth"]) == 1 and metrics["prefetch_bandwidth"][0] > 0
    assert storage.take_transfer_metrics()["prefetch_pgs"] == []  # drained, as SGLang's own backends do
    assert backend(store, pool).get_stats() is None  # storage metrics off
