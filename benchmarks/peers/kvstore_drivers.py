"""bench_peers' kvstore systems, through kvstore's public API only: ``KVStoreClient`` and ``kvstore.open_store``.

Run from the project's venv with the checkout on ``PYTHONPATH``, so they
measure whatever the checkout's kvstore is. ``kvstore serve`` itself is the
orchestrator's subprocess; these are its clients.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from drivers import KIND_BLOCKS, KIND_SHAPES, KINDS, Driver


class KVStoreDriver(Driver):
    """What the kvstore drivers share: one namespace per kind, hashes for keys, ``get_into`` / ``put`` / ``delete``.

    A Get is ``get_into`` of the kind's blocks into views of the caller's tensor;
    a Put is ``put`` of views of the source tensor. Every call must report all
    blocks (a Get's count of blocks copied; a Put's count of blocks stored: each
    Put names new hashes, deleted after the read-back).
    """

    model = "bench-peers"

    def connect(self) -> None:
        """Open the store (``open``), and the namespaces."""
        from kvstore import Namespace

        self.store = self.open()
        self.namespaces = {kind: Namespace(model=f"{self.model}-{kind}", dtype="float16",
                                           block_size=KIND_SHAPES[kind][3]) for kind in KINDS}

    def open(self) -> Any:
        """The client or store that takes ``get_into``, ``put`` and ``delete``."""
        raise NotImplementedError

    def hashes(self, kind: str, tag: str) -> list[bytes]:
        """One hash per block of ``kind`` under ``tag``: the chained hashes of a token prefix for the Get blocks."""
        from kvstore import hash_blocks

        namespace = self.namespaces[kind]
        if tag == "get":
            return hash_blocks(namespace, list(range(KIND_BLOCKS[kind] * namespace.block_size)))
        return [hashlib.blake2b(key.encode(), digest_size=namespace.hash_bytes).digest()
                for key in self.keys(kind, tag)]

    def setup(self) -> None:
        """Store the Get blocks, and keep their hashes and the destinations' views."""
        self.get_hashes = {kind: self.hashes(kind, "get") for kind in KINDS}
        self.dst_views = {kind: list(self.dst[kind].unbind(0)) for kind in KINDS}
        self.src_views = {kind: list(self.src[kind].unbind(0)) for kind in KINDS}
        super().setup()

    def get(self, kind: str) -> Any:
        """``get_into`` the kind's blocks into views of the destination."""
        return self.store.get_into(self.namespaces[kind], self.get_hashes[kind], self.dst_views[kind])

    def put(self, kind: str, tag: str) -> Any:
        """``put`` the source's blocks (tensors) under new hashes."""
        return self.store.put(self.namespaces[kind], self.hashes(kind, tag), self.src_views[kind])

    def check(self, op: str, kind: str, answer: Any) -> None:
        """Every block copied (Get) or newly stored (Put)."""
        assert answer == KIND_BLOCKS[kind], f"kvstore {op} {kind}: {answer} of {KIND_BLOCKS[kind]} blocks"

    def read_back(self, kind: str, tag: str) -> None:
        """``get_into`` the Put's blocks into the scratch tensor."""
        count = self.store.get_into(self.namespaces[kind], self.hashes(kind, tag), list(self.scratch[kind].unbind(0)))
        assert count == KIND_BLOCKS[kind], f"kvstore read-back {kind}: {count} blocks"

    def remove(self, kind: str, tag: str) -> None:
        """``delete`` the Put's blocks."""
        self.store.delete(self.namespaces[kind], self.hashes(kind, tag))

    def versions(self) -> dict[str, str]:
        """kvstore's and torch's versions."""
        import kvstore

        return {"kvstore": kvstore.__version__, "torch": torch.__version__}

    def close(self) -> None:
        """Close the client or store."""
        self.store.close()


class ServeDriver(KVStoreDriver):
    """A client of ``kvstore serve``: the same-host path, or gRPC alone.

    Settings: ``target``, ``shared_memory`` and ``bulk`` (the client's flags; ``bulk`` off unless given), ``client``
    (a number that gives each client process namespaces of its own).
    """

    def open(self) -> Any:
        """``KVStoreClient(target, shared_memory=...)``."""
        from kvstore import KVStoreClient

        bulk = bool(self.settings.get("bulk", False))
        path = "shm" if self.settings["shared_memory"] else "bulk" if bulk else "grpc"
        self.model = f"bench-peers-{path}-{self.settings.get('client', 0)}"
        return KVStoreClient(self.settings["target"], timeout_s=120, shared_memory=bool(self.settings["shared_memory"]),
                             bulk=bulk)

    def info(self) -> dict[str, Any]:
        """The client's same-host and bulk states (``("attached",)``, ``("on",)`` when that path carries the bytes)."""
        return {"shared_memory": list(self.store.shared_memory()), "bulk": list(self.store.bulk())}


class EmbeddedDriver(KVStoreDriver):
    """The embedded store, in this process: ``kvstore.open_store`` with the default store configuration."""

    model = "bench-peers-embedded"

    def open(self) -> Any:
        """``kvstore.open_store(StoreConfig())`` (defaults; no ``KVSTORE_*`` variables read)."""
        import kvstore

        return kvstore.open_store(kvstore.StoreConfig())
