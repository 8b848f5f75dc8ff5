"""Every vLLM release the connector supports offers what it uses: each installed ``--no-deps`` in a throwaway venv.

For each release of ``SUPPORTED_MINORS`` (``x.y.0``) other than the one this venv
runs (whose engines the other tests start, and which ``test_surface.py`` checks), a
venv under the temporary folder (``kvstore-vllm-versions/<version>``, kept for the
next run) gets that vLLM from the package index with ``--no-deps``; this venv's
site-packages come after its own (a ``.pth`` file), so vLLM's Python modules
import against this venv's torch and the rest. ``python -m
kvstore.connectors.vllm.surface`` then imports the connector there and checks its
hooks against that release's ``KVConnectorBase_V1``, every name it imports and the
attributes it reads of vLLM's types. No engine runs and no GPU is needed: this
finds what changed shape, not what changed meaning. The first run downloads each
release (about 300 MB); later runs reuse the venvs.
"""

from __future__ import annotations

import fcntl
import json
import os
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from kvstore.connectors.vllm.versions import SUPPORTED_MINORS, installed_vllm_version, release_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ROOT = Path(__file__).resolve().parents[3]
VENVS = Path(tempfile.gettempdir()) / "kvstore-vllm-versions"
INSTALLED = release_of(installed_vllm_version() or "")
RELEASES = [f"{major}.{minor}.0" for major, minor in SUPPORTED_MINORS if (major, minor) != INSTALLED]


def _throwaway_venv(version: str) -> Path:
    """The python of a venv holding vLLM ``version`` (``--no-deps``) before this venv's packages; made once."""
    root = VENVS / version
    python = root / "bin" / "python"
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(VENVS / f"{version}.lock", "w") as lock:  # another run may be making the same venv
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / ".installed"
        if not done.exists():
            venv.EnvBuilder(clear=True, with_pip=True).create(root)
            (purelib,) = [Path(p) for p in site.getsitepackages() if p.endswith("site-packages")][:1]
            target = next((root / "lib").glob("python*/site-packages"))
            (target / "zz-kvstore-test-deps.pth").write_text(f"{purelib}\n")
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"vllm=={version}"],
                           check=True, timeout=1800)
            done.write_text(version)
    return python


@pytest.mark.parametrize("version", RELEASES)
def test_the_connector_fits_each_supported_vllm_release(version: str) -> None:
    python = _throwaway_venv(version)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([str(python), "-m", "kvstore.connectors.vllm.surface", "--json"], env=env,
                            capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["vllm"] == version, report  # the throwaway venv's vLLM, not this venv's
    assert report["supported"] and report["problems"] == [], report
