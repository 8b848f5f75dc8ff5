"""bench_peers' systems under test, the common part: the payload, the driver interface, and the plain baselines.

A driver is one system as its users would call it from one process: it stores
the payload's blocks once (:meth:`Driver.setup`), then answers timed Gets and
Puts. The worker (``worker.py``) times each call and checks each answer; a
driver only calls its system. Every driver gets the same bytes (a file the
orchestrator writes) and Gets into a tensor it allocated before timing starts
(:meth:`Driver.allocate`, which a system whose zero-copy calls need registered
or pooled memory overrides), as a caller owning its destination would.

This module needs only torch and numpy, so it imports in every peer's venv.
The baselines here: ``copy_`` (one ``Tensor.copy_`` of the same bytes, the
unit of every figure), a raw socket (``recv_into`` of the same bytes from
another process, issue 40's floor for a loopback transfer) and Redis
(pipelined GET / SET through redis-py with hiredis, plus the copy into the
caller's tensor).
"""

from __future__ import annotations

import math
import socket
import struct
import time
from typing import Any

import numpy as np
import torch

KIND_BLOCKS = {"prefix": 96, "block": 1}
"""Blocks per payload kind: a 24 MiB prefix of 96 blocks, and a single 2 MiB block."""
KIND_SHAPES = {"prefix": (8, 2, 4, 16, 128), "block": (32, 2, 8, 16, 128)}
"""Each kind's block, float16 ``[num_layers, 2, num_kv_heads, block_size, head_dim]``: 256 KiB and 2 MiB."""
KINDS = tuple(KIND_BLOCKS)
DTYPE = torch.float16


def block_bytes(kind: str) -> int:
    """Bytes of one block of ``kind``."""
    return math.prod(KIND_SHAPES[kind]) * DTYPE.itemsize


def kind_bytes(kind: str) -> int:
    """Bytes of the whole payload of ``kind`` (24 MiB for ``prefix``, 2 MiB for ``block``)."""
    return KIND_BLOCKS[kind] * block_bytes(kind)


def payload_bytes() -> int:
    """Bytes of the payload file: every kind, one after the other in ``KINDS`` order."""
    return sum(kind_bytes(kind) for kind in KINDS)


def as_blocks(flat: torch.Tensor, kind: str) -> torch.Tensor:
    """A flat uint8 tensor of ``kind_bytes(kind)`` seen as ``[num_blocks, *block_shape]`` float16."""
    return flat.view(DTYPE).view(KIND_BLOCKS[kind], *KIND_SHAPES[kind])


class Payload:
    """The bytes every system stores and returns, read from the file the orchestrator wrote.

    Attributes:
        expected: per kind, ``[num_blocks, *block_shape]`` float16: what every Get must return.
    """

    def __init__(self, path: str) -> None:
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        if raw.numel() != payload_bytes():
            raise ValueError(f"payload {path}: {raw.numel()} bytes, expected {payload_bytes()}")
        self.expected: dict[str, torch.Tensor] = {}
        offset = 0
        for kind in KINDS:
            self.expected[kind] = as_blocks(raw[offset:offset + kind_bytes(kind)], kind)
            offset += kind_bytes(kind)


class Driver:
    """One system under test; subclasses implement :meth:`get`, :meth:`put`, :meth:`read_back` and :meth:`remove`.

    Buffers, per kind, each ``[num_blocks, *block_shape]`` float16 from :meth:`allocate`:
    ``src`` holds the payload (what Puts send and :meth:`setup` stores), ``dst`` is the
    caller's destination of timed Gets, ``scratch`` receives the untimed read-back of a Put.

    Args:
        payload: the bytes to store.
        settings: the orchestrator's settings for this system (addresses, sizes).
    """

    ops: tuple[str, ...] = ("get", "put")

    def __init__(self, payload: Payload, settings: dict[str, Any]) -> None:
        self.payload = payload
        self.settings = settings
        self.connect()
        self.src = {kind: self._buffer(kind) for kind in KINDS}
        self.dst = {kind: self._buffer(kind) for kind in KINDS}
        self.scratch = {kind: self._buffer(kind) for kind in KINDS}
        for kind in KINDS:
            self.src[kind].copy_(payload.expected[kind])

    def _buffer(self, kind: str) -> torch.Tensor:
        return as_blocks(self.allocate(kind_bytes(kind)), kind)

    # ------------------------------------------------------------------ what a system implements

    def connect(self) -> None:
        """Open the system (connect, set up clients); called before any buffer is allocated."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes`` that this process owns, for a source or destination."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def setup(self) -> None:
        """Store the payload under the Get keys (untimed)."""
        for kind in KINDS:
            self.put(kind, "get")

    def get(self, kind: str) -> Any:
        """Get the ``kind`` payload's blocks into ``self.dst[kind]`` (timed); returns the system's answer."""
        raise NotImplementedError

    def put(self, kind: str, tag: str) -> Any:
        """Store ``self.src[kind]``'s blocks under the keys of ``tag`` (timed); returns the system's answer."""
        raise NotImplementedError

    def read_back(self, kind: str, tag: str) -> None:
        """Get the blocks stored under ``tag`` into ``self.scratch[kind]`` (untimed)."""
        raise NotImplementedError

    def remove(self, kind: str, tag: str) -> None:
        """Delete the blocks stored under ``tag`` (untimed), so every Put stores into the same free room."""

    def check(self, op: str, kind: str, answer: Any) -> None:
        """Raise ``AssertionError`` if ``answer`` (what :meth:`get` or :meth:`put` returned) is not a full success."""

    def versions(self) -> dict[str, str]:
        """The versions that matter for this system (its packages)."""
        return {}

    def info(self) -> dict[str, Any]:
        """Facts worth recording about how the system ran (e.g. the path it took)."""
        return {}

    def close(self) -> None:
        """Release the system's resources."""

    # ------------------------------------------------------------------ helpers

    def keys(self, kind: str, tag: str) -> list[str]:
        """One key per block of ``kind`` under ``tag``: a fresh tag is a fresh set of keys."""
        return [f"{kind}-{tag}-{i}" for i in range(KIND_BLOCKS[kind])]


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"not installed"``."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


class CopyDriver(Driver):
    """The baseline: one ``Tensor.copy_`` of the same bytes into the same preallocated destination."""

    ops = ("get",)

    def setup(self) -> None:
        """Nothing to store."""

    def get(self, kind: str) -> Any:
        """``dst.copy_(src)``: one single-threaded copy of the whole payload of ``kind``."""
        return self.dst[kind].copy_(self.src[kind])

    def copy_gib(self) -> dict[str, float]:
        """CPU and wall seconds of single-threaded ``copy_`` calls of the prefix adding up to one GiB."""
        src, dst = self.src["prefix"], self.dst["prefix"]
        num_copies = max(1, round((1 << 30) / kind_bytes("prefix")))
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(num_copies):
            dst.copy_(src)
        cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
        scale = (1 << 30) / (num_copies * kind_bytes("prefix"))
        return {"cpu_s_per_gib": cpu_s * scale, "wall_s_per_gib": wall_s * scale}

    def versions(self) -> dict[str, str]:
        """torch's version."""
        return {"torch": torch.__version__}


# Raw socket: a request is op (1 byte: G, P or R), kind (1 byte: its index in KINDS), byte count (8 bytes, LE).
RAW_HEADER = struct.Struct("<ccQ")


class RawSocketDriver(Driver):
    """Issue 40's floor: the same bytes over one loopback TCP connection, ``recv_into`` straight into the tensor.

    Settings: ``port`` of ``rawsock.py`` (another process, which holds the Get
    bytes and keeps the last Put's). A Get is one request, then ``recv_into``
    the destination until full; a Put sends the source with ``sendall`` and
    waits for a one-byte acknowledgement sent once the bytes were received.
    """

    def connect(self) -> None:
        """Connect to the raw-socket server on loopback, with ``TCP_NODELAY``."""
        self.sock = socket.create_connection(("127.0.0.1", int(self.settings["port"])))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def setup(self) -> None:
        """The server loaded the payload itself."""

    def _recv_into(self, target: torch.Tensor) -> None:
        view = memoryview(target.view(torch.uint8).numpy()).cast("B")
        received = 0
        while received < len(view):
            n = self.sock.recv_into(view[received:])
            if n == 0:
                raise ConnectionError("raw-socket server closed the connection")
            received += n

    def get(self, kind: str) -> Any:
        """One request, then ``recv_into`` the destination."""
        self.sock.sendall(RAW_HEADER.pack(b"G", bytes([KINDS.index(kind)]), kind_bytes(kind)))
        self._recv_into(self.dst[kind])

    def put(self, kind: str, tag: str) -> Any:
        """The header and the source's bytes with ``sendall``, then the server's acknowledgement."""
        self.sock.sendall(RAW_HEADER.pack(b"P", bytes([KINDS.index(kind)]), kind_bytes(kind)))
        self.sock.sendall(memoryview(self.src[kind].view(torch.uint8).numpy()).cast("B"))
        return self.sock.recv(1)

    def check(self, op: str, kind: str, answer: Any) -> None:
        """A Put is acknowledged with one byte 1."""
        assert op == "get" or answer == b"\x01", f"raw socket put acknowledged {answer!r}"

    def read_back(self, kind: str, tag: str) -> None:
        """The server sends back what it received last for ``kind``."""
        self.sock.sendall(RAW_HEADER.pack(b"R", bytes([KINDS.index(kind)]), kind_bytes(kind)))
        self._recv_into(self.scratch[kind])

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


class RedisDriver(Driver):
    """Redis over loopback TCP: pipelined GET / SET (redis-py with hiredis), one key per block.

    Settings: ``port`` of the redis-server. A Get is one pipeline of GETs, then
    the copy of each reply into the caller's tensor (timed: Redis hands back
    ``bytes``); a Put is one pipeline of SETs from views of the source (no copy
    made here). Put keys are deleted after each read-back.
    """

    def connect(self) -> None:
        """A redis-py client on loopback; refuses to run without hiredis."""
        import redis

        if not redis.utils.HIREDIS_AVAILABLE:
            raise RuntimeError("hiredis is not installed: the Redis figures would not be Redis's best")
        self.redis = redis.Redis(host="127.0.0.1", port=int(self.settings["port"]), socket_timeout=120)

    def _values(self, keys: list[str]) -> list[bytes]:
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def _copy(self, values: list[bytes], target: torch.Tensor) -> None:
        blocks = target.view(torch.uint8).view(len(values), -1).numpy()
        for i, value in enumerate(values):
            np.copyto(blocks[i], np.frombuffer(value, dtype=np.uint8))

    def get(self, kind: str) -> Any:
        """GET every block in one pipeline, then copy each into the destination."""
        values = self._values(self.keys(kind, "get"))
        self._copy(values, self.dst[kind])
        return values

    def put(self, kind: str, tag: str) -> Any:
        """SET every block in one pipeline (no transaction), from memoryviews of the source."""
        blocks = self.src[kind].view(torch.uint8).view(KIND_BLOCKS[kind], -1).numpy()
        pipe = self.redis.pipeline(transaction=False)
        for key, block in zip(self.keys(kind, tag), blocks):
            pipe.set(key, memoryview(block))
        return pipe.execute()

    def check(self, op: str, kind: str, answer: Any) -> None:
        """Every GET found its key; every SET answered OK."""
        if op == "get":
            assert all(v is not None for v in answer), "redis: a key was missing"
        else:
            assert all(answer), f"redis: SET answered {answer}"

    def read_back(self, kind: str, tag: str) -> None:
        """GET the Put's keys and copy them into the scratch tensor."""
        self._copy(self._values(self.keys(kind, tag)), self.scratch[kind])

    def remove(self, kind: str, tag: str) -> None:
        """DEL the Put's keys."""
        self.redis.delete(*self.keys(kind, tag))

    def versions(self) -> dict[str, str]:
        """redis-py, hiredis, and the server's version."""
        return {"redis-py": package_version("redis"), "hiredis": package_version("hiredis"),
                "redis-server": str(self.redis.info("server").get("redis_version"))}

    def close(self) -> None:
        """Close the client."""
        self.redis.close()
