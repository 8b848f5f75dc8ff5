"""Tests of the connector's settings (``kv_connector_extra_config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.connectors.vllm.config import VLLMConnectorConfig, parse_config
from kvstore.errors import ConfigError


def test_defaults_are_an_embedded_store() -> None:
    config = parse_config({})
    assert config == VLLMConnectorConfig() and config.embedded and config.targets == ()


def test_target_is_one_node_a_comma_list_or_a_json_list() -> None:
    assert parse_config({"target": "127.0.0.1:50051"}).targets == ("127.0.0.1:50051",)
    assert parse_config({"target": "a:1, b:2"}).targets == ("a:1", "b:2")
    assert parse_config({"target": ["a:1", "b:2"]}).targets == ("a:1", "b:2")
    assert not parse_config({"target": "a:1"}).embedded


def test_values_are_typed_from_json_and_strings() -> None:
    config = parse_config({"timeout_s": "0.5", "block_size": 64, "priority": "80", "retention_s": 30,
                           "save_decode_blocks": "false", "hash_algorithm": "sha256", "max_pending_save_bytes": "1GiB"})
    assert (config.timeout_s, config.block_size, config.priority, config.retention_s) == (0.5, 64, 80, 30.0)
    assert config.save_decode_blocks is False and config.hash_algorithm == "sha256"
    assert config.max_pending_save_bytes == 1 << 30


@pytest.mark.parametrize(("extra", "key"), [
    ({"targets": "a:1"}, "kv_connector_extra_config.targets"),  # a typo is an error, not ignored
    ({"shared_storage_path": "/tmp"}, "kv_connector_extra_config.shared_storage_path"),
    ({"timeout_s": 0}, "kv_connector_extra_config.timeout_s"),
    ({"timeout_s": "soon"}, "kv_connector_extra_config.timeout_s"),
    ({"block_size": 0}, "kv_connector_extra_config.block_size"),
    ({"priority": 101}, "kv_connector_extra_config.priority"),
    ({"hash_algorithm": "md5"}, "kv_connector_extra_config.hash_algorithm"),
    ({"load_failure_policy": "retry"}, "kv_connector_extra_config.load_failure_policy"),
    ({"target": "a:1", "config": "kvstore.yaml"}, "kv_connector_extra_config.config"),
    ({"tls_ca_file": "ca.pem"}, "kv_connector_extra_config.target"),
    ({"target": "a:1", "tls_cert_file": "c.pem"}, "kv_connector_extra_config.tls_cert_file"),
    ({"target": "a:1,,b:2"}, "kv_connector_extra_config.target"),
])
def test_bad_settings_are_refused_naming_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(extra)
    assert info.value.field == key


def test_an_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key; the kvstore connector knows \[.*'target'.*'timeout_s'"):
        parse_config({"tagret": "a:1"})


def test_the_bearer_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  from-the-file-0123456789\n")
    assert parse_config({"target": "a:1", "token_file": str(token_file)}).bearer_token({}) == "from-the-file-0123456789"
    config = parse_config({"target": "a:1", "token_env": "MY_TOKEN"})
    assert config.bearer_token({"MY_TOKEN": "from-the-env-0123456789"}) == "from-the-env-0123456789"
    assert config.bearer_token({}) is None
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config({"target": "a:1", "token_file": str(tmp_path / "missing")}).bearer_token({})


def test_without_a_target_the_nodes_come_from_kvstore_target() -> None:
    env = {"KVSTORE_TARGET": "kv-0:50051,kv-1:50051"}
    assert parse_config({}, environ=env).targets == ("kv-0:50051", "kv-1:50051")
    assert parse_config(None, environ=env).targets == ("kv-0:50051", "kv-1:50051")
    assert parse_config({"target": "a:1"}, environ=env).targets == ("a:1",)  # the setting wins
    assert parse_config({}, environ={"KVSTORE_TARGET": " "}).embedded  # empty: an embedded store, as unset
    assert parse_config({}, environ={}).embedded


@pytest.mark.parametrize(("extra", "env", "key"), [
    ({}, {"KVSTORE_TARGET": "a:1,,b:2"}, "KVSTORE_TARGET"),
    ({"config": "kvstore.yaml"}, {"KVSTORE_TARGET": "a:1"}, "kv_connector_extra_config.config"),
])
def test_a_bad_kvstore_target_is_refused_naming_the_variable(extra: dict, env: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(extra, environ=env)
    assert info.value.field == key
    assert "KVSTORE_TARGET" in str(info.value)
