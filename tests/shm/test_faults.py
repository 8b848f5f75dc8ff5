"""Faults: a client killed while it reads or writes, and a node killed under its clients. The node stays healthy,
the leases end, and no segment is left anywhere (counted in /proc and /dev/shm)."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from tests.support.kvnode import REPO_ROOT, KVNode
from tests.support.process import forget, spawn
from tests.support.shm import open_segments, shm_files
from tests.support.shm_client import NAMESPACE, blocks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def shm_counts(node: KVNode) -> dict[str, float]:
    """The node's ``kvstore_shm_*`` samples, by name (``events`` by their event)."""
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r'^kvstore_shm_(\w+?)(?:_total)?(?:\{event="(\w+)"\})? (\S+)$', line)
        if match:
            samples[match.group(2) or match.group(1)] = float(match.group(3))
    return samples


@pytest.fixture()
def node(tmp_path: Path) -> Iterator[KVNode]:
    with KVNode(extra_args=["--unix-socket", str(tmp_path / "kvstore.sock")]) as started:
        yield started


def start_client(node: KVNode, mode: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = spawn([sys.executable, "-m", "tests.support.shm_client", node.target, mode], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, env=env, cwd=str(REPO_ROOT))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # the event: it holds, or writes
    assert line.split()[0] in ("HOLDING", "WRITING"), line
    return proc, line.split()[1]


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    forget(proc)


def assert_healthy(node: KVNode) -> None:
    with KVStoreClient(node.target, retries=0) as client:
        assert client.health() == "SERVING"
        hashes, tensors = blocks(0, 4)
        into = [torch.empty_like(t) for t in tensors]
        assert client.get_into(NAMESPACE, hashes, into) == 4
        assert all(torch.equal(a, b) for a, b in zip(into, tensors))


def test_a_client_killed_while_it_holds_a_lease_ends_its_session_and_leaves_no_segment(node: KVNode) -> None:
    before = shm_files()
    proc, session = start_client(node, "read")
    assert open_segments(node.pid) == {f"memfd:kvstore-get-{session}", f"memfd:kvstore-put-{session}"}
    counts = shm_counts(node)
    assert (counts["sessions"], counts["leases"]) == (1, 1)
    kill(proc)
    wait_until(lambda: shm_counts(node)["sessions"] == 0, 30, "the node ended the dead client's session")
    counts = shm_counts(node)
    assert counts["leases"] == 0 and counts["leased_bytes"] == 0 and counts["leases_ended_with_session"] == 1
    assert open_segments(node.pid) == set()
    assert shm_files() == before
    assert_healthy(node)


def test_a_client_killed_while_it_writes_leaves_the_node_healthy_and_no_segment(node: KVNode) -> None:
    proc, _ = start_client(node, "write")
    kill(proc)  # somewhere in a put: staging, in flight, or being copied by the node
    wait_until(lambda: shm_counts(node)["sessions"] == 0, 30, "the node ended the dead client's session")
    assert open_segments(node.pid) == set()
    assert_healthy(node)
    with KVStoreClient(node.target, retries=0) as client:  # what it stored is whole
        hashes, _ = blocks(64, 64)
        for tensor in client.get_tensors(NAMESPACE, hashes):  # checksums verified
            assert torch.all(tensor == tensor.flatten()[0])


def test_a_node_killed_under_its_client_leaves_nothing_and_the_client_attaches_to_its_successor(
        node: KVNode) -> None:
    before = shm_files()
    with KVStoreClient(node.target, retries=3, backoff_s=0.2) as client:
        hashes, tensors = blocks(0, 4)
        client.put(NAMESPACE, hashes, tensors)
        lease = client.read(NAMESPACE, hashes)
        old = client._links[0].current()
        assert old is not None
        pid = node.pid
        node.kill()
        assert shm_files() == before  # the node made nothing there; its memfds went with it
        assert not os.path.exists(f"/proc/{pid}/fd")
        assert [bytes(b) for b in lease.blocks] == [bytes(b) for b in lease.blocks]  # our mapping is still valid
        wait_until(lambda: not old.alive, 30, "the client saw its session end")
        node.start()
        client.put(NAMESPACE, hashes, tensors)  # a new session, on the new node
        into = [torch.empty_like(t) for t in tensors]
        assert client.get_into(NAMESPACE, hashes, into) == 4
        new = client._links[0].current()
        assert new is not None and new is not old
        lease.release()
        del lease, old
        gc.collect()  # the old session's mapping goes with its last reference, which a cycle may hold until collected
        assert open_segments() == {f"memfd:kvstore-get-{new.session_id:x}", f"memfd:kvstore-put-{new.session_id:x}"}
    assert shm_files() == before
