"""Real redis-server processes, a real Redis Cluster and a black-hole socket for tests and benchmarks.

Everything listens on free loopback ports and lives in temporary directories;
persistence is off (``--save '' --appendonly no``). Processes are killed when
their owner closes them, at interpreter exit, and (Linux) when the thread that
started them dies (``PR_SET_PDEATHSIG``), so a killed test run leaves nothing behind.

Plain use::

    with RedisProcess() as server:          # started on a free port
        ...server.url...                     # redis://127.0.0.1:<port>/0
        server.kill()                        # SIGKILL, like a crash
        server.start()                       # again, on the same port

    with RedisClusterProcess(num_nodes=3) as cluster:
        ...cluster.url...                    # any one node; the client discovers the rest

As pytest fixtures, import them into a test module::

    from tests.support.redis import black_hole, redis_cluster, redis_server  # noqa: F401
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import redis

from tests.support.process import OwnedProcess, forget, free_port, spawn

logger = logging.getLogger(__name__)

DEFAULT_MAXMEMORY_BYTES = 256 << 20




def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A port ``P`` for a cluster node such that ``P`` and its cluster bus port ``P + 10000`` are free.

    Redis requires ``P <= 55535``; ``P`` is drawn from 10000-22767 so that both
    ports stay below Linux's default ephemeral range (32768-60999), where a
    client connection could take the bus port later.

    Raises:
        RuntimeError: if no such port is found after many tries.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, 22768)
        socks = []
        try:
            for candidate in (port, port + 10000):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, candidate))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_binaries() -> tuple[str, str] | None:
    """Paths of ``redis-server`` and ``redis-cli``, or ``None`` when either is not installed."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None




@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a throw-away CA, a server certificate for 127.0.0.1 and a client certificate.

    Attributes:
        ca_cert: CA certificate (what clients and the server trust).
        server_cert: server certificate, ``subjectAltName = IP:127.0.0.1``.
        server_key: server private key.
        client_cert: client certificate for mutual TLS.
        client_key: client private key.
    """

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_tls_files(directory: str | os.PathLike[str],
                   subject_alt_names: Sequence[str] = ("IP:127.0.0.1", "DNS:localhost")) -> TlsFiles:
    """Create a CA and server and client certificates (EC P-256, valid one day) with the ``openssl`` CLI.

    Args:
        directory: where the PEM files go (created if missing).
        subject_alt_names: the certificates' ``subjectAltName`` entries.

    Raises:
        RuntimeError: if ``openssl`` is missing or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "san.ext").write_text(f"subjectAltName={','.join(subject_alt_names)}\n")

    def run(*args: str) -> None:
        result = subprocess.run([openssl, *args], capture_output=True, check=False, cwd=d)
        if result.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.decode()}")

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvstore-test-ca")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN=kvstore-test-{who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{who}.crt", "-days", "1", "-extfile", "san.ext")
    return TlsFiles(*(str(d / name) for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


class RedisProcess(OwnedProcess):
    """One real ``redis-server`` on a loopback port, which can be stopped, killed and restarted there.

    Args:
        port: TCP port; ``None`` picks a free one (and retries on a race).
        maxmemory_bytes: ``maxmemory``, bytes; 0 for no limit.
        maxmemory_policy: e.g. ``allkeys-lru`` (the production advice) or
            ``noeviction`` (to provoke "OOM command not allowed").
        password: ``requirepass`` for the default user, empty for none.
        extra_args: more ``redis-server`` arguments, e.g. ``["--cluster-enabled", "yes"]``.
        tls: certificates for a second, TLS port (:attr:`tls_port`, clients must present
            a certificate signed by the CA); the plain port stays open for checks.
        workdir: directory for the log and ``dir``; a new temporary one when ``None``
            (removed by :meth:`close`).
        startup_timeout_s: seconds :meth:`start` waits for ``PING`` to answer.

    Raises:
        RuntimeError: from :meth:`start`, with the server's log tail, if it does
            not come up.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        port: int | None = None,
        maxmemory_bytes: int = DEFAULT_MAXMEMORY_BYTES,
        maxmemory_policy: str = "allkeys-lru",
        password: str = "",
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
        workdir: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        binaries = redis_binaries()
        if binaries is None:
            raise RuntimeError("redis-server and redis-cli must be installed")
        self._server_bin = binaries[0]
        self._own_port = port is None
        self.port = free_port() if port is None else port
        self.maxmemory_bytes = maxmemory_bytes
        self.maxmemory_policy = maxmemory_policy
        self.password = password
        self.extra_args = list(extra_args)
        self.tls = tls
        self.tls_port = free_port() if tls is not None else None
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstore-redis-")) if workdir is None else Path(workdir)
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """``rediss://[:password@]127.0.0.1:<tls_port>/0``.

        Raises:
            ValueError: if the server was made without ``tls``.
        """
        if self.tls_port is None:
            raise ValueError("this RedisProcess has no TLS port")
        auth = f":{self.password}@" if self.password else ""
        return f"rediss://{auth}{self.host}:{self.tls_port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / f"redis-{self.port}.log"

    @property
    def pid(self) -> int | None:
        """Process id while running, else ``None``."""
        return self._proc.pid if self.is_running else None

    @property
    def is_running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def command_line(self) -> list[str]:
        """The full ``redis-server`` argument vector for the current port."""
        args = [
            self._server_bin,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--maxmemory", str(self.maxmemory_bytes),
            "--maxmemory-policy", self.maxmemory_policy,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", self.tls.server_cert,
                "--tls-key-file", self.tls.server_key,
                "--tls-ca-cert-file", self.tls.ca_cert,
                "--tls-auth-clients", "yes",
            ]
        return args + self.extra_args

    def start(self) -> RedisProcess:
        """Start the server (on the same port as before, if it ran already) and wait for ``PING``.

        Returns:
            ``self``.

        Raises:
            RuntimeError: if it exits or does not answer within ``startup_timeout_s``.
        """
        if self.is_running:
            return self
        for attempt in range(5):
            try:
                self._spawn_and_wait()
                self._started_once = True
                return self
            except RuntimeError:
                # Only a port we picked ourselves, before the first start, may be
                # swapped for another (a restart must keep its port).
                if not self._own_port or self._started_once or attempt == 4:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        proc = spawn(self.command_line(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._proc = proc
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                forget(proc)
                raise RuntimeError(f"redis-server on port {self.port} exited ({proc.returncode}):\n{self.log_tail()}")
            if self.ping():
                return
            time.sleep(0.02)  # polling redis-server's port: another process
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{self.log_tail()}")

    def ping(self) -> bool:
        """Whether the server answers ``PING`` within one second (a fresh connection each time)."""
        try:
            with self.client(socket_timeout=1.0) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            return False

    def client(self, **kwargs: object) -> redis.Redis:
        """A synchronous redis-py client of this server, for assertions; the caller closes it."""
        return redis.Redis(host=self.host, port=self.port, password=self.password or None,
                           socket_connect_timeout=1.0, **kwargs)  # type: ignore[arg-type]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut down gracefully (SIGTERM) and wait; no-op when not running."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Kill at once (SIGKILL), like a crash, and wait for the process to go; no-op when not running."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        forget(proc)

    def restart(self) -> RedisProcess:
        """Kill and start again on the same port (data is gone: persistence is off)."""
        self.kill()
        return self.start()




    def __repr__(self) -> str:
        return f"RedisProcess(port={self.port}, running={self.is_running})"


class RedisClusterProcess:
    """A real Redis Cluster of ``num_nodes`` primaries (no replicas) on loopback ports.

    Nodes are started with ``--cluster-enabled yes`` and joined with
    ``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes``; :meth:`start`
    returns once every node reports ``cluster_state:ok``. A node's
    ``nodes-<port>.conf`` survives :meth:`restart_node`, so it rejoins with its slots
    (and no data).

    Args:
        num_nodes: primaries, at least 3 (Redis' minimum for ``--cluster create``).
        maxmemory_bytes: ``maxmemory`` of each node, bytes.
        maxmemory_policy: eviction policy of each node.
        node_timeout_ms: ``cluster-node-timeout``, milliseconds.
        startup_timeout_s: seconds to wait for ``cluster_state:ok``.
    """

    def __init__(
        self,
        num_nodes: int = 3,
        *,
        maxmemory_bytes: int = DEFAULT_MAXMEMORY_BYTES,
        maxmemory_policy: str = "allkeys-lru",
        node_timeout_ms: int = 2000,
        startup_timeout_s: float = 30.0,
    ) -> None:
        if num_nodes < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got {num_nodes}")
        binaries = redis_binaries()
        if binaries is None:
            raise RuntimeError("redis-server and redis-cli must be installed")
        self._cli_bin = binaries[1]
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstore-redis-cluster-"))
        self.startup_timeout_s = startup_timeout_s
        self.nodes: list[RedisProcess] = []
        for _ in range(num_nodes):
            port = free_cluster_port()
            self.nodes.append(RedisProcess(
                port=port, maxmemory_bytes=maxmemory_bytes, maxmemory_policy=maxmemory_policy,
                workdir=self.workdir,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                    "--cluster-node-timeout", str(node_timeout_ms),
                ],
            ))

    @property
    def url(self) -> str:
        """URL of the first node; a cluster client discovers the others from it."""
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        """The nodes' ports, in order."""
        return [node.port for node in self.nodes]

    def start(self) -> RedisClusterProcess:
        """Start every node, create the cluster (first time only) and wait for ``cluster_state:ok``.

        Raises:
            RuntimeError: if a node fails to start, ``--cluster create`` fails, or
                the cluster is not ok within ``startup_timeout_s``.
        """
        for node in self.nodes:
            node.start()
        if not self._slots_assigned():
            addrs = [f"{node.host}:{node.port}" for node in self.nodes]
            result = subprocess.run(
                [self._cli_bin, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, timeout=self.startup_timeout_s, check=False,
            )
            if result.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{result.stdout.decode()}{result.stderr.decode()}")
        self.wait_ok()
        return self

    def _slots_assigned(self) -> bool:
        info = self._cluster_info(self.nodes[0])
        return info.get("cluster_slots_assigned") == "16384"

    @staticmethod
    def _cluster_info(node: RedisProcess) -> dict[str, str]:
        try:
            with node.client(socket_timeout=1.0) as client:
                text = client.execute_command("CLUSTER", "INFO")
        except (redis.RedisError, OSError):
            return {}
        if isinstance(text, bytes):
            text = text.decode()
        if isinstance(text, dict):  # some redis-py versions parse it
            return {str(k): str(v) for k, v in text.items()}
        return dict(line.split(":", 1) for line in str(text).split() if ":" in line)

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Wait until every running node reports ``cluster_state:ok`` with all 16384 slots ok.

        Raises:
            RuntimeError: after ``timeout_s`` (default ``startup_timeout_s``).
        """
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            infos = [self._cluster_info(node) for node in self.nodes if node.is_running]
            if infos and all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos):
                return
            time.sleep(0.1)  # polling CLUSTER INFO: the nodes agree on their own time
        raise RuntimeError(f"cluster on ports {self.ports} not ok after waiting")

    def flushall(self) -> None:
        """``FLUSHALL`` on every running node."""
        for node in self.nodes:
            if node.is_running:
                with node.client(socket_timeout=5.0) as client:
                    client.flushall()

    def kill_node(self, index: int) -> None:
        """SIGKILL one node."""
        self.nodes[index].kill()

    def restart_node(self, index: int) -> None:
        """Start a killed node again on its port (it rejoins from its nodes.conf) and wait for the cluster."""
        self.nodes[index].start()
        self.wait_ok()

    def close(self) -> None:
        """Kill every node and remove the temporary directory."""
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcess:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisClusterProcess(ports={self.ports})"


class BlackHole:
    """A loopback TCP listener that accepts connections and never reads or replies.

    A client connected to it hangs on every reply: the target for timeout tests.
    Connections are held open until :meth:`close`.
    """

    host = "127.0.0.1"

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"black-hole-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def num_accepted(self) -> int:
        """Connections accepted so far."""
        return len(self._held)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        """Stop accepting and close every held connection."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        for conn in self._held:
            conn.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _require_redis() -> None:
    if redis_binaries() is None:
        pytest.skip("redis-server / redis-cli not installed")


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    """A fresh ``redis-server`` (256 MiB, ``allkeys-lru``) on a free port; killed after the test."""
    _require_redis()
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisClusterProcess]:
    """One 3-node Redis Cluster for the whole session (creating one takes about 2 s).

    Tests must not kill its nodes; use :class:`RedisClusterProcess` directly for
    fault tests. Use :func:`redis_cluster` for a flushed view of it.
    """
    _require_redis()
    with RedisClusterProcess(3) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(redis_cluster_session: RedisClusterProcess) -> RedisClusterProcess:
    """The session's 3-node Redis Cluster, flushed before the test and checked to be ok."""
    redis_cluster_session.wait_ok()
    redis_cluster_session.flushall()
    return redis_cluster_session


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    """A loopback listener that accepts and never replies; closed after the test."""
    with BlackHole() as hole:
        yield hole
