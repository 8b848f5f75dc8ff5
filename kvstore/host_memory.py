"""How much memory this process's host (or its container) has, and the warning for a memory tier larger than that.

A disk tier warns when its filesystem has less room than its capacity
(``kvstore.tiers.lmdb_records.prepare_directory``); a memory tier larger than the
memory the process may use would not evict before the kernel (or the container's
memory limit) kills the node, so the store warns at start the same way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""Where a container's memory limit is read: cgroup v2, then v1."""


def host_memory_bytes(limit_files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int | None:
    """The memory this process may use, bytes: the machine's RAM, or its cgroup's limit when that is lower;
    ``None`` where neither can be read.

    Args:
        limit_files: cgroup files holding a byte limit (``max``, or a huge number, means none).
    """
    try:
        physical: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = None
    limits = [physical] if physical else []
    for path in limit_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            limits.append(int(text))
    return min(limits) if limits else None


def warn_if_larger_than_memory(capacity_bytes: int, available_bytes: int | None = None) -> bool:
    """Log a warning when a memory tier of ``capacity_bytes`` exceeds the memory this process may use.

    Args:
        capacity_bytes: ``store.memory.capacity_bytes``.
        available_bytes: the memory to compare with; :func:`host_memory_bytes` when ``None``.

    Returns:
        Whether it warned.
    """
    available = host_memory_bytes() if available_bytes is None else available_bytes
    if available is None or capacity_bytes <= available:
        return False
    logger.warning(
        "memory tier: store.memory.capacity_bytes is %.1f GiB but this host (or its container) has %.1f GiB of "
        "memory: the node would run out of memory, and be killed, before the tier fills and starts to evict; lower "
        "--memory-capacity (store.memory.capacity_bytes, KVSTORE_MEMORY_CAPACITY) below that, leaving room for the "
        "process itself", capacity_bytes / 2**30, available / 2**30,
        extra={"fields": {"capacity_bytes": capacity_bytes, "available_bytes": available}},
    )
    return True
