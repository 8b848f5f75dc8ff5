"""The release check: the sdist and the wheel, built by ``build``, installed in a fresh venv, and run from it.

``python -m build`` (from ``.[dev]``) builds the sdist from what the Dockerfile
copies (``pyproject.toml``, ``README.md``, ``LICENSE``, ``kvstore/``), then the
wheel from the sdist, as a release does (docs/install.md, "Building a release").
The wheel is installed with its ``hf`` extra into a new venv that sees nothing
of this checkout: no ``PYTHONPATH``, the working directory a temporary folder.
Then the README's embedded quick start runs from it, and each subcommand its
basic use: ``serve`` a node, ``health`` and ``stats`` of it, ``loadtest`` and
``simulate`` on the trace bundled in the wheel, and ``demo`` embedded and
against the node.

Dependencies come from the package index, torch first as the same version this
venv runs (a CPU build from this project's machines' local wheels; set
``KVSTORE_TEST_TORCH_SPEC`` to install it otherwise, e.g. with an
``--index-url``). It takes a minute or two on an idle machine, several on a busy
one: it is marked ``slow``, with a timeout of its own.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # pip on a busy 2-core machine: minutes, not seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "llm-kvstore"
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kvstore")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``'s output folder: the sdist and the wheel built from it (no build isolation: offline)."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy(REPO_ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                   check=True, timeout=600, capture_output=True)
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    """The wheel that ``build`` made from the sdist."""
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding the wheel with its hf extra and nothing of this checkout; its ``bin`` folder."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_spec = os.environ.get("KVSTORE_TEST_TORCH_SPEC", f"torch=={torch.__version__.split('+')[0]}")
    subprocess.run([*pip, *shlex.split(torch_spec)], check=True, timeout=1200, cwd=root)
    subprocess.run([*pip, f"{wheel}[hf]"], check=True, timeout=1200, cwd=root)
    return root / "bin"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory with nothing of the repository in it."""
    return tmp_path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("KVSTORE_")}


def _run(bin_dir: Path, args: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(bin_dir / "kvstore"), *args], capture_output=True, text=True, cwd=cwd,
                            env=_env(), timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"kvstore {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture
def node(fresh_venv: Path, outside: Path) -> Iterator[str]:
    """``kvstore serve`` of the fresh venv on free ports; its target."""
    proc = subprocess.Popen([str(fresh_venv / "kvstore"), "serve", "--port", "0", "--metrics-port", "0",
                             "--memory-capacity", "256MiB"], stderr=subprocess.PIPE, text=True, cwd=outside,
                            env=_env(), stdin=subprocess.DEVNULL)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:  # one JSON object a line; the "serving" one names the port
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "serving":
                yield f"127.0.0.1:{record['port']}"
                break
        else:
            pytest.fail(f"kvstore serve exited ({proc.wait()}) without serving")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_the_wheel_is_llm_kvstore_with_its_data_and_licences(wheel: Path) -> None:
    assert wheel.name.startswith("llm_kvstore-") and wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert f"Name: {DISTRIBUTION}\n" in metadata
    assert "kvstore = kvstore.cli:main" in entry_points
    assert {"kvstore/data/traces/mooncake_conversation_trace.jsonl", "kvstore/data/traces/README.md",
            "kvstore/data/tinyshakespeare.txt", "kvstore/data/README.md", "kvstore/py.typed"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_sdist_holds_the_sources_and_no_tests(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    assert sdist.name == "llm_kvstore-0.1.0.tar.gz"
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE", "PKG-INFO", "kvstore/__init__.py", "kvstore/cli.py",
            "kvstore/data/traces/mooncake_conversation_trace.jsonl", "kvstore/py.typed"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_readmes_embedded_quick_start_runs_from_the_wheel(fresh_venv: Path, outside: Path) -> None:
    from tests.test_readme import python_blocks

    code = python_blocks()[0]
    assert "open_store" in code
    result = subprocess.run([str(fresh_venv / "python"), "-c", code], capture_output=True, text=True, cwd=outside,
                            env=_env(), timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LookupResult(num_blocks=6, tiers=('memory'" in result.stdout


def test_the_package_comes_from_the_venv_not_the_checkout(fresh_venv: Path, outside: Path) -> None:
    result = subprocess.run([str(fresh_venv / "python"), "-c",
                             "import kvstore, kvstore.data; print(kvstore.__file__); print(kvstore.data.bundled_trace())"],
                            capture_output=True, text=True, cwd=outside, env=_env(), check=True)
    module, trace = result.stdout.split()
    assert module.startswith(str(fresh_venv.parent)) and trace.startswith(str(fresh_venv.parent))
    show = subprocess.run([str(fresh_venv / "python"), "-m", "pip", "show", DISTRIBUTION], capture_output=True,
                          text=True, cwd=outside, env=_env(), check=True).stdout
    assert f"Name: {DISTRIBUTION}" in show


def _subcommands() -> list[str]:
    """Every subcommand of ``kvstore`` (from the checkout's parser), so a new one is checked without a list here."""
    import argparse

    from kvstore.cli import build_parser

    [subparsers] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(subparsers.choices)


@pytest.mark.parametrize("command", [None, *_subcommands()])
def test_every_subcommand_has_its_help(fresh_venv: Path, outside: Path, command: str | None) -> None:
    result = _run(fresh_venv, [command, "--help"] if command else ["--help"], outside)
    assert result.stdout.startswith(f"usage: kvstore{' ' + command if command else ''}")


def test_every_subcommand_runs_its_basic_use(fresh_venv: Path, outside: Path, node: str) -> None:
    assert _run(fresh_venv, ["health", "--target", node], outside).stdout.strip() == "SERVING"
    stats = json.loads(_run(fresh_venv, ["stats", "--target", node], outside).stdout)
    assert [t["name"] for t in stats["tiers"]] == ["memory"]
    simulated = _run(fresh_venv, ["simulate", "--capacity", "5859", "--policy", "lru"], outside).stdout
    assert "mooncake_conversation_trace" in simulated and "0.1361" in simulated  # the bundled trace
    loaded = _run(fresh_venv, ["loadtest", "--target", node, "--requests", "30", "--block-bytes", "4KiB",
                               "--no-progress"], outside).stdout
    assert "30 completed, 0 failed" in loaded
    demo_args = ["--model", "tiny", "--device", "cpu", "--passage-tokens", "128", "--questions", "2", "--turns", "1",
                 "--turn-tokens", "64", "--block-size", "32", "--max-new-tokens", "2"]
    embedded = _run(fresh_venv, ["demo", *demo_args, "--out", str(outside / "embedded")], outside).stdout
    served = _run(fresh_venv, ["demo", "--target", node, *demo_args, "--out", str(outside / "served")], outside).stdout
    assert "outputs identical: 3/3" in embedded and "outputs identical: 3/3" in served
    assert json.loads((outside / "served" / "summary.json").read_text())["store"] == node
