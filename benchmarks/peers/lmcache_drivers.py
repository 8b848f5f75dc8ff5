"""bench_peers' LMCache systems (``lmcache`` 0.5.6, CPU torch): its in-process CPU store and its cache server.

* ``LocalCPUDriver``: ``LocalCPUBackend`` in this process, as LMCache's storage
  manager drives it: a Put allocates ``MemoryObj`` s (``batched_allocate``),
  copies the blocks in and submits them (``batched_submit_put_task``); a Get is
  ``get_blocking`` per block and a copy into the caller's tensor.
* ``ServerDriver``: LMCache's cache server (``python -m lmcache.v1.server HOST
  PORT cpu``, the orchestrator's subprocess), reached with its own client,
  ``LMCServerConnector``: a Get receives each block into a ``MemoryObj``
  (``recv_into``), then copies it into the caller's tensor; a Put sends each
  block. The server does not acknowledge a PUT, so the timed Put ends with one
  EXIST of the last key, answered once the server has taken every block before it.

Each LMCache chunk holds one block's bytes (``MemoryFormat.KV_2LTD``, shape
``[2, num_layers, block_size, num_kv_heads * head_dim]``: the same bytes,
LMCache's layout of them).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import torch

from drivers import KIND_BLOCKS, KIND_SHAPES, Driver, package_version

CPU_GB = 0.5
"""``max_local_cpu_size`` of the in-process store, GB (LMCache's unit)."""


def _chunk_hash(key: str) -> int:
    """A chunk hash for LMCache's key, from a documented hash of our key (never Python's ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _chunk_shape(kind: str) -> torch.Size:
    num_layers, two, num_heads, block_size, head_dim = KIND_SHAPES[kind]
    return torch.Size((two, num_layers, block_size, num_heads * head_dim))


class LocalCPUDriver(Driver):
    """LMCache's ``LocalCPUBackend`` in this process (``local_cpu=True``, ``max_local_cpu_size`` 0.5 GB)."""

    def connect(self) -> None:
        """Build the backend from ``LMCacheEngineConfig.from_defaults`` and an ``LMCacheMetadata``."""
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        num_layers, _, num_heads, block_size, head_dim = KIND_SHAPES["prefix"]
        config = LMCacheEngineConfig.from_defaults(chunk_size=block_size, local_cpu=True, max_local_cpu_size=CPU_GB)
        metadata = LMCacheMetadata(model_name="bench-peers", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.float16,
                                   kv_shape=(num_layers, 2, block_size, num_heads, head_dim), chunk_size=block_size)
        self.backend = LocalCPUBackend(config, metadata)
        self.fmt = MemoryFormat.KV_2LTD
        self.key_class = CacheEngineKey
        self.key_cache: dict[tuple[str, str], list[Any]] = {}

    def engine_keys(self, kind: str, tag: str) -> list[Any]:
        """LMCache's keys (``CacheEngineKey``, a chunk hash each) for the blocks of ``kind`` under ``tag``."""
        if (kind, tag) not in self.key_cache:
            self.key_cache[(kind, tag)] = [
                self.key_class("bench-peers", 1, 0, _chunk_hash(key), torch.float16)
                for key in self.keys(kind, tag)]
        return self.key_cache[(kind, tag)]

    def memory_objs(self, kind: str) -> list[Any]:
        """``MemoryObj`` s holding the source's blocks (allocated, then filled)."""
        objs = self.backend.batched_allocate(_chunk_shape(kind), torch.float16, KIND_BLOCKS[kind], self.fmt)
        if objs is None:
            raise RuntimeError("LMCache could not allocate")
        for obj, block in zip(objs, self.src[kind]):
            obj.tensor.view(-1).copy_(block.view(-1))
        return objs

    def copy_out(self, objs: list[Any], target: torch.Tensor) -> None:
        """Copy each ``MemoryObj`` into its block of ``target``, then release it."""
        for obj, block in zip(objs, target):
            block.view(-1).copy_(obj.tensor.view(-1))
            obj.ref_count_down()

    def _fetch(self, keys: list[Any]) -> list[Any]:
        objs = [self.backend.get_blocking(key) for key in keys]
        assert all(obj is not None for obj in objs), "LMCache: a chunk was missing"
        return objs

    def get(self, kind: str) -> Any:
        """``get_blocking`` each chunk, copy it into the destination."""
        self.copy_out(self._fetch(self.engine_keys(kind, "get")), self.dst[kind])

    def put(self, kind: str, tag: str) -> Any:
        """Allocate, copy in, ``batched_submit_put_task`` (the store now holds a reference)."""
        objs = self.memory_objs(kind)
        self.backend.batched_submit_put_task(self.engine_keys(kind, tag), objs)
        for obj in objs:
            obj.ref_count_down()

    def read_back(self, kind: str, tag: str) -> None:
        """``get_blocking`` the Put's chunks into the scratch tensor."""
        self.copy_out(self._fetch(self.engine_keys(kind, tag)), self.scratch[kind])

    def remove(self, kind: str, tag: str) -> None:
        """``remove`` the Put's chunks."""
        for key in self.key_cache.pop((kind, tag)):
            self.backend.remove(key)

    def versions(self) -> dict[str, str]:
        """LMCache's and torch's versions."""
        return {"lmcache": package_version("lmcache"), "torch": torch.__version__}

    def close(self) -> None:
        """Close the backend."""
        self.backend.close()


class ServerDriver(LocalCPUDriver):
    """LMCache's cache server through ``LMCServerConnector`` (settings: ``port``).

    The connector receives into ``MemoryObj`` s of a ``LocalCPUBackend`` of this process, as LMCache's remote
    backend does.
    """

    def connect(self) -> None:
        """The local backend (for ``MemoryObj`` s), an event loop, and the connector to the server on loopback."""
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector

        super().connect()
        self.loop = asyncio.new_event_loop()
        self.connector = LMCServerConnector("127.0.0.1", int(self.settings["port"]), self.loop, self.backend)

    def _run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    async def _fetch_all(self, keys: list[Any]) -> list[Any]:
        objs = [await self.connector.get(key) for key in keys]
        assert all(obj is not None for obj in objs), "LMCache server: a chunk was missing"
        return objs

    async def _store_all(self, keys: list[Any], objs: list[Any]) -> bool:
        for key, obj in zip(keys, objs):
            await self.connector.put(key, obj)
        return await self.connector.exists(keys[-1])

    def get(self, kind: str) -> Any:
        """Receive each chunk from the server, copy it into the destination."""
        self.copy_out(self._run(self._fetch_all(self.engine_keys(kind, "get"))), self.dst[kind])

    def put(self, kind: str, tag: str) -> Any:
        """Allocate and fill ``MemoryObj`` s, send each, then one EXIST (the server has taken them all)."""
        objs = self.memory_objs(kind)
        stored = self._run(self._store_all(self.engine_keys(kind, tag), objs))
        for obj in objs:
            obj.ref_count_down()
        return stored

    def check(self, op: str, kind: str, answer: Any) -> None:
        """The last key of a Put exists on the server."""
        assert op == "get" or answer is True, "LMCache server: the last chunk put is not there"

    def read_back(self, kind: str, tag: str) -> None:
        """Receive the Put's chunks into the scratch tensor."""
        self.copy_out(self._run(self._fetch_all(self.engine_keys(kind, tag))), self.scratch[kind])

    def remove(self, kind: str, tag: str) -> None:
        """Nothing: ``LMCServerConnector`` has no remove, and the server keeps every chunk (it has no evictor)."""
        self.key_cache.pop((kind, tag), None)

    def close(self) -> None:
        """Close the connection and the backend."""
        self._run(self.connector.close())
        self.loop.close()
        super().close()

