"""The kvstore gRPC service: ``KVStoreServer`` (``kvstore.server.app``) and its parts.

Modules: ``app`` (the server's composition, graceful shutdown), ``process`` (the
process's tuning, ``serve``/``run``), ``servicer`` (the
thin ``kvstore.v1.KVStore`` servicer), ``errors`` (the one error <-> status
mapping), ``wire`` (message conversions and chunking, shared with the clients),
``metrics`` (Prometheus) and ``logs`` (structured logging). Names are imported
lazily so that the clients, which use ``errors`` and ``wire``, do not load the
server's dependencies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreServer", "run", "serve"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreServer":
        from kvstore.server import app

        return app.KVStoreServer
    if name in __all__:
        from kvstore.server import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
