"""Capacities larger than the host can hold are warned about at start, naming the setting and its value as given."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kvstore.config import DiskTierConfig, MemoryTierConfig, StoreConfig, parse_size
from kvstore.host_memory import host_memory_bytes, warn_if_larger_than_memory


def test_a_memory_tier_larger_than_the_hosts_memory_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from kvstore import open_store

    memory = host_memory_bytes()
    assert memory is not None and memory > 1 << 30  # this machine's RAM, or its container's limit
    with caplog.at_level(logging.WARNING, logger="kvstore.host_memory"):
        # the heap tier (what `kvstore serve` runs) allocates as blocks come: it starts, with a warning
        store = open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=4 * memory, storage="heap")))
        store.close()
    (record,) = [r for r in caplog.records if r.name == "kvstore.host_memory"]
    message = record.getMessage()
    assert f"is {4 * memory / 2**30:.1f} GiB but this host (or its container) has {memory / 2**30:.1f} GiB" in message
    assert "--memory-capacity (store.memory.capacity_bytes, KVSTORE_MEMORY_CAPACITY)" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.host_memory"):
        store = open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20)))
        store.close()
    assert not [r for r in caplog.records if r.name == "kvstore.host_memory"]  # one that fits: not a word


def test_a_containers_limit_counts_as_its_memory(tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("3221225472\n")  # compose's mem_limit: 3g
    assert host_memory_bytes((limit,)) == 3 << 30
    limit.write_text("max\n")
    assert host_memory_bytes((limit,)) == host_memory_bytes(())
    assert warn_if_larger_than_memory(4 << 30, available_bytes=3 << 30)
    assert not warn_if_larger_than_memory(2 << 30, available_bytes=3 << 30)


def test_the_disk_warning_names_the_setting_as_given_not_its_usable_part(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``10TiB`` is reported as 10240.0 GiB (it was 7680.0, the three quarters blocks may use)."""
    from kvstore.tiers.lmdb import LMDBTier

    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.lmdb_records"):
        tier = LMDBTier.from_config(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=parse_size("10TiB")))
        asyncio.run(tier.close())
    (record,) = [r for r in caplog.records if "may fill the filesystem" in r.getMessage()]
    assert "store.disk.capacity_bytes is 10240.0 GiB" in record.getMessage()
