"""Unix-domain socket addresses: ``unix:`` gRPC targets, abstract names, and claiming a socket path at start."""

from __future__ import annotations

import errno
import os
import socket
import stat

ABSTRACT_PREFIX = "@"
"""How an abstract socket (Linux: no file; reachable within one network namespace) is written: ``@name``."""

SOCKET_MODE = 0o660
"""Mode of the socket files a node creates: its owner and group may connect (``connect(2)`` needs write access)."""


def sockaddr(address: str) -> str | bytes:
    """The ``bind``/``connect`` address of ``address``: a path, or ``@name`` for an abstract socket."""
    if address.startswith(ABSTRACT_PREFIX):
        return b"\0" + address[len(ABSTRACT_PREFIX):].encode()
    return address


def claim_socket_path(path: str) -> None:
    """Make ``path`` free for a new listening socket, removing a stale socket file a dead process left there.

    Args:
        path: a socket path (an abstract ``@name`` needs nothing).

    Raises:
        OSError: ``EADDRINUSE`` if a process is listening on it; ``EEXIST`` if
            the path is something other than a socket; or the error of making
            its directory.
    """
    if path.startswith(ABSTRACT_PREFIX):
        return
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: its listener is gone
        return
    except OSError:
        return  # e.g. EACCES: let bind report it
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process is listening on {path}")


def remove_socket_path(path: str, inode: int | None = None) -> None:
    """Remove a socket file this process made (if ``inode`` is given, only while the path still names that file)."""
    if path.startswith(ABSTRACT_PREFIX):
        return
    try:
        if inode is None or os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
