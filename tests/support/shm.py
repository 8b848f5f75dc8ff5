"""Helpers of the same-host data plane tests: counting a process's segments, and a raw session for hostile clients."""

from __future__ import annotations

import os
import queue
from typing import Any, Sequence

import grpc
import torch

from kvstore.keys import hash_blocks
from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.segment import Segment
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.support.security import TOKEN_A, client_of, sha_namespace
from tests.support.server import ThreadedServer



def small_block(seed: int) -> torch.Tensor:
    """A random fp16 block ``[2 layers, 2, 2 KV heads, 16 tokens, 64]`` (16 KiB), the same for the same ``seed``."""
    return torch.randn(2, 2, 2, 16, 64, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def assert_healthy(node: ThreadedServer) -> None:
    """Assert that ``node`` still serves tenant A (``tests.support.security``): health, put, get and lookup."""
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(16)))
    with client_of(node, TOKEN_A) as client:
        assert client.health() == "SERVING"
        client.put(ns, hashes, [small_block(99)])
        assert torch.equal(client.get_tensors(ns, hashes)[0], small_block(99))
        assert client.lookup(ns, hashes).num_blocks == 1


SEGMENT_NAMES = ("memfd:kvstore-get-", "memfd:kvstore-put-")


def segment_fds(pid: int | None = None) -> set[str]:
    """The segments a process holds a descriptor of (``/proc/<pid>/fd``; ``self`` when ``None``), by name.

    A name is ``memfd:kvstore-get-<session>`` or ``memfd:kvstore-put-<session>``; a
    segment counts once, however many descriptors of it there are (``mmap`` keeps one of its own).
    """
    base = f"/proc/{pid or 'self'}/fd"
    names = set()
    for fd in os.listdir(base):
        try:
            link = os.readlink(f"{base}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith(tuple(f"/{name}" for name in SEGMENT_NAMES)):
            names.add(link.split()[0].lstrip("/"))
    return names


def segment_maps(pid: int | None = None) -> set[str]:
    """The segments a process has mapped (``/proc/<pid>/maps``), by name."""
    with open(f"/proc/{pid or 'self'}/maps") as maps:
        return {part.lstrip("/") for line in maps for part in line.split()
                if part.lstrip("/").startswith(SEGMENT_NAMES)}


def open_segments(pid: int | None = None) -> set[str]:
    """Every segment a process holds, by a descriptor or a mapping: what must be empty once its sessions ended."""
    return segment_fds(pid) | segment_maps(pid)


def shm_files() -> set[str]:
    """What ``/dev/shm`` holds (the data plane leaves nothing there)."""
    return set(os.listdir("/dev/shm"))


class RawSession:
    """A session opened by hand, as a hostile client would: the Attach stream, the handoff, both segments mapped.

    The put segment is mapped read-write (as any client's); the get segment comes read-only.

    Args:
        target: the node.
        metadata: call metadata (a bearer token).
    """

    def __init__(self, target: str, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.metadata = tuple(metadata)
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.KVStoreStub(self.channel)
        offer = self.stub.Capabilities(pb.CapabilitiesRequest(), timeout=10, metadata=self.metadata).shared_memory
        self.handoff_socket = offer.handoff_socket
        self.releases: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call = self.stub.Attach(iter(self.releases.get, None), metadata=self.metadata)
        self.reply: pb.AttachReply = next(self.call)
        self.session_id = self.reply.session_id
        (get_bytes, put_bytes), (get_fd, put_fd) = redeem_grant(self.handoff_socket, self.reply.grant, 10.0)
        self.get_fd, self.put_fd = get_fd, put_fd
        self.get = Segment.attach(os.dup(get_fd), get_bytes, writable=False)
        self.put = Segment.attach(os.dup(put_fd), put_bytes, writable=True)

    def close(self) -> None:
        self.releases.put(None)
        self.call.cancel()
        self.channel.close()
        for fd in (self.get_fd, self.put_fd):
            os.close(fd)
        self.get.close()
        self.put.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
