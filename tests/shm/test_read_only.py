"""Get segments are read-only to every process but the node's own mapping: what a process of the node's uid
(root included) can and cannot do to one (``docs/shared-memory.md``, issue 32 item 7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvstore.keys import hash_blocks
from kvstore.security import bearer_metadata
from kvstore.shm.segment import READ_ONLY, Segment
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import namespace_to_pb
from tests.support.security import TOKEN_A, auth_config, client_of, sha_namespace
from tests.support.server import ThreadedServer
from tests.support.shm import RawSession

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")

# Reopens each path read-write, as any process of the owner's uid may try (making it writable first, as the
# owner may), then writes through the descriptor and through a writable mapping; prints what happened.
PROBE = """
import mmap, os, sys
for path in sys.argv[1:]:
    try:
        os.chmod(path, 0o600)
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        print("NO_OPEN", exc.errno); continue
    try:
        os.pwrite(fd, b"spoiled", 0); print("WROTE")
    except OSError as exc:
        print("NO_WRITE", exc.errno)
    try:
        m = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m[:7] = b"spoiled"; print("MAPPED")
    except OSError as exc:
        print("NO_MAP", exc.errno)
"""


def _probe(paths: list[str], *prefix: str) -> list[str]:
    result = subprocess.run([*prefix, sys.executable, "-c", PROBE, *paths], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_a_sealed_get_segment_cannot_be_written_by_another_process_of_the_same_uid_even_root() -> None:
    segment = Segment.create("kvstore-get-test", 1 << 16, read_only_to_others=True, seal_writes=True)
    try:
        assert segment.mode() == READ_ONLY and segment.sealed_writes
        segment.view[:4] = b"mine"  # the node's own mapping, made before the seal, still writes
        outcome = _probe([f"/proc/{os.getpid()}/fd/{segment.fd}"])
        assert outcome == ["NO_WRITE", "1", "NO_MAP", "1"]  # EPERM both ways, whatever the mode says
        assert bytes(segment.view[:7]) == b"mine\0\0\0"
    finally:
        segment.close()


def test_a_nodes_sealed_get_segments_cannot_be_written_through_the_node_or_the_client() -> None:
    node = ThreadedServer(auth_config(**{"shared_memory.seal_get_segments": True,
                                         "shared_memory.segment_bytes": 1 << 20}))
    A = bearer_metadata(TOKEN_A)
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(16)))
    block = torch.randn(2, 2, 2, 16, 64, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    try:
        with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
            client.put(ns, hashes, [block])
        with RawSession(node.target, A) as session:
            reply = session.stub.GetShared(pb.GetSharedRequest(
                namespace=namespace_to_pb(ns), session_id=session.session_id, block_hashes=hashes),
                timeout=30, metadata=A)
            assert reply.lease_id
            copy = bytes(session.get.view[reply.offsets[0]:reply.offsets[0] + reply.sizes[0]])
            name = f"/memfd:kvstore-get-{session.session_id:x} "  # this session's, not another test's
            paths = [f"/proc/{os.getpid()}/fd/{fd}" for fd in os.listdir("/proc/self/fd")
                     if _link(f"/proc/self/fd/{fd}").startswith(name)]
            assert len(paths) >= 2  # the node's descriptor and the client's (this test holds both)
            assert _probe(paths) == ["NO_WRITE", "1", "NO_MAP", "1"] * len(paths)
            assert bytes(session.get.view[reply.offsets[0]:reply.offsets[0] + reply.sizes[0]]) == copy
    finally:
        node.stop()


def test_an_unsealed_get_segment_is_mode_0400_so_a_non_root_process_of_its_uid_must_change_that_first() -> None:
    """The default (pages given back, so no seal): the mode stops a plain reopen for writing by a process of the
    node's uid that is not root; such a process, as the file's owner, can chmod it back first (the docs say so)."""
    script = """
import os, sys
sys.path.insert(0, sys.argv[1])
from kvstore.shm.segment import Segment
segment = Segment.create("kvstore-get-test", 1 << 16, read_only_to_others=True)
path = f"/proc/self/fd/{segment.fd}"
try:
    os.close(os.open(path, os.O_RDWR)); print("OPENED")
except OSError as exc:
    print("NO_OPEN", exc.errno)
print("RELEASED", segment.release(0, 1 << 16))
os.chmod(path, 0o600)
os.close(os.open(path, os.O_RDWR)); print("OPENED_AFTER_CHMOD")
"""
    prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []
    result = subprocess.run([*prefix, sys.executable, "-c", script, os.getcwd()], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["NO_OPEN", "13", "RELEASED", "True", "OPENED_AFTER_CHMOD"]


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
