"""A same-host session's control channels (kvstore.shm.client.control, kvstore.shm.node.control): round trips over
them, and what a broken, malformed, oversized or foreign use of them does: a clear error, the node healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.keys import hash_blocks
from kvstore.security import bearer_metadata
from kvstore.shm.client import control as control_module
from kvstore.shm.frames import GET_SHARED, LOOKUP, PUT_SHARED, REPLY_HEAD, pack_request, unpack_reply_head
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import namespace_to_pb
from tests.support.security import TOKEN_A, TOKEN_B, client_of, sha_namespace
from tests.support.server import ThreadedServer
from tests.support.shm import RawSession, assert_healthy, small_block
from tests.support.waiting import wait_until

A, B = bearer_metadata(TOKEN_A), bearer_metadata(TOKEN_B)
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


def session_ids(node: ThreadedServer) -> set[int]:
    """The ids of the node's open sessions, read on its loop (other tests' sessions may end meanwhile)."""
    async def ids() -> set[int]:
        return {session.session_id for session in node.server.shm.sessions}  # type: ignore[union-attr]

    return node.call(ids())


class ChannelSession(RawSession):
    """A raw session (as a hostile client opens one) that asks for ``channels`` control channels at its handoff
    (version 2): :attr:`channels` are its raw sockets."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...], channels: int = 2) -> None:
        from kvstore.shm.client.handoff import redeem_grant

        original = redeem_grant

        def with_channels(address: str, grant: bytes, timeout_s: float, *_: object) -> object:
            sizes, fds = original(address, grant, timeout_s, channels)
            self.channel_fds = fds[2:]
            return sizes, fds[:2]

        import tests.support.shm as support

        support.redeem_grant = with_channels  # type: ignore[assignment]
        try:
            super().__init__(target, metadata)
        finally:
            support.redeem_grant = original  # type: ignore[assignment]
        self.channels = [socket.socket(fileno=fd) for fd in self.channel_fds]

    def close(self) -> None:
        for sock in self.channels:
            sock.close()
        super().close()


def exchange(sock: socket.socket, frame: bytes) -> tuple[int, bytes]:
    """Send ``frame`` and read one reply: ``(code, body)``."""
    sock.settimeout(30)
    sock.sendall(frame)
    head = _recv(sock, REPLY_HEAD.size)
    nbytes, code = unpack_reply_head(head)
    return code, _recv(sock, nbytes)


def _recv(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        assert chunk, "the node closed the channel"
        data += chunk
    return data


def lookup_frame(namespace: pb.Namespace, hashes: list[bytes]) -> bytes:
    return pack_request(LOOKUP, pb.LookupRequest(namespace=namespace, block_hashes=hashes).SerializeToString(), None)


def test_lookup_get_and_put_go_over_the_sessions_channels(node: ThreadedServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: list[int] = []
    call = control_module.ControlChannels.call

    def counting(self, kind, *args):  # type: ignore[no-untyped-def]
        kinds.append(kind)
        return call(self, kind, *args)

    monkeypatch.setattr(control_module.ControlChannels, "call", counting)
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(64)))
    blocks = [small_block(i) for i in range(4)]
    with client_of(node, TOKEN_A) as client:
        assert client.put(ns, hashes, blocks) == 4
        assert client.lookup(ns, hashes).num_blocks == 4
        got = client.get_tensors(ns, hashes)
        assert all(torch.equal(g, b) for g, b in zip(got, blocks))
        into = [torch.empty_like(b) for b in blocks]
        assert client.get_into(ns, hashes, into) == 4
        assert all(torch.equal(g, b) for g, b in zip(into, blocks))
        assert [bytes(b) for b in client.get(ns, hashes)] == [encode_block(b) for b in blocks]
        session = client._links[0].current()  # type: ignore[union-attr]
        assert session is not None and session.control is not None and len(session.control) == 4
    assert kinds.count(PUT_SHARED) == 1 and kinds.count(LOOKUP) == 1 and kinds.count(GET_SHARED) == 3


def test_without_channels_the_same_calls_go_over_grpc(node: ThreadedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(control_module.CHANNELS_ENV, "0")
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(300, 332)))
    with client_of(node, TOKEN_A) as client:
        assert client.put(ns, hashes, [small_block(5), small_block(6)]) == 2
        assert client.lookup(ns, hashes).num_blocks == 2
        assert torch.equal(client.get_tensors(ns, hashes)[1], small_block(6))
        session = client._links[0].current()  # type: ignore[union-attr]
        assert session is not None and session.control is None


def test_a_malformed_head_is_answered_then_the_channel_closes(node: ThreadedServer) -> None:
    with ChannelSession(node.target, A) as raw:
        code, body = exchange(raw.channels[0], b"\x00\x00\x00\x00\x09" + bytes(11))  # kind 9
        assert code == INVALID and b"unknown kind 9" in body
        assert raw.channels[0].recv(1) == b""
        code, body = exchange(raw.channels[1], pack_request(LOOKUP, b"", None)[:5] + b"\x01" + bytes(10))
        assert code == INVALID and b"padding" in body
        assert raw.channels[1].recv(1) == b""
    assert_healthy(node)


def test_a_malformed_body_is_invalid_argument_and_the_channel_goes_on(node: ThreadedServer) -> None:
    ns = namespace_to_pb(sha_namespace("tenant-a"))
    with ChannelSession(node.target, A, channels=1) as raw:
        code, body = exchange(raw.channels[0], pack_request(GET_SHARED, b"\xff\xff\xff\xff garbage", None))
        assert code == INVALID, body
        code, body = exchange(raw.channels[0], lookup_frame(ns, [bytes(32)]))
        assert code == 0 and pb.LookupResponse.FromString(body).num_blocks == 0
    assert_healthy(node)


def test_an_oversized_request_is_refused_before_it_is_read(node: ThreadedServer) -> None:
    with ChannelSession(node.target, A, channels=1) as raw:
        head = pack_request(PUT_SHARED, b"", None)
        code, body = exchange(raw.channels[0], (1 << 31).to_bytes(4, "little") + head[4:])
        assert code == EXHAUSTED and b"over the node's limit" in body
        assert raw.channels[0].recv(1) == b""
    assert_healthy(node)


@pytest.mark.slow
def test_a_client_killed_mid_call_leaves_the_node_healthy(node: ThreadedServer, tmp_path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {os.getcwd()!r})
from tests.shm.test_control import ChannelSession, A
from kvstore.shm.frames import pack_request, PUT_SHARED
raw = ChannelSession({node.target!r}, A, channels=2)
frame = pack_request(PUT_SHARED, bytes(4000), None)
raw.channels[0].sendall(frame[:2000])  # half a frame
raw.channels[1].sendall(frame[:10])  # half a head
print("sent", raw.session_id, flush=True)
sys.stdin.read()
""")
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        sent, session_id = child.stdout.readline().split()  # type: ignore[union-attr]
        assert sent == b"sent"
        wait_until(lambda: int(session_id) in session_ids(node), 60, "the child's session to open")
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    wait_until(lambda: int(session_id) not in session_ids(node), 60, "the killed child's session to end")
    assert_healthy(node)


def test_a_session_channel_acts_only_as_its_tenant(node: ThreadedServer) -> None:
    a_ns, b_ns = namespace_to_pb(sha_namespace("tenant-a")), namespace_to_pb(sha_namespace("tenant-b"))
    with ChannelSession(node.target, A, channels=1) as a_raw, RawSession(node.target, B) as b_raw:
        # even in another's hands, A's channel carries A's token only: B's tenant is refused on it
        code, body = exchange(a_raw.channels[0], lookup_frame(b_ns, [bytes(32)]))
        assert code == DENIED, body
        # and B's session cannot be named on it
        request = pb.GetSharedRequest(namespace=a_ns, session_id=b_raw.session_id, block_hashes=[bytes(32)])
        code, body = exchange(a_raw.channels[0], pack_request(GET_SHARED, request.SerializeToString(), None))
        assert code == DENIED and b"another client" in body
        code, _ = exchange(a_raw.channels[0], lookup_frame(a_ns, [bytes(32)]))
        assert code == 0
    assert_healthy(node)


def test_a_sessions_end_closes_its_channels(node: ThreadedServer) -> None:
    raw = ChannelSession(node.target, A, channels=1)
    sock = raw.channels.pop()
    try:
        raw.close()
        sock.settimeout(30)
        assert sock.recv(1) == b""
    finally:
        sock.close()


def test_a_node_that_predates_the_channels_still_gives_the_segments(node: ThreadedServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.shm.client import link as link_module
    from kvstore.shm.handoff import NOT_A_HANDOFF, HandoffRefused

    real = link_module.redeem_grant
    asked: list[int] = []

    def old_node(address: str, grant: bytes, timeout_s: float, channels: int = 0) -> object:
        asked.append(channels)
        if channels:  # what a version 1 node answers to a version 2 request
            raise HandoffRefused(f"the node refused the grant: {NOT_A_HANDOFF}")
        return real(address, grant, timeout_s)

    monkeypatch.setattr(link_module, "redeem_grant", old_node)
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(400, 416)))
    with client_of(node, TOKEN_A) as client:
        assert client.put(ns, hashes, [small_block(7)]) == 1
        assert client.shared_memory() == ("attached",)
        assert client._links[0].current().control is None  # type: ignore[union-attr]
        assert torch.equal(client.get_tensors(ns, hashes)[0], small_block(7))
    assert asked == [control_module.DEFAULT_CHANNELS, 0]
