"""Tenant isolation end to end: through a real server with memory, LMDB and Redis tiers and per-tenant tokens."""

from __future__ import annotations

import dataclasses
import mmap

import pytest
import torch

from kvstore.error_codes import PermissionDeniedError
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES
from kvstore.tiers.lmdb import MAX_KEY_BYTES, RECORD_OVERHEAD_BYTES, default_map_size_bytes
from tests.support.server import ThreadedServer, encoded, kv_blocks
from tests.support.redis import RedisProcess, redis_server  # noqa: F401

from tests.support.security import TOKEN_A, TOKEN_B, auth_config, client_of, sha_namespace

@pytest.mark.slow
def test_tenant_b_never_hits_tenant_a_in_any_tier(redis_server: RedisProcess, tmp_path) -> None:  # noqa: F811
    ns_a = sha_namespace("tenant-a")
    ns_b = dataclasses.replace(ns_a, cache_salt="tenant-b")  # the same model, dtype, layout: only the salt differs
    hashes, tensors = kv_blocks(ns_a, 6)
    block_bytes = len(encoded(ns_a, tensors[:1])[0])
    disk_block_bytes = -(-(block_bytes + 16 + MAX_KEY_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE + RECORD_OVERHEAD_BYTES
    threaded = ThreadedServer(auth_config(**{
        "store.memory.capacity_bytes": 2 * (block_bytes + BLOCK_OVERHEAD_BYTES),  # two blocks
        "store.disk.path": str(tmp_path / "lmdb"),
        "store.disk.capacity_bytes": default_map_size_bytes(2 * disk_block_bytes),  # two blocks; the rest to Redis
        "store.redis.url": redis_server.url,
        "store.redis.mode": "write_back",
    }))
    try:
        with client_of(threaded, TOKEN_A) as a, client_of(threaded, TOKEN_B) as b:
            assert a.put(ns_a, hashes, tensors) == 6
            tiers = a.lookup(ns_a, hashes).tiers
            assert {"memory", "disk", "redis"} <= set(tiers), tiers  # A's blocks sit in every tier
            raw = redis_server.client()
            assert raw.keys(f"kvstore:{ns_a.tag.hex()}:*")

            # B sends A's exact hash bytes, in its own namespace: no tier answers
            assert b.lookup(ns_b, hashes).num_blocks == 0
            assert b.get(ns_b, hashes) == []
            assert b.delete(ns_b, hashes) == 0
            assert b.clear(ns_b) == 0
            # ... and cannot name A's namespace at all
            for call in (lambda: b.lookup(ns_a, hashes), lambda: b.get(ns_a, hashes),
                         lambda: b.put(ns_a, hashes[:1], [torch.zeros_like(tensors[0])]),
                         lambda: b.delete(ns_a, hashes), lambda: b.clear(ns_a)):
                with pytest.raises(PermissionDeniedError):
                    call()
            # B stores other bytes under A's hash bytes: that poisons only B's own namespace
            poison = [torch.full_like(t, 7.0) for t in tensors]
            assert b.put(ns_b, hashes, poison) == 6
            assert all(torch.equal(p, r) for p, r in zip(poison, b.get_tensors(ns_b, hashes)))

            # A's blocks are whole and unchanged in every tier, and B's left no trace in A's Redis keys
            assert a.lookup(ns_a, hashes).num_blocks == 6
            received = a.get_tensors(ns_a, hashes)
            assert len(received) == 6 and all(torch.equal(t, r) for t, r in zip(tensors, received))
            assert set(raw.keys(f"kvstore:{ns_a.tag.hex()}:*")).isdisjoint(raw.keys(f"kvstore:{ns_b.tag.hex()}:*"))
    finally:
        threaded.stop()
