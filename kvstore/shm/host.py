"""What both halves of the same-host data plane agree on about the host: its id, and where a node's handoff is."""

from __future__ import annotations

import uuid

BLOCK_ALIGNMENT = 64
"""Alignment of each block a session's segments hold, bytes: a cache line, and every dtype's item size."""

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``): the same for every process and container on
    one host, and different on any other host or after a reboot; ``""`` where it cannot be read."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def default_handoff_address(unix_socket: str) -> str:
    """The handoff socket of a node: beside its gRPC Unix socket (``<path>.shm``) when it has one, so that one shared
    directory carries both, else an abstract socket of a random name (no file to leave behind)."""
    if unix_socket:
        return unix_socket + ".shm"
    return f"@kvstore-shm-{uuid.uuid4().hex}"
