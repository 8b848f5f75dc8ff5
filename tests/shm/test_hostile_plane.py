"""Hostile same-host processes against a real ``kvstore serve`` node, round four (issues 38 and 39):

* a process of the node's uid that tries to write a stored block, through every descriptor and mapping it was
  given (slab descriptors arrive with GetShared replies), changes nothing a reader gets;
* control-channel frames that announce a body and never send it cost the node nothing, and end;
* a flood of idle connections on the handoff socket, from a process with no token, keeps no honest client off;
* a session's Put segment is out of reach of other processes once handed over (no descriptor left to reopen);
* a node short of file descriptors sizes its session caps to them, says so, and refuses more with a clear error.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import mmap
import os
import queue
import socket
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks
from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.frames import GET_SHARED, MAX_REPLY_DESCRIPTORS, PUT_SHARED, REPLY_HEAD, pack_request, \
    unpack_reply_head
from kvstore.shm.segment import Segment
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import namespace_to_pb
from tests.support.hostile import rss_bytes
from tests.support.kvnode import KVNode
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MiB = 1 << 20
NS = Namespace(model="tests/hostile-plane", dtype="float16", block_size=16)


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="256MiB") as running:
        yield running


def blocks(seed: int, count: int = 4) -> tuple[list[bytes], list[torch.Tensor]]:
    hashes = hash_blocks(NS, [seed * 100_000 + i for i in range(count * NS.block_size)])
    gen = torch.Generator().manual_seed(seed)
    return hashes, [torch.randn(2, 2, 2, 16, 64, generator=gen).half() for _ in range(count)]


class Channels:
    """A session opened by hand with control channels, as a hostile same-uid process would open one."""

    def __init__(self, target: str, num_channels: int = 1) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        stub = pb_grpc.KVStoreStub(self.channel)
        offer = stub.Capabilities(pb.CapabilitiesRequest(), timeout=10).shared_memory
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.call = stub.Attach(iter(self._requests.get, None))
        reply = next(self.call)
        self.session_id = reply.session_id
        sizes, fds = redeem_grant(offer.handoff_socket, reply.grant, 10.0, num_channels)
        self.fds = fds[:2]
        self.put = Segment.attach(os.dup(fds[1]), sizes[1], writable=True)
        self.socks = [socket.socket(fileno=fd) for fd in fds[2:]]

    def request(self, sock: socket.socket, kind: int, message: object) -> tuple[int, bytes, list[int]]:
        sock.settimeout(30)
        sock.sendall(pack_request(kind, message.SerializeToString(), None))  # type: ignore[attr-defined]
        data, fds, _, _ = socket.recv_fds(sock, REPLY_HEAD.size, MAX_REPLY_DESCRIPTORS)
        while len(data) < REPLY_HEAD.size:
            data += sock.recv(REPLY_HEAD.size - len(data))
        nbytes, code = unpack_reply_head(data)
        body = b""
        while len(body) < nbytes:
            body += sock.recv(nbytes - len(body))
        return code, body, fds

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.put.close()
        self._requests.put(None)
        self.call.cancel()
        self.channel.close()


def test_a_stored_block_cannot_be_written_through_anything_a_client_was_given(node: KVNode) -> None:
    hashes, tensors = blocks(1)
    with KVStoreClient(node.target, retries=0) as honest:
        assert honest.put(NS, hashes, tensors) == 4
    hostile = Channels(node.target)
    try:
        request = pb.GetSharedRequest(namespace=namespace_to_pb(NS), block_hashes=hashes,
                                      session_id=hostile.session_id, in_place=True)
        code, body, fds = hostile.request(hostile.socks[0], GET_SHARED, request)
        reply = pb.GetSharedResponse.FromString(body)
        assert code == 0 and fds and len(fds) == len(reply.new_slabs) and any(reply.slabs)
        for fd, offer in zip(fds, reply.new_slabs):
            # every way to write through the descriptor it was given fails, its owner's chmod and reopen too
            with pytest.raises(PermissionError):
                mmap.mmap(fd, offer.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.write(fd, b"hostile")
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
            with pytest.raises(OSError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # sealed against more seals too
            mapping = mmap.mmap(fd, offer.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with pytest.raises(OSError):
                mapping.madvise(mmap.MADV_REMOVE, 0, mmap.PAGESIZE)
            mapping.close()
            os.fchmod(fd, 0o600)
            writable = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(writable, b"hostile", 0)
                with pytest.raises(PermissionError):
                    mmap.mmap(writable, offer.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            finally:
                os.close(writable)
            os.close(fd)
        # and through its own put segment, after a put of the same blocks: nothing stored changes
        hostile.put.view[:] = b"\xff" * hostile.put.nbytes
        with KVStoreClient(node.target, retries=0) as reader:
            into = [torch.empty_like(t) for t in tensors]
            assert reader.get_into(NS, hashes, into) == 4
            assert all(torch.equal(a, b) for a, b in zip(into, tensors))
            with reader.read(NS, hashes) as views:
                assert reader.shared_memory() == ("attached",)
                before = [bytes(v) for v in views]
                assert all(bytes(v) == b for v, b in zip(views, before))  # under its lease, they hold still
    finally:
        hostile.close()


def test_half_frames_on_control_channels_cost_the_node_nothing_and_end(node: KVNode) -> None:
    assert node.pid is not None
    sessions = [Channels(node.target, num_channels=16) for _ in range(4)]
    try:
        socks = [sock for session in sessions for sock in session.socks][:58]
        baseline = rss_bytes(node.pid)
        head = pack_request(PUT_SHARED, b"", None)
        for sock in socks:  # each announces the largest body a node takes, and never sends it
            sock.sendall(array.array("I", [4 << 20]).tobytes() + head[4:])
        grown = rss_bytes(node.pid) - baseline
        assert grown < 64 * MiB, f"{grown / MiB:.0f} MiB for 58 half-frames"
        for sock in socks:  # the node answers the body that never came, and ends the channel
            sock.settimeout(60)
            data = sock.recv(REPLY_HEAD.size)
            assert unpack_reply_head(data[:REPLY_HEAD.size])[1] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            rest = b"x"
            while rest:
                rest = sock.recv(4096)
        assert rss_bytes(node.pid) - baseline < 64 * MiB
        with KVStoreClient(node.target, retries=0) as honest:  # and the node serves on
            hashes, tensors = blocks(2)
            assert honest.put(NS, hashes, tensors) == 4
            assert honest.shared_memory() == ("attached",)
    finally:
        for session in sessions:
            session.close()


def test_a_flood_of_idle_handoff_connections_keeps_no_honest_client_off(node: KVNode) -> None:
    with grpc.insecure_channel(node.target) as channel:
        address = pb_grpc.KVStoreStub(channel).Capabilities(pb.CapabilitiesRequest(), timeout=10) \
            .shared_memory.handoff_socket
    held: list[socket.socket] = []
    stop = threading.Event()

    def flood() -> None:  # no token, no request: connections held open, and new ones while the test runs
        while not stop.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(address if not address.startswith("@") else "\0" + address[1:])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                sock.close()
                continue
            held.append(sock)
            if len(held) > 600:
                held.pop(0).close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        wait_until(lambda: len(held) > 600, 60, "the flood holds 600 idle connections")
        for seed in range(3):
            with KVStoreClient(node.target, retries=0) as honest:
                hashes, tensors = blocks(10 + seed)
                assert honest.put(NS, hashes, tensors) == 4
                assert honest.shared_memory() == ("attached",)
    finally:
        stop.set()
        flooder.join()
        for sock in held:
            sock.close()


def test_a_put_segment_is_out_of_reach_once_handed_over(node: KVNode) -> None:
    hashes, tensors = blocks(3)
    with KVStoreClient(node.target, retries=0) as client:
        assert client.put(NS, hashes, tensors) == 4
        assert client.shared_memory() == ("attached",)
        for pid in (node.pid, os.getpid()):  # neither side holds a descriptor another process could reopen
            names = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in _fds(pid)}
            assert not [name for name in names if "kvstore-put-" in name], names


def _fds(pid: int | None) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            os.readlink(f"/proc/{pid}/fd/{fd}")
            found.append(fd)
    return found


class LimitedNode(KVNode):
    """A node started under ``prlimit --nofile=SOFT:HARD``."""

    def __init__(self, soft: int, hard: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.limits = f"{soft}:{hard}"

    def command_line(self) -> list[str]:
        return ["prlimit", f"--nofile={self.limits}", "--", *super().command_line()]


def test_the_node_raises_its_open_files_limit_to_the_hard_one() -> None:
    with LimitedNode(256, 4096, memory_capacity="16MiB") as limited:
        with open(f"/proc/{limited.pid}/limits") as limits:
            line = next(line for line in limits if line.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"]


def test_a_node_short_of_descriptors_caps_sessions_and_refuses_more_clearly(tmp_path: Path) -> None:
    with LimitedNode(800, 800, memory_capacity="16MiB") as limited:
        records = limited.log_records()
        lowered = [r for r in records if "lowered to" in json.dumps(r)]
        assert lowered, "the node says its session caps were lowered to its open-files limit"
        opened: list[Channels] = []
        try:
            with pytest.raises(grpc.RpcError) as refused:
                for _ in range(40):
                    opened.append(Channels(limited.target, num_channels=16))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert "max_sessions" in refused.value.details()  # type: ignore[attr-defined]
        finally:
            for session in opened:
                session.close()
        with KVStoreClient(limited.target, retries=0) as client:  # the node still serves, gRPC and same-host alike
            hashes, tensors = blocks(4)
            assert client.put(NS, hashes, tensors) == 4
            assert client.shared_memory() == ("attached",)

