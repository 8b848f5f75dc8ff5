"""``kvstore.connection``: targets without a port, and TLS and token settings from flags, the environment and files."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstore.connection import CLIENT_ENV, Connection, add_connection_arguments, redact, with_default_port
from kvstore.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("given", "expected"), [
    ("localhost", "localhost:50051"),
    ("kv-0.kv", "kv-0.kv:50051"),
    ("10.0.0.7", "10.0.0.7:50051"),
    ("localhost:6000", "localhost:6000"),
    ("[::1]", "[::1]:50051"),
    ("::1", "[::1]:50051"),
    ("[::1]:6000", "[::1]:6000"),
    ("unix:/run/kvstore.sock", "unix:/run/kvstore.sock"),
    ("dns:///kv.internal:6000", "dns:///kv.internal:6000"),
])
def test_a_target_without_a_port_gets_the_default_port(given: str, expected: str) -> None:
    assert with_default_port(given) == expected


@pytest.mark.parametrize("bad", ["", "host:port", "host:"])
def test_a_malformed_target_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="target"):
        with_default_port(bad)


def test_plaintext_by_default() -> None:
    connection = Connection.from_args(_args(), env={})
    assert not connection.uses_tls and connection.client_kwargs() == {"metadata": []}
    assert connection.describe() == "plaintext"


def test_a_flag_wins_over_its_variable() -> None:
    env = {"KVSTORE_TLS_CA": "/env/ca.crt", "KVSTORE_TLS_SERVER_NAME": "env.example"}
    connection = Connection.from_args(_args("--tls-ca", "/flag/ca.crt"), env=env)
    assert connection.tls_ca_file == "/flag/ca.crt"
    assert connection.tls_server_name == "env.example"
    assert connection.uses_tls


def test_the_token_comes_from_the_first_source_set(tmp_path: Path) -> None:
    flag_file, env_file = tmp_path / "flag", tmp_path / "env"
    flag_file.write_text("token-from-the-flag-file\nsecond line ignored\n")
    env_file.write_text("  token-from-the-env-file  \n")
    env = {"KVSTORE_TOKEN_FILE": str(env_file), "KVSTORE_TOKEN": "token-from-the-variable"}
    assert Connection.from_args(_args("--token-file", str(flag_file), "--token", "x" * 20), env=env).token \
        == "token-from-the-flag-file"
    assert Connection.from_args(_args("--token", "token-from-the-flag"), env=env).token == "token-from-the-flag"
    assert Connection.from_args(_args(), env=env).token == "token-from-the-env-file"
    assert Connection.from_args(_args(), env={"KVSTORE_TOKEN": "token-from-the-variable"}).token \
        == "token-from-the-variable"


def test_the_token_is_never_shown() -> None:
    connection = Connection.from_args(_args(), env={"KVSTORE_TOKEN": "secret-token-0123456789"})
    assert "secret-token" not in repr(connection)
    assert connection.describe() == "plaintext + token"
    assert connection.client_kwargs()["metadata"] == [("authorization", "Bearer secret-token-0123456789")]
    assert redact(["stats", "--token", "secret", "--token=secret", "--timeout", "2"]) == \
        ["stats", "--token", "***", "--token=***", "--timeout", "2"]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--token-file", "/nonexistent/token"], {}, "--token-file: cannot read the token file /nonexistent/token"),
    ([], {"KVSTORE_TOKEN_FILE": "/nonexistent/token"}, "KVSTORE_TOKEN_FILE: cannot read"),
    (["--tls-cert", "c.pem"], {}, "a client certificate and its key go together"),
    ([], {"KVSTORE_TLS_KEY": "k.pem"}, "a client certificate and its key go together"),
    (["--tls-server-name", "kv.internal"], {}, "applies only to TLS"),
    (["--token", "has space"], {}, "printable ASCII"),
])
def test_settings_that_cannot_work_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Connection.from_args(_args(*argv), env=env)


def test_an_empty_token_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        Connection.from_args(_args("--token-file", str(empty)), env={})


def test_tls_with_the_system_roots_and_a_server_name() -> None:
    connection = Connection.from_args(_args(), env={"KVSTORE_TLS": "1", "KVSTORE_TLS_SERVER_NAME": "kv.internal"})
    kwargs = connection.client_kwargs()
    assert kwargs["credentials"] is not None
    assert kwargs["channel_options"] == [("grpc.ssl_target_name_override", "kv.internal")]


def test_every_variable_is_listed() -> None:
    assert set(CLIENT_ENV) == {"KVSTORE_TLS", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY",
                               "KVSTORE_TLS_SERVER_NAME", "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE"}
