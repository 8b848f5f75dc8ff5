"""The tests' view into a running SGLang server: each storage call of kvstore's backend, logged as it starts and ends.

Test scaffolding, like the rest of ``cpu_site`` (the server's processes only),
and only when ``KVSTORE_SGLANG_CALL_LOG`` names a file: once
``kvstore.connectors.sglang.storage`` is imported, the calls SGLang's storage
threads make (:data:`PROBED`) append a JSON line when they start,
``{"call": "batch_exists", "phase": "enter", "keys": 37, "pid": ...}``, and when
they return, with ``"phase": "exit"`` and ``"result"`` (the count of pages
found or transferred). A fault test waits on these lines to act while a call is
in flight (a node killed while SGLang's prefetch waits on it), where a test of
the backend alone would wrap the method in its own process. The calls run as
they would: the probe only observes.
"""

from __future__ import annotations

import functools
import json
import os
from types import ModuleType
from typing import Any, Callable

LOG_ENV = "KVSTORE_SGLANG_CALL_LOG"
"""The environment variable naming the file the probe appends to."""

PROBED = ("batch_exists", "batch_get_v1", "batch_set_v1")
"""The backend's methods the probe logs: the prefetch thread's lookup and read, the backup thread's write."""


def _log(path: str, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as out:  # one short line per write: lines from threads do not mix
        out.write(json.dumps(record) + "\n")


def _summary(result: Any) -> int:
    """Pages found (``batch_exists``) or transferred (``True`` entries of a ``batch_*_v1`` list)."""
    return int(result) if isinstance(result, int) else sum(1 for ok in result if ok)


def _probed(name: str, method: Callable[..., Any], path: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        _log(path, {"call": name, "phase": "enter", "keys": len(keys), "pid": os.getpid()})
        result = method(self, keys, *args, **kwargs)
        _log(path, {"call": name, "phase": "exit", "keys": len(keys), "result": _summary(result),
                    "pid": os.getpid()})
        return result

    return call


def probe_storage(module: ModuleType) -> None:
    """Wrap :data:`PROBED` of ``module.KVStoreHiCacheStorage`` (``kvstore.connectors.sglang.storage``)."""
    path = os.environ[LOG_ENV]
    cls = module.KVStoreHiCacheStorage
    for name in PROBED:
        setattr(cls, name, _probed(name, getattr(cls, name), path))


def hooks() -> dict[str, Callable[[ModuleType], None]]:
    """The import hooks to install: the storage probe when ``KVSTORE_SGLANG_CALL_LOG`` is set, else none."""
    return {"kvstore.connectors.sglang.storage": probe_storage} if os.environ.get(LOG_ENV) else {}
