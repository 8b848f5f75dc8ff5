"""A real ``kvstore serve`` subprocess on free loopback ports, for tests and benchmarks.

The node is started as ``python -m kvstore.cli serve --port P --metrics-port M
--log-format json ...``; :meth:`KVNode.start` reads its JSON log (a file in the
node's work directory) until the ``serving`` line names the bound ports, then
waits until ``grpc.health.v1`` answers SERVING. A restart reuses the same ports
and arguments (so an LMDB path survives it). Processes die with the thread that
started them (``PR_SET_PDEATHSIG``) and at interpreter exit.

Plain use::

    with KVNode(memory_capacity="64MiB", disk_path=tmp_path / "lmdb") as node:
        client = KVStoreClient(node.target)
        ...
        node.stop()      # SIGTERM: graceful shutdown, LMDB flushed
        node.start()     # same ports, same disk path
        node.kill()      # SIGKILL, like a crash
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tests.support.process import OwnedProcess, forget, free_port, spawn  # noqa: F401  (free_port is re-exported)

REPO_ROOT = Path(__file__).resolve().parents[2]


class KVNode(OwnedProcess):
    """One real ``kvstore serve`` process on loopback ports, which can be stopped, killed and restarted.

    Args:
        memory_capacity: ``--memory-capacity`` (e.g. ``"64MiB"``); ``None`` for the default.
        disk_path: ``--disk-path``, enabling the LMDB tier; ``None`` for none.
        disk_capacity: ``--disk-capacity``; ``None`` for the default.
        redis_url: ``--redis-url``; ``None`` for none.
        config_path: ``--config`` file.
        extra_args: more ``kvstore serve`` arguments.
        env: extra environment variables (e.g. ``KVSTORE_SERVER__GRACE_S``).
        metrics: serve Prometheus metrics on a free port (else ``--metrics-port -1``).
        startup_timeout_s: seconds :meth:`start` waits for the ``serving`` line and SERVING health.
        workdir: directory of the log file; a new temporary one when ``None`` (removed by :meth:`close`).
        file_size_limit_bytes: largest file the node may write (``RLIMIT_FSIZE``), bytes: a disk that
            fills up, for fault tests (its log file counts too); ``None`` for no limit.
        client_kwargs: ``KVStoreClient`` keyword arguments of the readiness check (e.g. ``credentials``
            for a node with TLS); none when ``None``.

    Raises:
        RuntimeError: from :meth:`start`, with the log tail, if the node does not come up.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        memory_capacity: str | None = "64MiB",
        disk_path: str | os.PathLike[str] | None = None,
        disk_capacity: str | None = None,
        redis_url: str | None = None,
        config_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        metrics: bool = True,
        startup_timeout_s: float = 90.0,
        workdir: str | os.PathLike[str] | None = None,
        file_size_limit_bytes: int | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.args: list[str] = []
        for flag, value in (
            ("--memory-capacity", memory_capacity), ("--disk-path", disk_path), ("--disk-capacity", disk_capacity),
            ("--redis-url", redis_url), ("--config", config_path),
        ):
            if value is not None:
                self.args += [flag, str(value)]
        self.args += list(extra_args)
        self.env = dict(env or {})
        self.metrics = metrics
        self.startup_timeout_s = startup_timeout_s
        self.file_size_limit_bytes = file_size_limit_bytes
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstore-node-")) if workdir is None else Path(workdir)
        self.port = 0
        self.metrics_port = -1 if not metrics else 0
        self.client_kwargs = dict(client_kwargs or {})
        self.num_starts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # ------------------------------------------------------------------ properties

    @property
    def target(self) -> str:
        """``127.0.0.1:<port>`` for clients."""
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """``http://127.0.0.1:<metrics_port>/metrics``."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        """The node's stderr (JSON log lines) across all its starts."""
        return self.workdir / "kvstore-serve.log"

    @property
    def pid(self) -> int | None:
        """Process id while running, else ``None``."""
        return self._proc.pid if self.is_running else None

    @property
    def is_running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status of the last process, ``None`` while running or before the first start."""
        return None if self._proc is None else self._proc.poll()

    def command_line(self) -> list[str]:
        """The full ``kvstore serve`` argument vector for the current ports."""
        return [
            sys.executable, "-m", "kvstore.cli", "serve",
            "--host", self.host, "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--log-format", "json", *self.args,
        ]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KVNode:
        """Start the node (on the same ports as before, if it ran already) and wait until it is SERVING.

        Returns:
            ``self``.

        Raises:
            RuntimeError: if it exits, logs no ``serving`` line, or is not SERVING within ``startup_timeout_s``.
        """
        if self.is_running:
            return self
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            proc = spawn(
                self.command_line(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(REPO_ROOT), preexec_fn=self._limit_file_size if self.file_size_limit_bytes else None,
            )
        self._proc = proc
        deadline = time.monotonic() + self.startup_timeout_s
        serving = self._wait_serving_line(deadline)
        self.port = int(serving["port"])
        self.metrics_port = int(serving.get("metrics_port", -1))
        self._wait_healthy(deadline)
        self.num_starts += 1
        return self

    def _limit_file_size(self) -> None:
        """In the child: writes past ``file_size_limit_bytes`` fail with EFBIG, as on a full disk (``setrlimit(2)``)."""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the first such write kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_limit_bytes, self.file_size_limit_bytes))

    def _wait_serving_line(self, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline:
            for record in self.log_records(since_start=True):
                if record.get("event") == "serving":
                    return record
            if self._proc is not None and self._proc.poll() is not None:
                self._forget()
                raise RuntimeError(f"kvstore serve exited ({self.returncode}):\n{self.log_tail()}")
            time.sleep(0.05)  # polling the node's log for its "serving" line: another process
        self.kill()
        raise RuntimeError(f"kvstore serve logged no 'serving' line in time:\n{self.log_tail()}")

    def _wait_healthy(self, deadline: float) -> None:
        from kvstore.client import KVStoreClient
        from kvstore.errors import KVStoreError

        with KVStoreClient(self.target, timeout_s=2.0, retries=0, **self.client_kwargs) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(KVStoreError):
                    if client.health() == "SERVING":
                        return
                if not self.is_running:
                    break
                time.sleep(0.05)  # polling the node's health: another process
        self.kill()
        raise RuntimeError(f"kvstore serve on {self.target} did not report SERVING:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Shut down gracefully (SIGTERM) and wait; returns the exit status (``None`` if not started)."""
        return self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> int | None:
        """Kill at once (SIGKILL), like a crash, and wait; returns the exit status."""
        return self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout_s: float) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._forget()
        return proc.returncode

    def _forget(self) -> None:
        if self._proc is not None:
            forget(self._proc)

    def restart(self) -> KVNode:
        """Stop gracefully (SIGTERM) and start again on the same ports with the same arguments."""
        self.stop()
        return self.start()

    # ------------------------------------------------------------------ logs

    def log_records(self, *, since_start: bool = False) -> list[dict[str, Any]]:
        """The JSON log lines written so far (non-JSON lines are skipped).

        Args:
            since_start: only the lines of the current (last) start.
        """
        try:
            with open(self.log_path, "rb") as log:
                if since_start:
                    log.seek(self._log_offset)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records




    def __repr__(self) -> str:
        return f"KVNode(port={self.port}, running={self.is_running})"
