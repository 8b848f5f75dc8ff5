"""The check of what the connector uses of vLLM (``kvstore.connectors.vllm.surface``), on the installed vLLM.

``test_vllm_versions.py`` runs the same check against every supported release.
"""

from __future__ import annotations

from typing import Any

from kvstore.connectors.vllm.connector import KVStoreConnector
from kvstore.connectors.vllm.surface import check, check_hooks, connector_imports, has_attribute, vllm_release


def test_the_installed_vllm_offers_everything_the_connector_uses() -> None:
    report = check()
    assert report["supported"] and report["problems"] == [], report


def test_the_imports_are_read_from_the_connectors_source() -> None:
    imports = set(connector_imports())
    modules = {module for module, _, _ in imports}
    assert ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1") in \
        {(m, n) for m, n, _ in imports}
    assert "vllm.distributed.kv_transfer.kv_connector.factory" in modules  # the plugin's
    assert len(imports) >= 30


def test_a_hook_whose_parameters_differ_from_vllms_is_reported() -> None:
    class Renamed(KVStoreConnector):
        def get_num_new_matched_tokens(self, req: Any, computed: int) -> tuple[int | None, bool]:  # type: ignore[override]
            return 0, False

        def on_a_hook_vllm_never_calls(self) -> None:
            pass

    problems = check_hooks(vllm_release(), Renamed)
    assert any("get_num_new_matched_tokens" in p and "positional parameters differ" in p for p in problems), problems
    assert any("on_a_hook_vllm_never_calls: not a hook" in p for p in problems), problems
    assert check_hooks(vllm_release()) == []


def test_attributes_are_found_where_vllm_defines_them() -> None:
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.request import Request

    assert has_attribute(Request, "all_token_ids") and has_attribute(Request, "request_id")
    assert has_attribute(Attention, "_k_scale_float")  # set by a helper of its module, not in a method
    assert not has_attribute(Request, "no_such_attribute_of_a_request")
