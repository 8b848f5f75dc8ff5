"""docs/vllm.md's CPU quick start runs as written: a config-only model, a node, vLLM's server with the connector.

The "On a CPU" block runs with bash in a temporary folder, this venv's ``bin``
first on ``PATH`` (``python`` and ``kvstore`` are .venv-vllm's) and this checkout
on ``PYTHONPATH``: it writes the model's config and a byte-level tokenizer, starts
``kvstore serve`` and ``python -m vllm.entrypoints.openai.api_server`` in the
background with the two-key setting (``KVStoreConnector`` known to vLLM by the
package's entry point, the node from ``KVSTORE_TARGET``), sends the same prompt
twice, and prints the completions' text, the connector's metrics and the node's
table. The block's own ``curl -sf`` fails it on an HTTP error; here both
completions must print, the second request must have loaded blocks from kvstore
(``vllm:kvstore_loaded_tokens_total``), and the node must hold the prompt's
blocks, which only the connector puts there. The venv must hold this checkout's
entry point (``make setup-vllm`` installs it). Every process the block started is
stopped after it. It uses the page's fixed ports (8000, 50051, 9400), as a user would.
"""

from __future__ import annotations

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
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvstore") == "kvstore.connectors.vllm.plugin:register", (
        "this venv's llm-kvstore predates its vLLM entry point: reinstall it (make setup-vllm)")
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
    lines = out.splitlines()
    assert any(line.startswith("first: '") for line in lines), out[-3000:]
    assert any(line.startswith("second: '") for line in lines), out[-3000:]
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:kvstore_")}
    assert metrics["vllm:kvstore_lookup_tokens_total"] >= 512, out[-3000:]
    assert metrics["vllm:kvstore_hit_tokens_total"] >= 384, out[-3000:]  # the second request: a kvstore hit
    assert metrics["vllm:kvstore_loaded_tokens_total"] == metrics["vllm:kvstore_hit_tokens_total"]
    (memory,) = [line.split() for line in lines if line.startswith("memory ")]
    assert memory[1] == "up" and int(memory[2].replace(",", "")) >= 3, memory  # the connector saved the blocks
    assert any(line.startswith("node 127.0.0.1:50051: prefix hit ratio ") for line in lines), out[-3000:]
