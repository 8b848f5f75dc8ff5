"""What the connector uses of vLLM, and a check of it against the installed vLLM: ``python -m kvstore.connectors.vllm.surface``.

Three kinds of use, each checked without an engine or a GPU (a vLLM installed
``--no-deps`` beside a torch will do):

* **imports**: every ``from vllm... import name`` in the connector's modules, read
  from their source (so a new import is covered without a change here), and
  the connector's modules themselves, imported;
* **hooks**: every public method :class:`~kvstore.connectors.vllm.KVStoreConnector`
  defines must be a method of vLLM's ``KVConnectorBase_V1`` (else vLLM never calls
  it), with the same parameters, and every abstract method of it must be defined;
  :data:`NEWER_HOOKS` are hooks of later releases that older ones lack (never called there);
* **attributes**: the fields and attributes the connector reads of vLLM's engine
  types (:data:`ATTRIBUTES`), looked up as dataclass or msgspec fields,
  annotations, properties, methods, or ``self.<name>`` assignments in the source.

The command prints one line per problem and exits 1 if there is any, 0 when the
installed vLLM offers everything (``tests/connectors/vllm/test_vllm_versions.py``
runs it against every release of :data:`~kvstore.connectors.vllm.versions.SUPPORTED_VLLM`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

CONNECTOR_MODULES = (
    "kvstore.connectors.vllm.config", "kvstore.connectors.vllm.connector", "kvstore.connectors.vllm.events",
    "kvstore.connectors.vllm.jobs", "kvstore.connectors.vllm.layout", "kvstore.connectors.vllm.loading",
    "kvstore.connectors.vllm.metrics", "kvstore.connectors.vllm.namespaces", "kvstore.connectors.vllm.plugin",
    "kvstore.connectors.vllm.scheduler", "kvstore.connectors.vllm.stores", "kvstore.connectors.vllm.worker",
)
"""The connector's modules: each is imported, and its ``from vllm... import`` lines checked."""

BASE_CLASS = ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1")
"""Where vLLM's connector base class lives, and its name."""

NEWER_HOOKS: dict[str, tuple[int, int]] = {
    "get_external_cache_hit_sources": (0, 32),
}
"""Hooks the connector defines that vLLM added in a later release, and that release: older releases never call them."""

OPTIONAL_IMPORTS: dict[tuple[str, str], tuple[int, int]] = {
    ("vllm.v1.metrics.cache_hit_source", "CacheHitSource"): (0, 32),
}
"""Imports the connector guards (``try``/``except ImportError``), and the release that added them."""

ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm.v1.request.Request": (
        "request_id", "all_token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "prompt_token_ids",
        "prompt_embeds", "cache_salt", "lora_request", "mm_features", "block_hashes", "kv_transfer_params",
    ),
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids",
    ),
    "vllm.v1.core.sched.output.NewRequestData": ("req_id", "num_computed_tokens"),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "num_computed_tokens"),
    "vllm.v1.outputs.KVConnectorOutput": ("kv_connector_worker_meta",),
    "vllm.v1.core.kv_cache_manager.KVCacheBlocks": ("get_block_ids",),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": ("get_block_ids",),
    "vllm.v1.kv_cache_interface.KVCacheConfig": ("num_blocks", "kv_cache_groups"),
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec": ("layer_names", "kv_cache_spec"),
    "vllm.v1.kv_cache_interface.FullAttentionSpec": (
        "block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window", "attention_chunk_size",
        "kv_quant_mode", "num_head_slots", "state_content_bytes", "tokens_per_state",
    ),
    "vllm.v1.kv_cache_interface.MLAAttentionSpec": ("block_size", "head_size", "dtype"),
    "vllm.v1.kv_cache_interface.KVQuantMode": ("NONE", "FP8_PER_TENSOR"),
    "vllm.config.KVTransferConfig": (
        "kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy",
        "is_kv_consumer", "is_kv_producer", "engine_id",
    ),
    "vllm.config.VllmConfig": (
        "model_config", "cache_config", "parallel_config", "kv_transfer_config", "kv_events_config",
    ),
    "vllm.config.ModelConfig": ("model", "revision", "hf_config", "dtype", "quantization"),
    "vllm.config.ParallelConfig": ("tensor_parallel_size", "pipeline_parallel_size"),
    "vllm.config.CacheConfig": ("cache_dtype",),
    "vllm.model_executor.layers.attention.Attention": (
        "attn_backend", "kv_sharing_target_layer_name", "_k_scale_float", "_v_scale_float",
    ),
    "vllm.distributed.kv_events.BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "group_idx", "locality", "ownership",
    ),
    "vllm.distributed.kv_events.BlockRemoved": ("block_hashes", "medium"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1": (
        "_vllm_config", "_kv_transfer_config", "_kv_cache_config", "_connector_metadata", "_kv_cache_manager",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics": (
        "_counter_cls", "_histogram_cls",
    ),
    "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory": ("register_connector", "_registry"),
}
"""vLLM's types, by import path, and the attributes the connector reads of them (or, for the base classes, sets)."""


def vllm_release() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed vLLM."""
    from kvstore.connectors.vllm.versions import installed_vllm_version, release_of

    version = installed_vllm_version()
    return release_of(version) if version else None


def connector_imports() -> Iterator[tuple[str, str, str]]:
    """``(module, name, where)`` of every ``from vllm... import name`` (``name`` empty for ``import vllm...``)
    in :data:`CONNECTOR_MODULES` and the vLLM demo, read from their source files.

    Raises:
        FileNotFoundError: if a module's source file is missing (the list here is out of date).
    """
    root = Path(__file__).resolve().parents[3]
    for module in (*CONNECTOR_MODULES, "kvstore.tools.demo.vllm_demo"):
        path = root / (module.replace(".", "/") + ".py")
        if not path.is_file():
            raise FileNotFoundError(f"{module}: no source file {path}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    yield node.module, alias.name, f"{path.relative_to(root)}:{node.lineno}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        yield alias.name, "", f"{path.relative_to(root)}:{node.lineno}"


def check_imports(release: tuple[int, int] | None) -> list[str]:
    """Problems with the names the connector imports from vLLM, and with importing the connector's modules."""
    problems = []
    for module, name, where in sorted(set(connector_imports())):
        added = OPTIONAL_IMPORTS.get((module, name))
        if added is not None and release is not None and release < added:
            continue
        try:
            imported = importlib.import_module(module)
        except Exception as exc:  # any error importing vLLM's module is the finding
            problems.append(f"import {module} ({where}): {type(exc).__name__}: {exc}")
            continue
        if name and not hasattr(imported, name):
            problems.append(f"from {module} import {name} ({where}): {module} has no {name}")
    for module in CONNECTOR_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    return problems


def _parameters(function: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def check_hooks(release: tuple[int, int] | None, connector: type | None = None) -> list[str]:
    """Problems with the connector's hooks against vLLM's ``KVConnectorBase_V1``.

    Args:
        release: the installed vLLM's ``(major, minor)``, for :data:`NEWER_HOOKS`.
        connector: the class to check; ``KVStoreConnector`` when ``None``.
    """
    if connector is None:
        from kvstore.connectors.vllm.connector import KVStoreConnector as ours_by_default

        connector = ours_by_default
    KVStoreConnector = connector
    base = getattr(importlib.import_module(BASE_CLASS[0]), BASE_CLASS[1])
    defined: dict[str, Any] = {}  # what the connector's own classes define, a subclass's over its parent's
    for klass in reversed(connector.__mro__):
        if klass not in base.__mro__:
            defined.update(vars(klass))
    problems = []
    for name, ours in sorted(defined.items()):
        if name.startswith("_"):
            continue
        theirs = inspect.getattr_static(base, name, None)
        if theirs is None:
            added = NEWER_HOOKS.get(name)
            if added is None or release is None or release >= added:
                problems.append(f"KVStoreConnector.{name}: not a hook of {BASE_CLASS[1]} (vLLM never calls it)")
            continue
        if isinstance(ours, property) or isinstance(theirs, property):
            if isinstance(ours, property) != isinstance(theirs, property):
                problems.append(f"KVStoreConnector.{name}: a property on one side only")
            continue
        kind_ours, kind_theirs = type(ours), type(theirs)
        if kind_ours is not kind_theirs and {kind_ours, kind_theirs} & {classmethod, staticmethod}:
            problems.append(f"KVStoreConnector.{name}: {kind_ours.__name__} where vLLM has {kind_theirs.__name__}")
            continue
        mine, base_params = _parameters(getattr(KVStoreConnector, name)), _parameters(getattr(base, name))
        accepts_kwargs = any(kind == inspect.Parameter.VAR_KEYWORD for _, kind in mine)
        mine_names = [n for n, _ in mine]
        for param, kind in base_params:
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            if param not in mine_names and not accepts_kwargs:
                problems.append(f"KVStoreConnector.{name}: vLLM passes {param!r}, which it does not take "
                                f"(vLLM: {inspect.signature(getattr(base, name))})")
        positional = [n for n, k in base_params if k in (inspect.Parameter.POSITIONAL_ONLY,
                                                          inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        mine_positional = [n for n, k in mine if k in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if mine_positional[:len(positional)] != positional:
            problems.append(f"KVStoreConnector.{name}{inspect.signature(getattr(KVStoreConnector, name))}: "
                            f"positional parameters differ from vLLM's {inspect.signature(getattr(base, name))}")
        extra = inspect.signature(getattr(KVStoreConnector, name)).parameters
        for own in extra.values():
            if (own.name not in dict(base_params) and own.default is inspect.Parameter.empty
                    and own.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)):
                problems.append(f"KVStoreConnector.{name}: requires {own.name!r}, which vLLM does not pass")
    for name in sorted(getattr(base, "__abstractmethods__", ())):
        if name not in defined:
            problems.append(f"KVStoreConnector does not define {name}, abstract in {BASE_CLASS[1]}")
    return problems


def _assigned_in_source(cls: type) -> set[str]:
    """Attribute names assigned in the modules of ``cls`` and its bases: ``self.<name> = ...`` in a class,
    ``<object>.<name> = ...`` in a module's helper (vLLM's ``Attention`` gets its scales so), and annotations."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        if klass.__module__ == "builtins":
            continue
        try:
            source = inspect.getsource(sys.modules[klass.__module__])
        except (KeyError, OSError, TypeError):
            continue
        names.update(re.findall(r"\b\w+\.(\w+)\s*(?::[^=\n]+)?=(?!=)", source))
        names.update(getattr(klass, "__annotations__", {}))
    return names


def has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a field, an annotation, a class attribute or a ``self.`` assignment."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):  # msgspec
        return True
    if name in getattr(cls, "model_fields", {}):  # pydantic
        return True
    if inspect.getattr_static(cls, name, None) is not None:
        return True
    return name in _assigned_in_source(cls)


def check_attributes() -> list[str]:
    """Problems with the attributes of :data:`ATTRIBUTES`."""
    problems = []
    for path, names in ATTRIBUTES.items():
        module, _, class_name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), class_name)
        except Exception as exc:
            problems.append(f"{path}: cannot be imported ({type(exc).__name__}: {exc})")
            continue
        for name in names:
            if not has_attribute(cls, name):
                problems.append(f"{path}.{name}: no such attribute")
    return problems


def check() -> dict[str, Any]:
    """Every check against the installed vLLM: ``{"vllm": version, "supported": bool, "problems": [...]}``."""
    from kvstore.connectors.vllm.versions import installed_vllm_version, is_supported

    version = installed_vllm_version()
    release = vllm_release()
    problems = check_imports(release)
    if not any(p.startswith("import kvstore.connectors.vllm.connector") for p in problems):
        problems += check_hooks(release)
    problems += check_attributes()
    return {"vllm": version, "supported": bool(version and is_supported(version)), "problems": problems}


def main(argv: list[str] | None = None) -> int:
    """Print the problems (or ``--json``); exit 0 when there are none, 1 otherwise."""
    args = sys.argv[1:] if argv is None else argv
    report = check()
    if "--json" in args:
        print(json.dumps(report, indent=2))
    else:
        state = "in" if report["supported"] else "outside"
        print(f"vLLM {report['vllm']} ({state} the supported range): {len(report['problems'])} problem(s)")
        for problem in report["problems"]:
            print(f"  {problem}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
