"""Config mistakes that used to pass or fall short: each is refused, naming the setting, quoting the value, giving a fix.

Through ``kvstore serve`` (its exit status and stderr, before any port is opened)
and through ``load_config`` from each source: flags, ``KVSTORE_*`` variables and a
file. docs/errors.md lists them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.config import load_config, redis_url_problem
from kvstore.errors import ConfigError


def _serve(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["serve", "--port", "0", "--metrics-port", "-1", *flags]) == 2
    return capsys.readouterr().err


def test_a_host_and_port_without_a_scheme_names_the_setting_and_the_url_meant(capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve(capsys, "--redis-url", "localhost:6379")
    assert "store.redis.url: 'localhost:6379' is not a Redis URL" in err
    assert "--redis-url" in err and "KVSTORE_REDIS_URL" in err and "'redis://localhost:6379/0'" in err


def test_one_slash_after_the_scheme_is_refused_not_read_as_localhost(capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve(capsys, "--redis-url", "redis:/127.0.0.1:6379")
    assert "store.redis.url: 'redis:/127.0.0.1:6379' has no host" in err and "'redis://127.0.0.1:6379'" in err


@pytest.mark.parametrize(("url", "says"), [
    ("http://cache:6379", "has the scheme 'http'"),
    ("rediss:/cache:6380/0", "has no host"),
    ("redis:///0", "names no host"),
    ("redis://cache:port/0", "has a port that is not a number"),
    ("unix://", "names no socket"),
])
def test_other_malformed_urls_are_refused_from_every_source(url: str, says: str, tmp_path: Path) -> None:
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text(f'[store.redis]\nurl = "{url}"\n')
    for kwargs in ({"overrides": {"store.redis.url": url}}, {"env": {"KVSTORE_REDIS_URL": url}},
                   {"path": config_file, "env": {}}):
        with pytest.raises(ConfigError, match=r"^store\.redis\.url: ") as caught:
            load_config(**kwargs)  # type: ignore[arg-type]
        assert f"{url!r} {says}" in str(caught.value) and "KVSTORE_REDIS_URL" in str(caught.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://cache", "rediss://user:pw@cache:6380/2",
                                 "redis://[::1]:6379", "unix:///run/redis/redis.sock", "unix:///tmp/r.sock?db=1"])
def test_well_formed_urls_pass(url: str) -> None:
    assert redis_url_problem(url) is None
    assert load_config(env={}, overrides={"store.redis.url": url}).store.redis.url == url


def test_a_disk_capacity_without_a_disk_path_says_what_to_add(capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve(capsys, "--disk-capacity", "1GiB")
    assert "store.disk.capacity_bytes: is set but store.disk.path is not" in err
    assert "add --disk-path DIR (store.disk.path, KVSTORE_DISK_PATH)" in err
    with pytest.raises(ConfigError, match="store.disk.path is not"):
        load_config(env={"KVSTORE_DISK_CAPACITY": "1GiB"})


def test_a_disk_capacity_with_a_path_from_another_source_is_fine(tmp_path: Path) -> None:
    config = load_config(env={"KVSTORE_DISK_PATH": str(tmp_path)}, overrides={"store.disk.capacity_bytes": "1GiB"})
    assert config.store.disk.path == str(tmp_path) and config.store.disk.capacity_bytes == 1 << 30
    assert load_config(env={}).store.disk.path == ""  # no capacity named, no disk tier: no error


def test_an_empty_disk_path_turns_a_files_disk_tier_off_without_an_error(tmp_path: Path) -> None:
    config_file = tmp_path / "kvstore.yaml"  # as the Kubernetes sidecar does: the file's tier, off by a variable
    config_file.write_text(f"store:\n  disk:\n    path: {tmp_path / 'lmdb'}\n    capacity_bytes: 1GiB\n")
    assert load_config(config_file, env={"KVSTORE_DISK_PATH": ""}).store.disk.path == ""
