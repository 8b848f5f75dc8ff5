"""bench_peers' Mooncake Store systems (``mooncake-transfer-engine-non-cuda``), through its zero-copy API.

Three ways a user runs it on one host, each against a ``mooncake_master`` of
its own (the orchestrator starts them, and the ``mooncake_client`` processes,
from the Mooncake venv, every listener it can choose on 127.0.0.1):

* ``shm``: a dummy client (``setup_dummy``) of a ``mooncake_client`` process
  that owns the segment; the caller's buffers come from ``alloc_from_mem_pool``
  (shared memory that the real client maps) and are registered, so a Get is one
  copy by the real client from its segment into the caller's buffer.
* ``local``: this process is the only client, its own segment holds the blocks
  (``setup`` with a global segment), and a Get is a memcpy from it.
* ``tcp``: this process contributes no segment (``global_segment_size`` 0); the
  blocks live in a ``mooncake_client`` process's segment and move over the
  Transfer Engine's TCP transport.

Gets are ``batch_get_into`` into registered buffers, Puts ``batch_put_from``;
Put keys are removed (``batch_remove(force=True)``) after the read-back.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from drivers import KIND_BLOCKS, Driver, block_bytes, package_version

MEMPOOL_BYTES = 256 << 20
LOCAL_BUFFER_BYTES = 64 << 20
SEGMENT_BYTES = 512 << 20


class MooncakeDriver(Driver):
    """Mooncake Store; settings: ``mode`` (``shm``, ``local`` or ``tcp``), ``master`` and, for ``shm``, ``client``."""

    def connect(self) -> None:
        """``setup_dummy`` (shm) or ``setup`` with P2P handshake over TCP (local, tcp)."""
        from mooncake.store import MooncakeDistributedStore

        self.mode = self.settings["mode"]
        self.store = MooncakeDistributedStore()
        self.keep: list[Any] = []
        if self.mode == "shm":
            status = self.store.setup_dummy(MEMPOOL_BYTES, LOCAL_BUFFER_BYTES, self.settings["client"])
        else:
            segment = SEGMENT_BYTES if self.mode == "local" else 0
            status = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, LOCAL_BUFFER_BYTES, "tcp", "",
                                      self.settings["master"])
        if status != 0:
            raise RuntimeError(f"Mooncake {self.mode} setup failed: {status}")

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A registered buffer: from ``alloc_from_mem_pool`` in shm mode, else a torch tensor's memory."""
        if self.mode == "shm":
            address = self.store.alloc_from_mem_pool(nbytes)
            if not address:
                raise RuntimeError("Mooncake alloc_from_mem_pool failed")
            memory = (ctypes.c_ubyte * nbytes).from_address(address)
            tensor = torch.frombuffer(memory, dtype=torch.uint8)
            self.keep.append(memory)
        else:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            address = tensor.data_ptr()
        status = self.store.register_buffer(address, nbytes)
        if status != 0:
            raise RuntimeError(f"Mooncake register_buffer failed: {status}")
        return tensor

    def _pointers(self, tensor: torch.Tensor, kind: str) -> tuple[list[int], list[int]]:
        base, size = tensor.data_ptr(), block_bytes(kind)
        return [base + i * size for i in range(KIND_BLOCKS[kind])], [size] * KIND_BLOCKS[kind]

    def get(self, kind: str) -> Any:
        """``batch_get_into`` the Get keys into the destination's blocks."""
        return self.store.batch_get_into(self.get_keys[kind], *self.dst_pointers[kind])

    def put(self, kind: str, tag: str) -> Any:
        """``batch_put_from`` the source's blocks under new keys."""
        return self.store.batch_put_from(self.keys(kind, tag), *self.src_pointers[kind])

    def setup(self) -> None:
        """Keep the keys and block pointers, then store the Get blocks."""
        self.get_keys = {kind: self.keys(kind, "get") for kind in self.src}
        self.dst_pointers = {kind: self._pointers(self.dst[kind], kind) for kind in self.dst}
        self.src_pointers = {kind: self._pointers(self.src[kind], kind) for kind in self.src}
        super().setup()

    def check(self, op: str, kind: str, answer: Any) -> None:
        """A Get reads every block whole (its size each); a Put stores every block (0 each)."""
        want = block_bytes(kind) if op == "get" else 0
        assert list(answer) == [want] * KIND_BLOCKS[kind], f"Mooncake {op} {kind}: {sorted(set(answer))}"

    def read_back(self, kind: str, tag: str) -> None:
        """``batch_get_into`` the Put's keys into the scratch buffer."""
        answer = self.store.batch_get_into(self.keys(kind, tag), *self._pointers(self.scratch[kind], kind))
        self.check("get", kind, answer)

    def remove(self, kind: str, tag: str) -> None:
        """``batch_remove(force=True)`` the Put's keys (force: a read-back's lease would refuse a plain remove)."""
        self.store.batch_remove(self.keys(kind, tag), True)

    def versions(self) -> dict[str, str]:
        """The wheel's version."""
        return {"mooncake-transfer-engine-non-cuda": package_version("mooncake-transfer-engine-non-cuda"),
                "torch": torch.__version__}

    def close(self) -> None:
        """Close the store."""
        self.store.close()
