"""The SGLang backend's settings and page keys (no SGLang needed: these run in every venv)."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.connectors.sglang.config import parse_config
from kvstore.connectors.sglang.pages import block_hash
from kvstore.errors import ConfigError

LOADER = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
          "class_name": "KVStoreHiCacheStorage", "interface_v1": 1}


def test_sglangs_own_keys_pass_and_every_setting_is_typed():
    config = parse_config({**LOADER, "target": ["10.0.0.1:50051", "10.0.0.2:50051"], "timeout_s": "0.5",
                           "priority": 80, "retention_s": 60, "tenant": "team-a"})
    assert config.targets == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert (config.timeout_s, config.priority, config.retention_s, config.tenant) == (0.5, 80, 60.0, "team-a")
    assert parse_config(None).targets == ()


@pytest.mark.parametrize("extra, field", [
    ({"tagret": "127.0.0.1:1"}, "hicache_storage_backend_extra_config.tagret"),
    ({"priority": 101}, "priority"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"retention_s": -1}, "retention_s"),
    ({"token_file": "/x"}, "target"),
    ({"target": "a:1", "config": "kvstore.toml"}, "config"),
    ({"target": "a:1", "tls_cert_file": "c.pem"}, "tls_cert_file"),
    ({"target": "a:1,"}, "target"),
])
def test_a_bad_or_unknown_setting_stops_start_up_naming_it(extra, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config({**LOADER, **extra})


def test_the_token_comes_from_its_file_or_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("secret-token-0123456789\n")
    assert parse_config({"target": "a:1", "token_file": str(token_file)}).bearer_token() == "secret-token-0123456789"
    assert parse_config({"target": "a:1"}).bearer_token({"KVSTORE_TOKEN": "from-env"}) == "from-env"
    token_file.write_text("")
    with pytest.raises(ConfigError, match="token_file"):
        parse_config({"target": "a:1", "token_file": str(token_file)}).bearer_token()


def test_sglang_page_keys_are_their_sha256_bytes_and_other_keys_are_hashed_apart():
    key = hashlib.sha256(b"tokens").hexdigest()
    assert block_hash(key) == bytes.fromhex(key)
    suffixed = block_hash(key + ".mamba")
    assert len(suffixed) == 32 and suffixed != block_hash(key)
    assert block_hash(key.upper()) != block_hash(key)  # not SGLang's form: hashed, never read as hex
