"""The connector kit: the block-fits check, the fetch handlers each client gets, and the save queue."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.blocks.copying import block_mismatch
from kvstore.blocks.tensors import Layout, decode_header, encode_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.connectors.kit.fetch import CopyHandler, DecodeHandler, LeaseHandler, fetch_handler, fetch_into
from kvstore.connectors.kit.saves import SaveQueue, StoreDownError
from kvstore.connectors.kit.spec import BlockSpec
from kvstore.connectors.kit.stores import StoreHealth
from kvstore.embedded import EmbeddedStore
from kvstore.keys import BlockHash, Namespace

SHAPE = (2, 2, 2, 16, 8)
OTHER_SHAPE = (2, 2, 4, 16, 8)
NAMESPACE = Namespace(model="test/kit", dtype="bfloat16", block_size=16)
SPEC = BlockSpec("bfloat16", Layout.KV, SHAPE)
HASHES = [BlockHash(bytes([i + 1]) * 16) for i in range(4)]


@pytest.fixture()
def store() -> Any:
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20))) as store:
        yield store


def test_a_block_fits_only_a_destination_of_its_dtype_layout_and_shape() -> None:
    header = decode_header(encode_block(torch.zeros(SHAPE, dtype=torch.bfloat16)))
    assert block_mismatch(header, "bfloat16", SHAPE, Layout.KV) == ""
    assert block_mismatch(header, "bfloat16", layout="kv") == ""  # what is not given is not compared
    assert block_mismatch(header, "float16", SHAPE) == f"bfloat16 {list(SHAPE)}, not float16 {list(SHAPE)}"
    assert block_mismatch(header, "bfloat16", layout=Layout.MLA) == "bfloat16/kv, not bfloat16/mla"
    assert SPEC.mismatch(header) == ""


class _GetOnly:
    """A third party's client: ``get`` and nothing faster."""

    read = None
    get_into = None

    def __init__(self, store: EmbeddedStore) -> None:
        self.get = store.get


def test_each_client_gets_the_best_handler_it_offers(store: EmbeddedStore) -> None:
    assert isinstance(fetch_handler(store, SPEC, in_place=True), LeaseHandler)
    assert isinstance(fetch_handler(store, SPEC), CopyHandler)
    assert isinstance(fetch_handler(_GetOnly(store), SPEC, in_place=True), DecodeHandler)


@pytest.mark.parametrize("how", ["lease", "copy", "decode"])
def test_every_handler_ends_the_prefix_at_a_block_that_does_not_fit(store: EmbeddedStore, how: str) -> None:
    blocks = [torch.randn(SHAPE).bfloat16() for _ in HASHES]
    store.put(NAMESPACE, HASHES[:2], blocks[:2])
    store.put(NAMESPACE, HASHES[2:], [torch.zeros(OTHER_SHAPE, dtype=torch.bfloat16)] * 2)  # more heads from block 2
    client: Any = _GetOnly(store) if how == "decode" else store
    handler = fetch_handler(client, SPEC, in_place=how == "lease")
    fetched = handler.fetch(NAMESPACE, HASHES, None, {})
    try:
        assert (fetched.num_good, fetched.num_found) == (2, 4) and str(list(OTHER_SHAPE)) in str(fetched.bad)
        got = fetched.arrays if how == "lease" else fetched.tensors
        assert got is not None
        for block, want in zip(got, blocks):
            copied = torch.from_numpy(np.array(block)) if isinstance(block, np.ndarray) else block  # leased: read-only
            assert torch.equal(copied.view(torch.bfloat16), want)
    finally:
        fetched.release()


def test_fetch_into_copies_the_prefix_into_the_destinations(store: EmbeddedStore) -> None:
    blocks = [torch.randn(SHAPE).bfloat16() for _ in HASHES]
    store.put(NAMESPACE, HASHES[:3], blocks[:3])
    destinations = list(torch.zeros((4, *SHAPE), dtype=torch.bfloat16))
    fetched = fetch_into(store, NAMESPACE, HASHES, destinations, SPEC)
    assert (fetched.num_good, fetched.num_found, fetched.bad) == (3, 3, None)
    assert all(torch.equal(d, b) for d, b in zip(destinations, blocks[:3]))


def test_the_save_queue_bounds_its_staging_and_skips_a_store_that_is_down() -> None:
    now = [0.0]
    health = StoreHealth(10.0, clock=lambda: now[0])
    saves = SaveQueue(health, max_pending_bytes=100)
    gate = threading.Event()
    first = saves.submit(lambda: int(gate.wait(10)), 60)
    assert first is not None and saves.submit(lambda: 1, 60) is None  # past the bound: refused, not waited for
    gate.set()
    assert first.result(10) == 1 and saves.drain(10) and saves.pending_bytes == 0

    def fail() -> int:
        raise OSError("the node went away")

    failed = saves.submit(fail, 10)
    assert failed is not None and isinstance(failed.exception(10), OSError) and not health.up()
    skipped = saves.submit(lambda: 1, 10)
    assert skipped is not None and isinstance(skipped.exception(10), StoreDownError)
    deleted = saves.submit(lambda: 7, guarded=False)  # not a put: sent while the store is down
    assert deleted is not None and deleted.result(10) == 7
    now[0] = 11.0
    later = saves.submit(lambda: 1, 10)
    assert later is not None and later.result(10) == 1 and health.up()
    assert saves.close(10)
