"""A node's stats and ``/metrics`` show each tier's logical bytes (decoded, uncompressed) against its stored bytes,
and a compressing disk tier counts stored lengths against its capacity, so it holds more blocks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.blocks.encoding import encode_lossy
from kvstore.keys import hash_blocks
from kvstore.tiers.lmdb import default_map_size_bytes
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace, scrape


def _logical(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def _compressible_blocks(ns, num_blocks: int) -> tuple[list[bytes], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Blocks of few distinct values (as a quantized cache's are), which a byte shuffle and zstd shrink a lot."""
    hashes = hash_blocks(ns, list(range(num_blocks * ns.block_size)))
    generator = torch.Generator().manual_seed(num_blocks)
    tensors = [(torch.randint(-4, 4, (2, 2, 2, ns.block_size, 64), generator=generator) / 4).to(torch.float16)
               for _ in range(num_blocks)]
    return list(hashes), tensors


def test_stats_and_metrics_show_logical_and_stored_bytes_of_exact_and_lossy_blocks() -> None:
    exact, lossy = namespace(), namespace(kv_encoding="int8")
    exact_hashes, exact_tensors = kv_blocks(exact, 3)
    lossy_hashes, lossy_tensors = kv_blocks(lossy, 5, num_layers=4, head_dim=128)
    server = ThreadedServer(make_config(**{"store.memory.page_bytes": 4096}))
    try:
        memory = server.server.store.tiers[0]
        with KVStoreClient(server.target, retries=0) as kv:
            assert kv.put(exact, exact_hashes, exact_tensors) == 3
            assert kv.put(lossy, lossy_hashes, lossy_tensors) == 5
            stats = kv.stats().tier("memory")
        logical = 3 * _logical(exact_tensors[0]) + 5 * _logical(lossy_tensors[0])
        stored = (3 * memory.footprint(len(encode_block(exact_tensors[0])))
                  + 5 * memory.footprint(len(encode_lossy(lossy_tensors[0], "kv", "int8"))))
        assert (stats.blocks, stats.logical_bytes, stats.bytes) == (8, logical, stored)
        assert stats.logical_ratio == logical / stored
        assert 1.5 < stats.logical_ratio < 2  # int8 halves most of the bytes; pages and headers cost a little
        samples = scrape(server)
        assert samples['kvstore_tier_logical_bytes{tier="memory"}'] == logical
        assert samples['kvstore_tier_bytes{tier="memory"}'] == stored
        assert abs(samples['kvstore_tier_logical_ratio{tier="memory"}'] - logical / stored) < 1e-9
        with KVStoreClient(server.target, retries=0) as kv:
            kv.delete(lossy, lossy_hashes[:2])
            stats = kv.stats().tier("memory")
        assert stats.logical_bytes == 3 * _logical(exact_tensors[0]) + 3 * _logical(lossy_tensors[0])
    finally:
        server.stop()


def _disk_server(tmp_path: Path, compression: str, capacity_bytes: int) -> ThreadedServer:
    return ThreadedServer(make_config(**{
        "store.memory.enabled": False, "store.disk.path": str(tmp_path / "disk"),
        "store.disk.capacity_bytes": default_map_size_bytes(capacity_bytes), "store.disk.compression": compression,
    }))


@pytest.mark.slow
def test_a_compressing_disk_tier_counts_what_it_stores_and_holds_more_blocks(tmp_path: Path) -> None:
    ns = namespace()
    hashes, tensors = _compressible_blocks(ns, 12)
    block_bytes = len(encode_block(tensors[0]))
    held = {}
    for compression in ("none", "zstd"):
        server = _disk_server(tmp_path / compression, compression, 4 * (block_bytes + 8192))  # 4 raw blocks
        try:
            with KVStoreClient(server.target, retries=0) as kv:
                for i in range(0, 12, 2):
                    kv.put(ns, hashes[i:i + 2], tensors[i:i + 2])
                server.call(server.server.store.drain())
                stats = kv.stats().tier("disk")
                assert stats.bytes <= stats.capacity_bytes
                assert stats.logical_bytes == stats.blocks * _logical(tensors[0])
                assert kv.get_tensors(ns, hashes[12 - stats.blocks:]) != []
                held[compression] = stats
        finally:
            server.stop()
    assert held["none"].blocks == 4 and held["none"].logical_ratio < 1  # a page per block's tail and its header
    assert held["zstd"].blocks == 12 and held["zstd"].logical_ratio > 2  # all of them, a few pages each
    assert held["zstd"].bytes < held["none"].bytes


@pytest.mark.slow
def test_a_restarted_disk_tier_knows_its_logical_bytes(tmp_path: Path) -> None:
    ns, lossy = namespace(), namespace(kv_encoding="int8")
    hashes, tensors = _compressible_blocks(ns, 4)
    lossy_hashes, lossy_tensors = kv_blocks(lossy, 3)
    figures = []
    for _ in range(2):
        server = _disk_server(tmp_path, "zstd", 64 << 20)
        try:
            with KVStoreClient(server.target, retries=0) as kv:
                if not figures:
                    assert kv.put(ns, hashes, tensors) == 4 and kv.put(lossy, lossy_hashes, lossy_tensors) == 3
                stats = kv.stats().tier("disk")
                figures.append((stats.blocks, stats.bytes, stats.logical_bytes))
                assert [t.equal(u) for t, u in zip(kv.get_tensors(ns, hashes), tensors)] == [True] * 4
        finally:
            server.stop()
    assert figures[0] == figures[1]
    assert figures[0][2] == 4 * _logical(tensors[0]) + 3 * _logical(lossy_tensors[0])
