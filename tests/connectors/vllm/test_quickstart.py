"""docs/vllm.md's CPU quick start runs as written: a config-only model, a node, vLLM's server with the connector.

The "On a CPU" block runs with bash in a temporary folder, this venv's ``bin``
first on ``PATH`` (``python`` and ``kvstore`` are .venv-vllm's) and this checkout
on ``PYTHONPATH``: it writes the model's config, starts ``kvstore serve`` and
``python -m vllm.entrypoints.openai.api_server`` in the background, waits for the
server, sends one completion and prints the node's stats. The block's own
``curl -sf`` fails it on an HTTP error; here the completion must hold tokens and
the node the prompt's full blocks, which only the connector puts there. Every
process the block started is stopped after it. It uses the page's fixed ports
(8000, 50051, 9400), as a user would.
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

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_TIMEOUT_S = 600


def test_the_cpu_quick_start_runs_as_written(tmp_path: Path) -> None:
    block = block_at(ROOT / "docs" / "vllm.md", "On a CPU", kind="shell")
    assert block.mark == "tested-by" and block.note.startswith("tests/connectors/vllm/test_quickstart.py")
    assert "vllm.entrypoints.openai.api_server" in block.body and "--load-format dummy" in block.body
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTEST_"))}
    env |= {"PYTHONPATH": str(ROOT), "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])}
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_file.open("w") as stdout, err_file.open("w") as stderr:  # files: the servers left running keep no pipe open
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.body], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        proc.wait(timeout=BLOCK_TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the node and the vLLM server the block left running
        except ProcessLookupError:
            pass
        proc.wait(timeout=120)
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, f"{block.name} exited {proc.returncode}:\n{out[-3000:]}\n{err[-5000:]}"
    decoder = json.JSONDecoder()  # stdout also holds the vLLM server's log lines: find the two documents
    assert '{"id":"cmpl-' in out and '{\n  "tiers"' in out, out[-3000:]
    completion, _ = decoder.raw_decode(out, out.index('{"id":"cmpl-'))
    stats, _ = decoder.raw_decode(out, out.rindex('{\n  "tiers"'))
    assert completion["choices"][0]["finish_reason"] in ("length", "stop"), completion
    assert completion["usage"]["prompt_tokens"] == 299 and completion["usage"]["completion_tokens"] >= 1
    (memory,) = [tier for tier in stats["tiers"] if tier["name"] == "memory"]
    assert memory["blocks"] >= 1, stats  # the connector saved the prompt's full blocks
