"""The synchronous client in a forked child: it opens its own channel there and leaves the parent's alone.

These tests have a module of their own so that the process that forks hosts no
in-process gRPC server (``tests.support.server.ThreadedServer``, which the other
client tests share for a whole module): gRPC's fork handlers run only when no
other thread of the process is inside gRPC at the fork (``fork_posix.cc``:
"Other threads are currently calling into gRPC, skipping fork() handlers"), and
a server's polling threads often are, which left the child with a gRPC mutex
held by a thread it does not have (an abort). The node is a separate process.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from typing import Callable, Iterator

import pytest

from kvstore.client import KVStoreClient
from tests.support.kvnode import KVNode
from tests.support.server import ThreadedServer, kv_blocks, namespace
from tests.support.waiting import wait_until


@pytest.fixture(autouse=True)
def no_in_process_server() -> None:
    """Stop the in-process servers other test modules left running, so that this process hosts none when it forks,
    and let gRPC's asyncio poller go: its thread polls inside gRPC core while any ``grpc.aio`` channel or server
    of an earlier module is still alive, which makes gRPC skip its fork handlers as the session's stream did."""
    for server in list(ThreadedServer.live):
        server.stop()
    gc.collect()  # the aio objects earlier modules dropped: gRPC's asyncio stack shuts down with the last of them
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.endswith("(_poll_wrapper)")], 30,
               "gRPC's asyncio poller thread gone (an earlier module keeps a grpc.aio channel or server alive)")


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    """A separate server process, so that forking this test process forks no server."""
    with KVNode(memory_capacity="32MiB", metrics=False) as kv_node:
        yield kv_node


def _in_child(work: Callable[[], bytes], *, use_multiprocessing: bool) -> bytes:
    """Run ``work`` in a forked child and return what it reported; fail (not hang) if the child hangs."""
    read_fd, write_fd = os.pipe()

    def child() -> None:
        os.close(read_fd)
        try:
            result = work()
        except BaseException as exc:  # reported to the parent
            result = f"error {type(exc).__name__}: {exc}".encode()
        os.write(write_fd, result)
        os.close(write_fd)

    if use_multiprocessing:
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        os.close(write_fd)
        process.join(60)
        hung = process.is_alive()
        if hung:
            process.kill()
            process.join()
    else:
        pid = os.fork()
        if pid == 0:  # the child
            try:
                child()
            finally:
                os._exit(0)
        os.close(write_fd)
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the child's exit: os.waitpid takes no timeout
        hung = time.monotonic() >= deadline
        if hung:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as reader:
        report = reader.read()
    assert not hung, "the forked child hung"
    return report


@pytest.mark.slow
# Issue 32 item 8: the parent's same-host session keeps its Attach stream in flight, and gRPC's thread polling it
# made gRPC skip its fork handlers; the child then aborted in gRPC's poller about one run in four. The client now
# ends its sessions before a fork (kvstore.shm.client.link.SharedMemoryLink.end_for_fork); no retries, no xfail.
@pytest.mark.parametrize("use_multiprocessing", [False, True], ids=["os.fork", "multiprocessing-fork"])
def test_sync_client_works_in_a_forked_child(node: KVNode, use_multiprocessing: bool) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    other_hashes, other_tensors = kv_blocks(ns, 2, first_token=50_000)
    assert not [t.name for t in threading.enumerate() if t.name == "test-kvstore-server"], \
        "an in-process gRPC server is running in the process that forks"
    with KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, tensors)
        kv.put(ns, other_hashes, other_tensors)
        assert kv.lookup(ns, hashes).num_blocks == 3  # the parent's channel is open before the fork
        assert kv.shared_memory() == ("attached",)  # and its same-host session, with its stream in flight

        def work() -> bytes:
            got = kv.get_tensors(ns, other_hashes)  # the inherited client, in the child
            equal = all(a.equal(b) for a, b in zip(got, other_tensors)) and len(got) == 2
            return b"ok" if equal and kv.lookup(ns, hashes).num_blocks == 3 else b"wrong"

        assert _in_child(work, use_multiprocessing=use_multiprocessing) == b"ok"
        got = kv.get_tensors(ns, hashes)  # the parent's channel still works, with its own replies
        assert len(got) == 3 and all(a.equal(b) for a, b in zip(got, tensors))


@pytest.mark.slow
def test_grpc_runs_its_fork_handlers_with_a_session_attached(node: KVNode, capfd: pytest.CaptureFixture[str]) -> None:
    """The cause of the child's abort, checked at every fork, not one in fifty: gRPC skipped its handlers."""
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    with KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, tensors)
        assert kv.shared_memory() == ("attached",)
        capfd.readouterr()
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            assert "skipping fork() handlers" not in capfd.readouterr().err, [t.name for t in threading.enumerate()]
            got = kv.get_tensors(ns, hashes)  # the parent attaches a new session, and reads in it
            assert len(got) == 2 and all(a.equal(b) for a, b in zip(got, tensors))
            assert kv.shared_memory() == ("attached",)


@pytest.mark.slow
def test_forked_child_fails_clearly_when_grpc_fork_support_is_off(node: KVNode) -> None:
    with KVStoreClient(node.target) as kv:
        kv.health()

        def work() -> bytes:
            os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
            kv.health()
            return b"no error"

        report = _in_child(work, use_multiprocessing=False)
        assert report.startswith(b"error UnavailableError") and b"GRPC_ENABLE_FORK_SUPPORT" in report
        assert kv.health() == "SERVING"
