"""Every shell and Python block of the README and ``docs/*.md`` runs as written, or its mark says why not here.

Pages are found afresh each run (``tests.support.docs.pages``), so a new page
is covered without a change here. A page's runnable blocks run in order, one
test per page: a Python block in its own interpreter (this checkout on
``PYTHONPATH``) with a timeout, after the earlier Python blocks it
``continues``; a shell block with ``bash -euo pipefail``, this venv's ``bin``
first on ``PATH``. Both run in a temporary folder holding a copy of
``deploy/`` (the paths the docs name), offline. A ``background`` block (a
server) is started, waited for until its address accepts connections, and
stopped with every process it started once the page is done. The marks and
their grammar are in ``tests/support/docs.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.docs import ROOT, Block, blocks, pages

BLOCK_TIMEOUT_S = 240


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.kind and b.mark not in ("not-run", "tested-by")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _wait_for(address: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the background block exited ({proc.returncode}) before {address} accepted connections")
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            time.sleep(0.1)  # polling a port: nothing to wait on but the socket
    pytest.fail(f"nothing accepted connections on {address} within {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A folder with a copy of ``deploy/``; every process a block leaves behind is stopped after the page."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    yield tmp_path


def _run(block: Block, code: str, cwd: Path) -> None:
    argv = [sys.executable, "-c", code] if block.kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S} s")
    finally:
        _stop(proc)  # whatever the block started in the background
    assert proc.returncode == 0, f"{block.name} exited {proc.returncode}:\n{output.decode()[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in pages() if _runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_blocks_run_as_written(page: Path, workdir: Path) -> None:
    servers: list[subprocess.Popen[bytes]] = []
    earlier_python: list[str] = []
    try:
        for block in _runnable(page):
            if block.mark == "background":
                proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.body], cwd=workdir, env=_env(),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
                servers.append(proc)
                _wait_for(block.note, proc)
                continue
            code = block.body
            if block.kind == "python":
                code = "\n".join([*earlier_python, code]) if block.mark == "continues" else code
                earlier_python = [code]
            _run(block, code, workdir)
    finally:
        for proc in servers:
            _stop(proc)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_that_is_not_run_here_says_why(page: Path) -> None:
    for block in blocks(page):  # a malformed mark raises here
        if block.mark == "not-run":
            assert len(block.note.split()) >= 2, f"{block.name}: say what it needs that this machine lacks"
        if block.mark == "tested-by":
            target = block.note.split()[0]
            assert (ROOT / target).exists(), f"{block.name}: tested by {target}, which does not exist"
        if block.mark == "background":
            assert block.kind == "shell" and block.note.rpartition(":")[2].isdigit(), block.name
        if block.mark == "continues":
            assert block.kind == "python", block.name


def test_a_new_page_is_picked_up_and_a_bad_mark_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "new.md"
    page.write_text("<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n<!-- skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="is no mark"):
        blocks(page)
    page.write_text("<!-- not-run -->\n```bash\nnvidia-smi\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks(page)
    assert {p.name for p in pages()} >= {"README.md", "install.md", "vllm.md"}
