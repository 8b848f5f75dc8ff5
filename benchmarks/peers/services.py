"""bench_peers' processes: the servers under test and the workers that drive them, all on loopback.

The orchestrator (``benchmarks/bench_peers.py``, from the project's venv) starts
each server with ``tests.support.process.spawn`` (killed with it) and a
:class:`Worker` per system, from the venv of that system's package.
Listeners are on 127.0.0.1 wherever the program lets us choose; Mooncake's
Transfer Engine and its P2P handshake bind every interface (no setting in
0.3.13.post1), which is why ``make bench-peers`` runs the whole benchmark in a
network namespace of its own when it can.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from tests.support.process import free_port, spawn

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_LOG_LEVEL": "WARNING",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Every child's environment: LMCache's usage reports off, one thread for OpenMP pools."""


def child_env(with_checkout: bool) -> dict[str, str]:
    """The environment of a child: ``QUIET_ENV``; the checkout on ``PYTHONPATH`` only for kvstore's processes."""
    env = {**os.environ, **QUIET_ENV}
    env.pop("PYTHONPATH", None)
    if with_checkout:
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    """Wait until ``127.0.0.1:port`` accepts a connection.

    Raises:
        RuntimeError: with the log's tail, if ``proc`` exits first or the time runs out.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited ({proc.returncode}):\n{tail(log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{proc.args}: nothing listens on 127.0.0.1:{port} after {timeout_s} s:\n{tail(log)}")


def tail(log: Path, num_lines: int = 25) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


class Services:
    """The servers of one run; each ``start_*`` returns what its clients need, :meth:`close` kills them all.

    Args:
        workdir: where logs go.
        python: per venv name (``main``, ``mooncake``, ``lmcache``), its interpreter.
    """

    def __init__(self, workdir: Path, python: dict[str, str]) -> None:
        self.workdir = workdir
        self.python = python
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str],
              **kwargs: Any) -> tuple[subprocess.Popen[bytes], Path]:
        """Start ``argv`` with its output in ``<workdir>/<name>.log``."""
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            kwargs.setdefault("stdout", out)
            proc = spawn(argv, stderr=out, stdin=subprocess.DEVNULL, env=env, **kwargs)
        self.procs.append(proc)
        return proc, log

    def start_rawsock(self, payload: Path) -> int:
        """The raw-socket server (project venv); its port."""
        proc, log = self.spawn("rawsock", [self.python["main"], str(HERE / "rawsock.py"), str(payload)],
                               child_env(False), stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rawsock.py exited:\n{tail(log)}")
        return int(line)

    def start_lmcache_server(self) -> int:
        """``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` (LMCache venv); its port."""
        port = free_port()
        proc, log = self.spawn("lmcache-server", [self.python["lmcache"], "-m", "lmcache.v1.server", "127.0.0.1",
                                                  str(port), "cpu"], child_env(False))
        wait_port(port, proc, log, timeout_s=120)
        return port

    def mooncake_binary(self, name: str) -> str:
        """A binary the Mooncake wheel installs beside its interpreter."""
        return str(Path(self.python["mooncake"]).parent / name)

    def start_mooncake_master(self, name: str) -> str:
        """A ``mooncake_master`` with its RPC and metrics on 127.0.0.1 (no HTTP metadata server); its address."""
        port, metrics_port = free_port(), free_port()
        proc, log = self.spawn(name, [
            self.mooncake_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}", "--enable_metric_reporting=false",
            "--enable_http_metadata_server=false"], child_env(False))
        wait_port(port, proc, log)
        return f"127.0.0.1:{port}"

    def start_mooncake_client(self, name: str, master: str, segment: str = "512MB") -> str:
        """A ``mooncake_client`` (the real client, owning a segment of ``segment``) of ``master``; its address."""
        port = free_port()
        proc, log = self.spawn(name, [
            self.mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}",
            f"--global_segment_size={segment}", f"--master_server_address={master}",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"], child_env(False))
        wait_port(port, proc, log)
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        """Kill every server started here."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


class Worker:
    """One system's worker process (``worker.py``), and the line protocol to it.

    Args:
        name: the system's key, for logs and errors.
        python: the interpreter of the system's venv.
        spec: ``MODULE:CLASS`` of its driver.
        payload: the payload file.
        settings: the driver's settings.
        workdir: where its log (stderr) goes.
        with_checkout: put the checkout on ``PYTHONPATH`` (kvstore's workers).
    """

    def __init__(self, name: str, python: str, spec: str, payload: Path, settings: dict[str, Any], workdir: Path,
                 with_checkout: bool) -> None:
        self.name = name
        self.log = workdir / f"worker-{name}.log"
        env = child_env(with_checkout)
        with open(self.log, "ab") as err:
            self.proc = spawn([python, str(HERE / "worker.py"), spec, str(payload), json.dumps(settings)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=str(HERE),
                              bufsize=0)  # unbuffered: select() sees every answer line
        self.ready: dict[str, Any] | None = None

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """The worker's ready message (versions, info), once it has stored and checked the payload."""
        self.ready = self.receive(timeout_s)
        return self.ready

    def send(self, message: dict[str, Any]) -> None:
        """Send one command line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """One answer line.

        Raises:
            RuntimeError: with the log's tail, on an error answer, an exit, or no answer in ``timeout_s``.
        """
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            state = "exited" if self.proc.poll() is not None else f"gave no answer in {timeout_s} s"
            raise RuntimeError(f"worker {self.name} {state}:\n{tail(self.log)}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"worker {self.name}: {answer['error']}")
        return answer

    def call(self, message: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        """Send one command and return its answer."""
        self.send(message)
        return self.receive(timeout_s)

    def close(self) -> dict[str, Any]:
        """Ask the worker to quit; its last info (empty if it had died)."""
        info: dict[str, Any] = {}
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                info = self.receive(60).get("info", {})
            except (RuntimeError, OSError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return info
