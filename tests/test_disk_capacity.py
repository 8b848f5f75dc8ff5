"""``disk.capacity_bytes`` bounds ``data.mdb`` (issue 18, finding 6), through the public API.

Regression: with a 2 GiB disk capacity, data.mdb reached 2,407,788,544 bytes: the capacity counted only the
blocks, and LMDB's map, the real bound of the file, was 1.5x the capacity plus 64 MiB. An operator sizes a
volume from the capacity. ``benchmarks/bench_disk_capacity.py`` runs the same churn longer and records the figures.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import DiskTierConfig, MemoryTierConfig, StoreConfig
from kvstore.embedded import open_store
from kvstore.keys import Namespace, hash_blocks

NS = Namespace(model="tests/disk-capacity", dtype="float16", block_size=16)
MiB = 1 << 20


@pytest.mark.slow
def test_the_data_file_never_outgrows_the_disk_capacity_and_every_put_succeeds(tmp_path: Path) -> None:
    capacity = 16 * MiB
    config = StoreConfig(memory=MemoryTierConfig(enabled=False),
                         disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=capacity))
    rng = random.Random(0)
    data_file = tmp_path / "disk" / "data.mdb"
    largest = 0
    with open_store(config) as store:
        for i in range(500):  # puts of 1 to 3 blocks of 16 KiB to 1 MiB: the store evicts, LMDB reuses pages
            num_kv_heads = rng.choice([1, 2, 4, 16, 64])
            num_blocks = rng.randint(1, 3)
            blocks = [encode_block(torch.full((2, 2, num_kv_heads, 16, 128), float(i), dtype=torch.float16))
                      for _ in range(num_blocks)]
            hashes = hash_blocks(NS, list(range(i * 64, i * 64 + 16 * num_blocks)))
            assert store.put(NS, hashes, blocks) == num_blocks
            largest = max(largest, os.path.getsize(data_file))
            assert store.get(NS, hashes[:1]) == blocks[:1]
        disk = store.stats().tier("disk")
        assert disk.evictions > 0  # the churn filled the tier many times over
        assert disk.bytes <= disk.capacity_bytes < capacity  # blocks fill a share of the file, LMDB's pages the rest
    assert largest <= capacity  # observed before: 1.24x
