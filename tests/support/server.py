"""Helpers of the service tests: a real in-process ``grpc.aio`` server on an ephemeral loopback port, and test blocks.

The server runs on its own event-loop thread (:class:`ThreadedServer`), so tests
drive it with the synchronous client as a connector would, and can run
coroutines on the store's loop with :meth:`ThreadedServer.call`.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from typing import Any, ClassVar, Coroutine, TypeVar

import torch

from kvstore.blocks.tensors import encode_block
from kvstore.config import Config, load_config
from kvstore.keys import Namespace, hash_blocks
from kvstore.server.app import KVStoreServer

_T = TypeVar("_T")

MiB = 1 << 20
SERVER_OVERRIDES: dict[str, Any] = {
    "server.host": "127.0.0.1",
    "server.port": 0,
    "server.metrics_port": 0,
    "server.grace_s": 1.0,
    "store.memory.capacity_bytes": 48 * MiB,
    "store.memory.page_bytes": 64 * 1024,
    "store.max_block_bytes": 20 * MiB,
    "limits.max_hashes_per_request": 64,
}


def make_config(**overrides: Any) -> Config:
    """The tests' server config (ephemeral ports, 48 MiB memory tier), with dotted ``overrides``."""
    merged = {**SERVER_OVERRIDES, **{k.replace("__", "."): v for k, v in overrides.items()}}
    return load_config(env={}, overrides=merged)


class ThreadedServer:
    """A :class:`KVStoreServer` running on a private event-loop thread.

    Args:
        config: the server configuration.

    Attributes:
        live: every server not stopped yet, in any test module; a test that must run in a process with no
            in-process server (a fork) stops what earlier tests left running.
    """

    live: ClassVar[set[ThreadedServer]] = set()

    def __init__(self, config: Config) -> None:
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-kvstore-server", daemon=True)
        self._thread.start()
        self.server = KVStoreServer(config)
        try:
            self.call(self.server.start())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            raise
        ThreadedServer.live.add(self)

    @property
    def target(self) -> str:
        """``127.0.0.1:<port>``."""
        return self.server.target

    def call(self, coro: Coroutine[Any, Any, _T], timeout_s: float = 60.0) -> _T:
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """Shut the server down in order and stop its loop thread; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        ThreadedServer.live.discard(self)
        try:
            self.call(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()


_COUNTER = iter(range(1 << 30))


def namespace(**fields: Any) -> Namespace:
    """A namespace of the tests; a distinct model per call so tests never share blocks."""
    fields.setdefault("model", f"test-model-{next(_COUNTER)}")
    fields.setdefault("dtype", "float16")
    fields.setdefault("block_size", 16)
    return Namespace(**fields)


def kv_blocks(ns: Namespace, num_blocks: int, *, num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 64,
              first_token: int = 0) -> tuple[list[bytes], list[torch.Tensor]]:
    """``num_blocks`` random ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` blocks and their hashes.

    Returns:
        ``(hashes, tensors)``.
    """
    tokens = list(range(first_token, first_token + num_blocks * ns.block_size))
    hashes = hash_blocks(ns, tokens)
    generator = torch.Generator().manual_seed(first_token + num_blocks)
    tensors = [
        torch.randn(num_layers, 2, num_kv_heads, ns.block_size, head_dim, generator=generator).to(torch.float16)
        for _ in range(num_blocks)
    ]
    return list(hashes), tensors


def encoded(ns: Namespace, tensors: list[torch.Tensor]) -> list[bytes]:
    """The tensors encoded with the namespace's layout."""
    return [encode_block(t, ns.layout) for t in tensors]


def scrape(server: ThreadedServer) -> dict[str, float]:
    """Every sample of the server's ``/metrics``, by name with its labels, e.g. ``'kvstore_tier_blocks{tier="memory"}'``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def finished_calls(server: ThreadedServer, method: str, expected: float, code: str = "OK",
                   timeout_s: float = 30.0) -> float:
    """``kvstore_requests_total{code, method}`` once it has reached ``expected`` (or after ``timeout_s``), calls.

    A call that succeeds is counted when gRPC is done sending its reply (see
    ``kvstore.server.call.GrpcCall._finish``), so a client can hold the reply
    before the node has counted it: wait for the count, then assert on it
    (a count past ``expected`` is returned as it is, for the assert to show).
    """
    name = f'kvstore_requests_total{{code="{code}",method="{method}"}}'
    deadline = time.monotonic() + timeout_s
    count = scrape(server).get(name, 0.0)
    while count < expected and time.monotonic() < deadline:
        time.sleep(0.02)  # polling /metrics: the count comes after the call's end, with nothing to wait on
        count = scrape(server).get(name, 0.0)
    return count
