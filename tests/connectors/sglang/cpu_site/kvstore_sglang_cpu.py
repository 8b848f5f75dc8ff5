"""CPU test scaffolding for SGLang 0.5.23 servers that the tests start: the adaptations, each checked at start.

This directory (``tests/connectors/sglang/cpu_site``) goes first on the
``PYTHONPATH`` of the SGLang server processes the harness starts
(``tests/connectors/sglang/server.py``, or ``docs/sglang.md``'s CPU quick
start), and of no other process: Python
imports its ``sitecustomize`` at interpreter start, in the server's own
process and in every scheduler and detokenizer process SGLang spawns (patching
SGLang from the launching script does not reach those). A GPU runs SGLang
unmodified; nothing here is kvstore's code or a user's environment.

What SGLang 0.5.23 needs on a CPU torch (``SGLANG_USE_CPU_ENGINE=1``; SGLang
then runs its ``torch_native`` attention):

- ``sgl_kernel``: a pure-torch stand-in for the few ops SGLang imports on that
  path (``cpu_site/sgl_kernel``); PyPI's ``sglang-kernel`` is a CUDA build.
- ``torchvision``: SGLang's model configs import it, and PyPI's builds are CUDA
  builds whose C++ ops do not load over the CPU torch; ``import torchvision``
  then fails in ``torchvision/_meta_registrations.py`` (``operator
  torchvision::nms does not exist``), which registers fake kernels for those
  ops. The harness puts a copy of torchvision 0.28.0 (installed by ``make
  setup-sglang`` under ``.venv-sglang/cpu-harness-torchvision``, outside the
  venv's own path) on the server's path, and this module gives
  ``torchvision._meta_registrations`` an empty module when the ops did not load.
  Detection and image ops are never called for a text model.
- HiCache's host pool (``--enable-hierarchical-cache``) asks for pinned memory,
  which a CPU torch cannot give (SGLang's default allocator calls
  ``cudaHostRegister`` for a pinned pool: ``AssertionError: Torch not compiled
  with CUDA enabled``): ``host-pool-pinning`` makes it unpinned. With
  ``pin_memory=False`` the default allocator's plain ``mmap`` allocation is
  used as it is (``pool_host/common.py``'s ``ALLOC_MEMORY_FUNCS`` needs no
  ``cpu`` entry).
- ``MHATokenToKVPoolHost``'s host/device copies (``load_to_device_per_layer``,
  ``backup_from_device_all_layer``) call kernels SGLang binds only for CUDA, HIP
  and XPU (``pool_host/mha.py``): ``host-pool-transfers`` does them with torch
  index copies for the ``layer_first`` and ``page_first`` layouts when the
  device pool is on the CPU.

Each adaptation is applied only where its check finds the defect (the stand-in
``sgl_kernel`` reports itself needed when SGLang imports it), and each check's
outcome is appended, one JSON line per check and process, to the file
named by ``KVSTORE_SGLANG_CPU_REPORT`` (when set):
``{"adaptation": ..., "needed": bool, "detail": ..., "pid": ...}``. The tests
(``test_sglang_server.py``) fail when one was not needed, so a newer SGLang (or
torchvision) that fixes one is noticed and its adaptation removed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Any, Callable

REPORT_ENV = "KVSTORE_SGLANG_CPU_REPORT"
"""The environment variable naming the file the checks append their outcomes to."""

ADAPTATIONS = ("sgl_kernel", "torchvision", "host-pool-pinning", "host-pool-transfers")
"""Every adaptation this scaffolding makes, by the name its report lines carry."""

TRANSFER_LAYOUTS = ("layer_first", "page_first")
"""The host pool layouts ``host-pool-transfers`` copies; the others are refused with ``ValueError``."""


def report(adaptation: str, needed: bool, detail: str) -> None:
    """Append one check's outcome to the ``KVSTORE_SGLANG_CPU_REPORT`` file (nothing when it is not set).

    Args:
        adaptation: one of :data:`ADAPTATIONS`.
        needed: whether the check found the defect (and the adaptation was applied).
        detail: what the check saw, for the test's failure message.
    """
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    line = json.dumps({"adaptation": adaptation, "needed": needed, "detail": detail, "pid": os.getpid()})
    with open(path, "a", encoding="utf-8") as out:  # one short write per line: appends from processes do not mix
        out.write(line + "\n")


class _EmptyLoader(importlib.abc.Loader):
    """Loads an empty module (for a module whose whole job cannot be done here)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = "Left empty by the kvstore SGLang CPU test scaffolding (kvstore_sglang_cpu.py)."


class _ImportHooks(importlib.abc.MetaPathFinder):
    """A meta path finder that runs a callback after named modules are executed, or replaces a module.

    ``after[name](module)`` runs once ``name`` is executed (the module is then in
    ``sys.modules``); ``instead[name]()`` runs before ``name`` is found and
    returns ``True`` to load an empty module in its place.
    """

    def __init__(self, after: dict[str, Callable[[ModuleType], None]],
                 instead: dict[str, Callable[[], bool]]) -> None:
        self.after, self.instead = after, instead

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in self.instead and self.instead[name]():
            return importlib.util.spec_from_loader(name, _EmptyLoader())
        if name not in self.after:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, callback = spec.loader.exec_module, self.after[name]

        def exec_then_adapt(module: ModuleType) -> None:
            execute(module)
            callback(module)

        spec.loader.exec_module = exec_then_adapt  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


# ---------------------------------------------------------------------------------------------- torchvision


def _torchvision_ops_missing() -> bool:
    """Before ``torchvision._meta_registrations`` runs: whether torchvision's C++ ops failed to load (then stub it)."""
    extension = sys.modules.get("torchvision.extension")
    missing = extension is not None and not extension._has_ops()
    report("torchvision", missing, "torchvision's C++ ops did not load; _meta_registrations left empty" if missing
           else "torchvision's C++ ops loaded: the torchvision adaptation is not needed")
    return missing


# ---------------------------------------------------------------------------------------------- host pool


def _adapt_host_pool_base(module: ModuleType) -> None:
    """``host-pool-pinning``: ``HostKVCache`` pools are built unpinned when torch cannot pin memory."""
    import torch

    cls = module.HostKVCache
    init = cls.__init__

    @functools.wraps(init)
    def unpinned_init(self: Any, *args: Any, **kwargs: Any) -> None:
        asked = kwargs.get("pin_memory")
        needed = bool(asked) and not torch.cuda.is_available()
        report("host-pool-pinning", needed, f"{type(self).__name__} asked for pin_memory={asked!r} on a torch "
               f"without CUDA" if needed else f"{type(self).__name__} asked for pin_memory={asked!r}: fine here")
        if needed:
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    cls.__init__ = unpinned_init


def _host_layer_views(pool: Any) -> tuple[list[Any], list[Any]]:
    """The host pool's per-layer K and V views, each indexed by token slot (``k_data_refs``, ``v_data_refs``)."""
    if pool.layout not in TRANSFER_LAYOUTS:
        raise ValueError(f"the CPU test scaffolding copies host pages of layouts {TRANSFER_LAYOUTS}, "
                         f"not {pool.layout!r}")
    return pool.k_data_refs, pool.v_data_refs


def _load_to_device_per_layer(pool: Any, device_pool: Any, host_indices: Any, device_indices: Any, layer_id: int,
                              io_backend: str, *, is_draft: bool = False) -> None:
    """One layer's K and V rows from the host pool into the device pool (``MHATokenToKVPoolHost``'s contract)."""
    if not is_draft and not 0 <= layer_id < pool.target_layer_num:
        return
    host_k, host_v = _host_layer_views(pool)
    pool.device_k_buffers[layer_id][device_indices] = host_k[layer_id][host_indices]
    pool.device_v_buffers[layer_id][device_indices] = host_v[layer_id][host_indices]


def _backup_from_device_all_layer(pool: Any, device_pool: Any, host_indices: Any, device_indices: Any,
                                  io_backend: str) -> None:
    """Every layer's K and V rows from the device pool into the host pool (``MHATokenToKVPoolHost``'s contract)."""
    host_k, host_v = _host_layer_views(pool)
    for host, device in zip((*host_k, *host_v), (*pool.device_k_buffers, *pool.device_v_buffers)):
        host[host_indices] = device[device_indices]  # index_put_ into the strided view writes the host buffer


def _adapt_host_pool_mha(module: ModuleType) -> None:
    """``host-pool-transfers``: ``MHATokenToKVPoolHost`` copies with torch index copies when its device is the CPU."""
    needed = not hasattr(module, "transfer_kv_per_layer")
    report("host-pool-transfers", needed, "pool_host/mha.py binds no transfer kernels on this device" if needed
           else "pool_host/mha.py binds transfer kernels here: the host-pool-transfers adaptation is not needed")
    if not needed:
        return
    cls = module.MHATokenToKVPoolHost
    load, backup = cls.load_to_device_per_layer, cls.backup_from_device_all_layer

    @functools.wraps(load)
    def load_to_device_per_layer(self: Any, *args: Any, **kwargs: Any) -> None:
        on_cpu = self._transfer_device.type == "cpu"
        return (_load_to_device_per_layer if on_cpu else load)(self, *args, **kwargs)

    @functools.wraps(backup)
    def backup_from_device_all_layer(self: Any, *args: Any, **kwargs: Any) -> None:
        on_cpu = self._transfer_device.type == "cpu"
        return (_backup_from_device_all_layer if on_cpu else backup)(self, *args, **kwargs)

    cls.load_to_device_per_layer = load_to_device_per_layer
    cls.backup_from_device_all_layer = backup_from_device_all_layer


def install(after: dict[str, Callable[[ModuleType], None]] | None = None) -> None:
    """Put the import hooks in place (from ``sitecustomize``, at interpreter start; imports nothing heavy).

    Args:
        after: more ``{module: callback}`` to run once a module is executed (the tests' call probe).
    """
    if any(isinstance(finder, _ImportHooks) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _ImportHooks(
        after={"sglang.srt.mem_cache.pool_host.base": _adapt_host_pool_base,
               "sglang.srt.mem_cache.pool_host.mha": _adapt_host_pool_mha, **(after or {})},
        instead={"torchvision._meta_registrations": _torchvision_ops_missing}))
