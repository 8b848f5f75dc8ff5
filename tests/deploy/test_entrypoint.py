"""Runs the image's start command outside Docker: deploy/Dockerfile's ENTRYPOINT + CMD with its ENV.

The command is taken from the Dockerfile, not restated here, and runs with the
image's environment, except for what a test on a shared machine must change:
loopback host, free ports, a temporary LMDB directory and a small memory tier.
``kvstore`` on ``PATH`` is a wrapper generated from pyproject.toml's
``[project.scripts]`` entry, the way pip writes the image's console script, so
the working tree's package runs whether or not it is installed.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import ENV_PREFIX

from tests.support.deploy import DOCKERFILE, REPO_ROOT, healthcheck_command, image_env, parse_dockerfile, start_command

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

STARTUP_TIMEOUT_S = 120.0   # cold `import torch` on a 2-core CI machine
SHUTDOWN_TIMEOUT_S = 60.0
GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _console_script(bin_dir: Path) -> Path:
    """Write ``bin_dir/kvstore``, running pyproject's ``kvstore = "module:function"`` entry with this interpreter."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["kvstore"].partition(":")
    script = bin_dir / "kvstore"
    script.write_text(
        "#!/bin/sh\n"
        f"exec '{sys.executable}' -c 'import sys; from {module} import {function}; sys.exit({function}())' \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


@pytest.mark.slow
def test_image_start_command_serves_and_stops_cleanly(tmp_path: Path) -> None:
    instructions = parse_dockerfile(DOCKERFILE)
    argv = start_command(instructions)
    assert argv[:2] == ["kvstore", "serve"]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _console_script(bin_dir)
    port, metrics_port = _free_port(), _free_port()
    disk_path = tmp_path / "lmdb"

    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    image = image_env(instructions, base={"PATH": env.get("PATH", "/usr/bin:/bin")})
    env.update({k: v for k, v in image.items() if k != "HOME"})
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{image['PATH']}",
        "PYTHONPATH": str(REPO_ROOT),
        "KVSTORE_HOST": "127.0.0.1",
        "KVSTORE_PORT": str(port),
        "KVSTORE_METRICS_PORT": str(metrics_port),
        "KVSTORE_SERVER__METRICS_HOST": "127.0.0.1",
        "KVSTORE_DISK_PATH": str(disk_path),
        "KVSTORE_DISK_CAPACITY": "256MiB",
        "KVSTORE_MEMORY_CAPACITY": "64MiB",
        "KVSTORE_SERVER__GRACE_S": str(GRACE_S),
    })
    target = f"127.0.0.1:{port}"
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _serving(target):
            assert process.poll() is None, (
                f"`{' '.join(argv)}` exited with {process.returncode} before serving:\n{_tail(stderr)}")
            assert time.monotonic() < deadline, f"not SERVING on {target} after {STARTUP_TIMEOUT_S} s:\n{_tail(stderr)}"
            time.sleep(0.2)  # polling the container's port: the process offers nothing to wait on

        # The image's HEALTHCHECK, run as Docker runs it (sh -c, the container's env).
        check = subprocess.run(["sh", "-c", healthcheck_command(instructions)], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, f"HEALTHCHECK failed while serving:\n{check.stdout}{check.stderr}"

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200
            assert b"# TYPE" in response.read()

        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        assert returncode == 0, f"exit status {returncode} after SIGTERM:\n{_tail(stderr)}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    assert disk_path.is_dir() and any(disk_path.iterdir()), "the LMDB tier was not opened at KVSTORE_DISK_PATH"
