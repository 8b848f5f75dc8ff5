"""A hostile same-host client: what it writes into its segments after (or during) a put, ranges outside them,
resizing them, other sessions, other tenants, replayed grants and other users. Stored blocks never change, and
the node stays healthy; the trust model of docs/shared-memory.md, tested."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import threading

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.keys import hash_blocks
from kvstore.security import bearer_metadata
from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.handoff import HandoffRefused
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import namespace_to_pb
from tests.support.security import TOKEN_A, TOKEN_B, client_of, sha_namespace
from tests.support.server import ThreadedServer, make_config
from tests.support.shm import RawSession, assert_healthy, small_block
from tests.support.waiting import wait_until

A, B = bearer_metadata(TOKEN_A), bearer_metadata(TOKEN_B)


def put_shared(session: RawSession, namespace: pb.Namespace, hashes: list[bytes], offsets: list[int],
               sizes: list[int], session_id: int | None = None) -> pb.PutResponse:
    return session.stub.PutShared(pb.PutSharedRequest(
        namespace=namespace, session_id=session.session_id if session_id is None else session_id,
        block_hashes=hashes, offsets=offsets, sizes=sizes), timeout=30, metadata=session.metadata)


def test_writing_into_the_put_segment_after_a_put_changes_nothing_stored(node: ThreadedServer) -> None:
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(16)))
    good = encode_block(small_block(1))
    with RawSession(node.target, A) as hostile:
        hostile.put.view[:len(good)] = good
        reply = put_shared(hostile, namespace_to_pb(ns), hashes, [0], [len(good)])
        assert reply.num_stored == 1
        hostile.put.view[:len(good)] = bytes(len(good))  # after the node's copy: its own memory, now
    with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
        assert [bytes(b) for b in client.get(ns, hashes)] == [good]


def test_writing_during_the_nodes_copy_spoils_at_most_that_put(node: ThreadedServer) -> None:
    ns = sha_namespace("tenant-a")
    stored_hashes = hash_blocks(ns, list(range(100, 116)))
    stored = encode_block(small_block(2))
    with client_of(node, TOKEN_A) as client:
        client.put(ns, stored_hashes, [stored])
    target = hash_blocks(ns, list(range(200, 216)))
    valid = encode_block(small_block(3))
    garbage = bytes(range(256)) * (len(valid) // 256 + 1)
    stop = threading.Event()
    with RawSession(node.target, A) as hostile:
        view = hostile.put.view

        def scribble() -> None:  # flips the staged range between the valid block and garbage, byte range by range
            i = 0
            while not stop.is_set():
                start = (i * 4096) % len(valid)
                end = min(start + 4096, len(valid))
                view[start:end] = (valid if i % 2 else garbage)[start:end]
                i += 1

        view[:len(valid)] = valid
        thread = threading.Thread(target=scribble)
        thread.start()
        outcomes = []
        try:
            for _ in range(40):
                for hashes in (target, stored_hashes):
                    try:
                        outcomes.append(put_shared(hostile, namespace_to_pb(ns), hashes, [0], [len(valid)]).num_stored)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
                        outcomes.append(exc.code())
        finally:
            stop.set()
            thread.join()
    assert grpc.StatusCode.INVALID_ARGUMENT in outcomes  # the node saw torn copies, and refused them
    with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
        assert [bytes(b) for b in client.get(ns, stored_hashes)] == [stored]  # never changed
        for got in client.get(ns, target):  # stored only if a copy validated: then it is the valid block
            assert bytes(got) == valid
    assert_healthy(node)


def test_the_segments_cannot_be_resized_resealed_or_the_get_segment_written(node: ThreadedServer) -> None:
    import fcntl

    with RawSession(node.target, A) as hostile:
        for fd in (hostile.put_fd, hostile.get_fd):
            with pytest.raises(OSError) as info:
                os.ftruncate(fd, 4096)  # a node mapping cut short would fault (SIGBUS)
            assert info.value.errno in (errno.EPERM, errno.EINVAL, errno.EBADF)
        with pytest.raises(PermissionError):
            fcntl.fcntl(hostile.put_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed against new seals
        with pytest.raises(PermissionError):
            mmap.mmap(hostile.get_fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError) as info:
            os.pwrite(hostile.get_fd, b"x", 0)
        assert info.value.errno == errno.EBADF
    assert_healthy(node)


@pytest.mark.parametrize("offsets, sizes", [
    ([1 << 62], [100]),  # past the end
    ([0], [0]),  # empty
    ([256 << 20], [1]),  # just past the end of a default segment
    ([(1 << 64) - 100], [200]),  # wraps around
    ([0, 0], [100]),  # mismatched counts
])
def test_ranges_outside_the_put_segment_are_refused(node: ThreadedServer, offsets: list[int],
                                                    sizes: list[int]) -> None:
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(16)))
    with RawSession(node.target, A) as hostile:
        with pytest.raises(grpc.RpcError) as info:
            put_shared(hostile, namespace_to_pb(ns), hashes * len(offsets[:1]), offsets, sizes)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_healthy(node)


def test_a_session_serves_only_the_principal_that_opened_it_and_only_its_tenants(node: ThreadedServer) -> None:
    ns_a, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-b")
    hashes_a = hash_blocks(ns_a, list(range(16)))
    with client_of(node, TOKEN_A) as client:
        client.put(ns_a, hashes_a, [small_block(4)])
    with RawSession(node.target, A) as session_a, RawSession(node.target, B) as tenant_b:
        for call in ("GetShared", "PutShared"):
            with pytest.raises(grpc.RpcError) as info:  # B names A's session
                if call == "GetShared":
                    tenant_b.stub.GetShared(pb.GetSharedRequest(namespace=namespace_to_pb(ns_b), block_hashes=[],
                                                                session_id=session_a.session_id),
                                            timeout=30, metadata=B)
                else:
                    put_shared(tenant_b, namespace_to_pb(ns_b), [], [], [], session_id=session_a.session_id)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # B, on its own session, asks for A's blocks
            tenant_b.stub.GetShared(pb.GetSharedRequest(namespace=namespace_to_pb(ns_a), block_hashes=hashes_a,
                                                        session_id=tenant_b.session_id), timeout=30, metadata=B)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:  # a session that does not exist
            tenant_b.stub.GetShared(pb.GetSharedRequest(namespace=namespace_to_pb(ns_b), block_hashes=[],
                                                        session_id=tenant_b.session_id ^ 0x5A5A), timeout=30,
                                    metadata=B)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        got = session_a.stub.GetShared(pb.GetSharedRequest(namespace=namespace_to_pb(ns_a), block_hashes=hashes_a,
                                                           session_id=session_a.session_id), timeout=30, metadata=A)
        before = node.server.shm.sessions.num_leases()  # type: ignore[union-attr]
        tenant_b.releases.put(pb.AttachRequest(release_lease_ids=[got.lease_id]))  # B releases A's lease
        tenant_b.releases.put(pb.AttachRequest(release_lease_ids=[]))
        session_a.releases.put(pb.AttachRequest(release_lease_ids=[got.lease_id]))  # A does: the one that counts
        wait_until(lambda: node.server.shm.sessions.num_leases() == before - 1, 30,  # type: ignore[union-attr]
                   "A's release, after B's, reached the node")
        assert node.server.shm.sessions.counts.leases_released >= 1  # type: ignore[union-attr]


def test_a_grant_is_good_once_and_attach_needs_a_token(node: ThreadedServer) -> None:
    with RawSession(node.target, A) as session_a:
        with pytest.raises(HandoffRefused):
            redeem_grant(session_a.handoff_socket, session_a.reply.grant, 10.0)  # replayed (by anyone)
        with pytest.raises(HandoffRefused):
            redeem_grant(session_a.handoff_socket, os.urandom(32), 10.0)  # guessed
    with pytest.raises(grpc.RpcError) as info:
        RawSession(node.target, ())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sessions_past_the_limit_are_refused_and_a_client_uses_grpc(node: ThreadedServer) -> None:
    open_now = len(node.server.shm.sessions)  # type: ignore[union-attr]
    sessions = [RawSession(node.target, B) for _ in range(8 - open_now)]
    try:
        with pytest.raises(grpc.RpcError) as info:
            RawSession(node.target, B)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ns = sha_namespace("tenant-a")
        hashes = hash_blocks(ns, list(range(16)))
        with client_of(node, TOKEN_A) as client:
            client.put(ns, hashes, [small_block(5)])
            assert torch.equal(client.get_tensors(ns, hashes)[0], small_block(5))
            assert client.shared_memory()[0].startswith("RESOURCE_EXHAUSTED: 8 same-host sessions are open")
    finally:
        for session in sessions:
            session.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a hostile process as another user")
def test_another_user_can_reach_neither_the_segments_nor_the_sockets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "kvstore.sock"
    os.chmod(tmp_path, 0o755)  # the directory is open: only the files' own modes stand in the way
    server = ThreadedServer(make_config(**{"server.unix_socket": str(path)}))
    try:
        with KVStoreClient(server.server.unix_target, retries=0) as client:
            ns = sha_namespace("")
            client.put(ns, hash_blocks(ns, list(range(16))), [small_block(6)])
            assert client.shared_memory() == ("attached",)
            fds = [f"/proc/{os.getpid()}/fd/{fd}" for fd in os.listdir("/proc/self/fd")
                   if _link(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-")]
            assert len(fds) >= 4  # this session's segments, as the node and as the client hold them
            probe = (
                "import os, socket, sys\n"
                "paths, sockets = sys.argv[1].split(','), sys.argv[2].split(',')\n"
                "for p in paths:\n"
                "    try:\n"
                "        os.close(os.open(p, os.O_RDONLY)); print('OPENED', p)\n"
                "    except OSError as e: print('REFUSED', e.errno)\n"
                "for p in sockets:\n"
                "    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n"
                "        s.connect(p); print('CONNECTED', p)\n"
                "    except OSError as e: print('REFUSED', e.errno)\n"
            )
            result = subprocess.run(
                ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", probe,
                 ",".join(fds), f"{path},{path}.shm"], capture_output=True, text=True, timeout=60)
            lines = result.stdout.split("\n")
            assert result.returncode == 0, result.stderr
            assert [line for line in lines if line] == [f"REFUSED {errno.EACCES}"] * (len(fds) + 2), result.stdout
    finally:
        server.stop()


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile (the listing's own descriptor)
        return ""
