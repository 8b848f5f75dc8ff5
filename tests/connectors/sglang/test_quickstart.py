"""docs/sglang.md's CPU quick start runs as written: a tiny model, a node, SGLang's server with kvstore's backend.

The "On a CPU: a quick start" block runs with bash from this checkout's root
(the block names the CPU scaffolding by ``$PWD``), ``.venv-sglang``'s ``bin``
first on ``PATH`` and this checkout on ``PYTHONPATH``: it writes the model,
starts ``kvstore serve`` and ``python -m sglang.launch_server`` in the
background, sends the prompt, waits for its pages in the node, flushes SGLang's
cache and sends the prompt again. The block's ``curl -sf`` fails it on an HTTP
error; here the second answer must say its prefix came from storage, with the
first answer's tokens. Every process the block started is stopped after it. It
uses the page's fixed ports (30000, 50052: not the vLLM quick start's 50051), as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs import ROOT, block_at

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_TIMEOUT_S = 600


def test_the_cpu_quick_start_runs_as_written(tmp_path: Path) -> None:
    block = block_at(ROOT / "docs" / "sglang.md", "On a CPU: a quick start", kind="shell")
    assert block.mark == "tested-by" and block.note.startswith("tests/connectors/sglang/test_quickstart.py")
    assert "sglang.launch_server" in block.body and '"module_path": "kvstore.connectors.sglang"' in block.body
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTEST_"))}
    env |= {"PYTHONPATH": str(ROOT), "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),
            "HF_HUB_OFFLINE": "1"}
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_file.open("w") as stdout, err_file.open("w") as stderr:  # files: the servers left running keep no pipe open
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.body], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        proc.wait(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass  # reported below, with the block's output
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the node and the SGLang server (and its processes) the block left
        except ProcessLookupError:
            pass
        proc.wait(timeout=120)
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, (f"{block.name} exited {proc.returncode} (-9: still running after "
                                  f"{BLOCK_TIMEOUT_S} s):\n{out[-3000:]}\n{err[-5000:]}")
    answers = [json.loads(line) for line in out.splitlines() if line.startswith('{"text":')]
    assert len(answers) == 2, out[-3000:]
    first, again = answers
    assert first["meta_info"]["cached_tokens"] == 0
    details = again["meta_info"]["cached_tokens_details"]
    assert (details["device"], details["host"], details["storage"]) == (0, 0, 592), details
    assert details["storage_backend"] == "KVStoreHiCacheStorage"
    assert again["output_ids"] == first["output_ids"]
