"""Every client subcommand of ``kvstore`` against a real ``kvstore serve`` with mutual TLS and bearer tokens.

The node runs as a subprocess configured only by ``KVSTORE_SECURITY__*``
variables, as in a container. Each subcommand is run once without the
connection options (it must fail and say why) and once with them, from flags,
from the ``KVSTORE_TLS_*`` / ``KVSTORE_TOKEN*`` environment, and from a token file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvstore.cli import main
from kvstore.security import channel_credentials
from tests.support.kvnode import REPO_ROOT, KVNode
from tests.support.redis import TlsFiles, make_tls_files

from tests.support.security import AUTH_TOKENS, TOKEN_A

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
              pytest.mark.slow]  # starts nodes: outside `make test-fast`

TENANT_A = "tenant-a"
CLIENT_ENV = ("KVSTORE_TLS", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY", "KVSTORE_TLS_SERVER_NAME",
              "KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN_A + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def secure_node(pki: TlsFiles) -> Iterator[KVNode]:
    """A node with mutual TLS and tokens, set up through the environment only."""
    env = {
        "KVSTORE_SECURITY__TLS_CERT_FILE": pki.server_cert,
        "KVSTORE_SECURITY__TLS_KEY_FILE": pki.server_key,
        "KVSTORE_SECURITY__TLS_CLIENT_CA_FILE": pki.ca_cert,
        "KVSTORE_SECURITY__AUTH_TOKENS": AUTH_TOKENS,
    }
    credentials = channel_credentials(pki.ca_cert, cert_file=pki.client_cert, key_file=pki.client_key)
    with KVNode(memory_capacity="64MiB", metrics=False, env=env, client_kwargs={"credentials": credentials}) as node:
        yield node


@pytest.fixture(autouse=True)
def no_client_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the client variables it means to test, and no others."""
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)


def _tls_flags(pki: TlsFiles) -> list[str]:
    return ["--tls-ca", pki.ca_cert, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]


def _tls_env(pki: TlsFiles) -> dict[str, str]:
    return {"KVSTORE_TLS_CA": pki.ca_cert, "KVSTORE_TLS_CERT": pki.client_cert, "KVSTORE_TLS_KEY": pki.client_key}


def _kvstore(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` through the real entry point, outside the repository, with ``env`` added."""
    child_env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV} | env
    child_env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          env=child_env, cwd="/", timeout=300)


def _small_trace(path: Path) -> Path:
    lines = [{"timestamp": i * 10, "input_length": 3 * 512 - 7, "output_length": 1, "hash_ids": [1, 2, 3 + i]}
             for i in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# -- health ----------------------------------------------------------------------------


def test_health_without_tls_options_is_unreachable(secure_node: KVNode, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", secure_node.target, "--timeout", "3"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().err


def test_health_with_tls_flags(secure_node: KVNode, pki: TlsFiles, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", secure_node.target, *_tls_flags(pki)]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_health_as_a_probe_takes_everything_from_the_environment(secure_node: KVNode, pki: TlsFiles) -> None:
    """The Dockerfile's and compose's probe: `kvstore health --target 127.0.0.1:PORT`, no security flags."""
    result = _kvstore(["health", "--target", secure_node.target], _tls_env(pki))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SERVING"


def test_tls_server_name_is_checked_against_the_certificate(secure_node: KVNode, pki: TlsFiles,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    good = ["health", "--target", secure_node.target, "--timeout", "3", *_tls_flags(pki)]
    assert main([*good, "--tls-server-name", "localhost"]) == 0  # the certificate names localhost
    capsys.readouterr()
    assert main([*good, "--tls-server-name", "kvstore.example.com"]) == 1  # and not this
    assert "UNREACHABLE" in capsys.readouterr().err


# -- stats ----------------------------------------------------------------------------


def test_stats_without_a_token_is_refused_with_the_reason(secure_node: KVNode, pki: TlsFiles,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", secure_node.target, *_tls_flags(pki)]) == 1
    assert "Bearer" in capsys.readouterr().err


def test_stats_with_a_token_file_flag(secure_node: KVNode, pki: TlsFiles, token_file: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", secure_node.target, *_tls_flags(pki), "--token-file", str(token_file)]) == 0
    out = capsys.readouterr().out
    assert [t["name"] for t in json.loads(out)["tiers"]] == ["memory"]
    assert TOKEN_A not in out


@pytest.mark.parametrize("variable", ["KVSTORE_TOKEN", "KVSTORE_TOKEN_FILE"])
def test_stats_with_the_token_from_the_environment(secure_node: KVNode, pki: TlsFiles, token_file: Path,
                                                   variable: str) -> None:
    value = TOKEN_A if variable == "KVSTORE_TOKEN" else str(token_file)
    result = _kvstore(["stats", "--target", secure_node.target], _tls_env(pki) | {variable: value})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tiers"][0]["name"] == "memory"


def test_a_wrong_token_is_refused(secure_node: KVNode, pki: TlsFiles, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-a-token-that-the-node-knows\n")
    assert main(["stats", "--target", secure_node.target, *_tls_flags(pki), "--token-file", str(wrong)]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err.upper() or "unknown" in err.lower()
    assert "not-a-token-that-the-node-knows" not in err


def test_an_unreadable_tls_file_is_a_usage_error(secure_node: KVNode, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", secure_node.target, "--tls-ca", str(tmp_path / "missing.crt")]) == 2
    assert "missing.crt" in capsys.readouterr().err


# -- loadtest ----------------------------------------------------------------------------


def test_loadtest_without_a_token_stops_before_the_load(secure_node: KVNode, pki: TlsFiles, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    trace = _small_trace(tmp_path / "trace.jsonl")
    code = main(["loadtest", "--target", secure_node.target, "--trace", str(trace), *_tls_flags(pki),
                 "--block-bytes", "1KiB", "--no-progress"])
    assert code == 1
    assert "not serving" in capsys.readouterr().err


def test_loadtest_with_tls_flags_and_the_token_in_the_environment(
        secure_node: KVNode, pki: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN_A)
    trace = _small_trace(tmp_path / "trace.jsonl")
    out_json = tmp_path / "result.json"
    code = main(["loadtest", "--target", secure_node.target, "--trace", str(trace), *_tls_flags(pki),
                 "--cache-salt", TENANT_A, "--block-bytes", "1KiB", "--no-progress", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out_json.read_text())
    assert result["num_requests"] == 4 and result["num_failed"] == 0
    assert result["hit_blocks"] == 2 * 3  # requests 2-4 each hit blocks 1 and 2 of request 1
    assert result["config"]["hash_algorithm"] == "sha256"  # a token was sent: the node requires SHA-256
    assert TOKEN_A not in out_json.read_text()


def test_loadtest_for_another_tenant_is_denied(secure_node: KVNode, pki: TlsFiles, token_file: Path,
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _small_trace(tmp_path / "trace.jsonl")
    code = main(["loadtest", "--target", secure_node.target, "--trace", str(trace), *_tls_flags(pki),
                 "--token-file", str(token_file), "--cache-salt", "tenant-b", "--block-bytes", "1KiB",
                 "--no-progress"])
    assert code == 1
    assert "PermissionDeniedError" in capsys.readouterr().out


# -- demo --target ----------------------------------------------------------------------------


def test_demo_against_the_secured_node(secure_node: KVNode, pki: TlsFiles, tmp_path: Path) -> None:
    result = _kvstore(["demo", "--target", secure_node.target, "--token", TOKEN_A,
                       "--cache-salt", TENANT_A, "--model", "tiny", "--device", "cpu", "--passage-tokens", "128",
                       "--questions", "2", "--turns", "0", "--block-size", "32", "--max-new-tokens", "2",
                       "--out", str(tmp_path)], _tls_env(pki))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["store"] == secure_node.target
    assert summary["requests"][1]["cached_tokens"] >= 96  # the passage, from the node
    assert TOKEN_A not in (tmp_path / "summary.json").read_text()  # its command line is recorded, redacted
    assert "--token ***" in summary["command"]

