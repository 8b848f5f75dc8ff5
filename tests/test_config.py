"""Tests of config loading: files, environment, sizes and errors that name the field."""

from __future__ import annotations

import pytest

from kvstore.config import GiB, MiB, load_config, parse_size
from kvstore.errors import ConfigError


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * GiB), ("512MiB", 512 * MiB), ("1.5GB", 1_500_000_000),
                                           ("4096", 4096), (4096, 4096), ("2 kib", 2048)])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8 parsecs", "-1", "GiB", ""])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_defaults() -> None:
    config = load_config(env={})
    assert config.server.port == 50051 and config.store.memory.capacity_bytes == GiB


def test_toml_yaml_env_and_override_precedence(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[store.memory]\ncapacity_bytes = "2GiB"\n[store.disk]\npath = "/tmp/x"\n[server]\nport = 1\n')
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("store:\n  memory:\n    capacity_bytes: 2GiB\n  disk:\n    path: /tmp/x\nserver:\n  port: 1\n")
    for path in (toml, yaml_file):
        config = load_config(path, env={"KVSTORE_PORT": "2", "KVSTORE_DISK_CAPACITY": "3GiB"},
                             overrides={"server.port": 3, "store.memory.device": None})
        assert config.store.memory.capacity_bytes == 2 * GiB
        assert config.store.disk.path == "/tmp/x" and config.store.disk.capacity_bytes == 3 * GiB
        assert config.server.port == 3
    config = load_config(env={"KVSTORE_STORE__REDIS__URL": "redis://127.0.0.1:1", "KVSTORE_SERVER__GRACE_S": "2.5",
                              "KVSTORE_STORE__PROMOTE_ON_HIT": "false"})
    assert config.store.redis.url == "redis://127.0.0.1:1" and config.server.grace_s == 2.5
    assert config.store.promote_on_hit is False


@pytest.mark.parametrize("env,field", [
    ({"KVSTORE_MEMORY_CAPACITY": "lots"}, "store.memory.capacity_bytes"),
    ({"KVSTORE_PORT": "70000"}, "server.port"),
    ({"KVSTORE_PORT": "http"}, "server.port"),
    ({"KVSTORE_STORE__MEMORY__DEVICE": "tpu"}, "store.memory.device"),
    ({"KVSTORE_STORE__REDIS__MODE": "sometimes"}, "store.redis.mode"),
    ({"KVSTORE_STORE__NOPE": "1"}, "store.nope"),
    ({"KVSTORE_STORE__PROMOTE_ON_HIT": "maybe"}, "store.promote_on_hit"),
    ({"KVSTORE_SERVER__EVENT_LOOP": "trio"}, "server.event_loop"),
])
def test_errors_name_the_field(env: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert info.value.field == field
    assert field in str(info.value)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.toml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [1, 2")
    with pytest.raises(ConfigError):
        load_config(bad, env={})
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("server: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(wrong, env={})
    assert info.value.field == "server"
