"""The node's process: tuning the allocator, torch's threads and the event loop, and its life from start to signal.

``kvstore serve`` runs :func:`run`: it configures logging, tunes the process
(:func:`tune_malloc`, :func:`limit_torch_threads`, :func:`event_loop_factory`)
and runs :func:`serve`, which starts a :class:`~kvstore.server.app.KVStoreServer`
and shuts it down in order on SIGTERM or SIGINT. The node itself is composed in
``kvstore.server.app``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
from typing import Callable

from kvstore.config import Config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.server.app import KVStoreServer
from kvstore.server.logs import LIFECYCLE_LOGGER, configure_logging

logger = logging.getLogger(__name__)
lifecycle = logging.getLogger(LIFECYCLE_LOGGER)


async def serve(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run a node until SIGTERM or SIGINT (or ``stop`` is set), then shut it down in order.

    A second SIGTERM or SIGINT during the shutdown cancels the calls still
    running (:meth:`KVStoreServer.cut_grace_short`) but never skips closing the
    store, so memory blocks are still demoted to disk; SIGKILL skips everything.

    Args:
        config: the whole configuration.
        stop: an extra event that ends serving when set (tests, embedding).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    server = KVStoreServer(config)
    hurries: set[asyncio.Task[None]] = set()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            return
        # a second signal during the shutdown cuts the grace short; the store is still closed
        hurry = loop.create_task(server.cut_grace_short())
        hurries.add(hurry)
        hurry.add_done_callback(hurries.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await server.start()
        await stop.wait()
        lifecycle.info("signal received")
    finally:
        try:
            await server.stop()  # the handlers stay: a repeated signal must not kill the node before its store closes
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


MALLOC_MMAP_THRESHOLD_BYTES = 256 << 20
MALLOC_TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def tune_malloc() -> bool:
    """Keep glibc from returning freed block buffers to the kernel, so the next ones reuse faulted pages.

    Every Get and Put allocates block-sized ``bytes`` (up to ``max_block_bytes``).
    By default glibc serves allocations over 128 KiB to 32 MiB with fresh
    ``mmap`` s and unmaps them on free, so each call page-faults its buffers in
    again; on a 2 MiB block that cost more than the copy itself
    (``benchmarks/bench_service.py``, ``benchmarks/bench_tiers.py``). This sets
    ``M_MMAP_THRESHOLD`` to 256 MiB and ``M_TRIM_THRESHOLD`` to 1 GiB (as
    ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824``):
    a node keeps up to 1 GiB of freed heap for reuse, which suits a dedicated
    cache process. Nothing is changed when ``GLIBC_TUNABLES`` already sets
    malloc options, or outside glibc.

    Returns:
        Whether both settings were applied.
    """
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES)
    )


def limit_torch_threads() -> None:
    """Run torch's CPU kernels on the calling thread only (``torch.set_num_threads(1)``).

    The memory tier moves blocks with ``Tensor.copy_``; with intra-op
    parallelism a 256 KiB copy waits for a thread pool, which on a busy host
    took 4 ms instead of 0.2 ms. A node's parallelism comes from concurrent
    calls and the tiers' worker threads instead. ``OMP_NUM_THREADS``, when set,
    is left to decide.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(1)


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The factory of the event loop named by ``server.event_loop``: ``uvloop``, ``asyncio`` or ``auto``.

    ``grpc.aio`` runs on any asyncio loop. uvloop (libuv, as in uvicorn) runs
    the loop's own work in C: a 256 KiB Get took 0.03-0.13 ms (2-7%) less in
    A/B runs of ``benchmarks/bench_service.py``'s node. ``auto`` takes it
    where it is installed (a dependency on Linux and macOS) and the standard
    loop elsewhere.

    Raises:
        ConfigError: if ``uvloop`` is asked for and is not installed.
    """
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ConfigError("server.event_loop", "'uvloop' is asked for but uvloop is not installed") from None
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(config: Config) -> int:
    """Configure logging from ``config.server`` and :func:`serve` until a signal; the exit status.

    Returns:
        0 after a clean shutdown, 1 if the server failed to start.
    """
    configure_logging(config.server.log_level, config.server.log_format)
    logger.debug("malloc tuned for block buffers: %s", tune_malloc())
    limit_torch_threads()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.server.event_loop)) as runner:
            runner.run(serve(config))
    except (KVStoreError, RuntimeError, OSError) as exc:  # a bad setting, a disk tier that cannot open, a port
        logger.error("cannot serve: %s", exc, extra={"fields": {"error": type(exc).__name__}})
        return 1
    return 0
