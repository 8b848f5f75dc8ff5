"""Child processes for tests: started without running Python between fork and exec, killed with their parent.

``preexec_fn`` would make ``subprocess`` fork and run Python (and gRPC's fork
handlers) in the child, which can hang when another thread is inside a gRPC
call. Instead the command runs under util-linux's ``setpriv --pdeathsig KILL``,
which asks the kernel to kill the child when the thread that started it dies,
and ``subprocess`` is free to use vfork. Every child is also killed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Sequence

_LIVE: set[subprocess.Popen[bytes]] = set()
_SETPRIV = shutil.which("setpriv")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the kernel picks it).

    Another process may take it before it is used; callers that chose the port
    themselves retry on a fresh one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def spawn(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` (``subprocess.Popen`` keyword arguments pass through) as a tracked child."""
    prefix = [_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []
    proc = subprocess.Popen([*prefix, *argv], **kwargs)
    _LIVE.add(proc)
    return proc


def forget(proc: subprocess.Popen[bytes]) -> None:
    """Stop tracking a child that has exited."""
    _LIVE.discard(proc)


class OwnedProcess:
    """What a test-owned server (redis-server, ``kvstore serve``) shares: log tail, close, context manager.

    A subclass sets ``workdir``, ``log_path`` and ``_own_dir`` and defines ``start`` and ``kill``.
    """

    workdir: Path
    log_path: Path
    _own_dir: bool

    def start(self) -> Any:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def kill(self) -> None:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def log_tail(self, num_lines: int = 30) -> str:
        """The last lines of the process's log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Kill the process and remove its temporary directory."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        _LIVE.discard(proc)


atexit.register(_kill_leftovers)
