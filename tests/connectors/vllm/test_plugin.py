"""The one-line vLLM setup: kvstore's ``vllm.general_plugins`` entry point makes ``KVStoreConnector`` a name vLLM
knows, so ``{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}`` is a whole setting (the node from
``KVSTORE_TARGET``). docs/vllm.md's quick start runs it in a real engine (``test_quickstart.py``)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvstore.connectors.vllm.connector import KVStoreConnector
from kvstore.connectors.vllm.plugin import CONNECTOR_NAME, ENTRY_POINT_GROUP, register

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_package_declares_the_entry_point_vllm_loads() -> None:
    entry_points = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = entry_points[ENTRY_POINT_GROUP]["kvstore"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is register
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert ENTRY_POINT_GROUP == DEFAULT_PLUGINS_GROUP  # the group vLLM loads in every process


def test_after_register_the_two_key_setting_names_the_connector() -> None:
    register()
    register()  # vLLM may load plugins more than once in a process: no "already registered"
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    assert config.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(config) is KVStoreConnector
    longer = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both",
                              kv_connector_module_path="kvstore.connectors.vllm")
    assert KVConnectorFactory.get_connector_class(longer) is KVStoreConnector  # the longer form still works
