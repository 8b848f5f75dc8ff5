"""The handoff socket: a grant is redeemed once for two descriptors; anything else gets none, and the node lives on."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvstore.shm.client.handoff import redeem_grant
from kvstore.shm.handoff import HandoffRefused
from kvstore.shm.node import handoff
from kvstore.shm.node.handoff import HandoffServer
from kvstore.shm.segment import Segment

GRANT = bytes(range(32))


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[HandoffServer, list[bytes], Segment]]:
    loop = LoopThread()
    segment = Segment.create("kvstore-test-handoff", 1 << 16)
    asked: list[bytes] = []

    def redeem(grant: bytes) -> tuple[tuple[int, int], list[int]] | None:
        asked.append(grant)
        if grant != GRANT or len(asked) > 1:  # valid once
            return None
        return (segment.nbytes, segment.nbytes), [segment.read_only_fd(), os.dup(segment.fd)]

    server = HandoffServer(str(tmp_path / "kv.sock.shm"), redeem)
    loop.run(server.start())
    yield server, asked, segment
    loop.run(server.close())
    loop.stop()
    segment.close()


def test_a_grant_is_redeemed_once_for_the_two_segments(served: tuple[HandoffServer, list[bytes], Segment]) -> None:
    server, asked, segment = served
    assert oct(os.stat(server.address).st_mode & 0o777) == "0o660"
    sizes, fds = redeem_grant(server.address, GRANT, 5.0)
    assert sizes == (segment.nbytes, segment.nbytes) and len(fds) == 2
    assert os.fstat(fds[0]).st_ino == os.fstat(segment.fd).st_ino
    for fd in fds:
        os.close(fd)
    with pytest.raises(HandoffRefused, match="grant"):
        redeem_grant(server.address, GRANT, 5.0)  # replayed


@pytest.mark.parametrize("request_bytes", [b"GET / HTTP/1.1\r\n\r\n" + bytes(40), b"KVSH\x03" + GRANT,
                                           b"KVSH\x02" + GRANT + b"\x11", b"\0" * 37])  # v2: 17 channels
def test_anything_but_a_handoff_request_is_refused(served: tuple[HandoffServer, list[bytes], Segment],
                                                   request_bytes: bytes) -> None:
    server, asked, _ = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(server.address)
        sock.sendall(request_bytes)
        data, fds, _, _ = socket.recv_fds(sock, 4096, 2)
    assert data[:1] == b"\x01" and fds == []
    assert asked == []  # never reached the grants
    sizes, fds = redeem_grant(server.address, GRANT, 5.0)  # and it still serves
    for fd in fds:
        os.close(fd)


def test_a_connection_that_sends_nothing_is_closed(served: tuple[HandoffServer, list[bytes], Segment],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server, _, _ = served
    monkeypatch.setattr(handoff, "REQUEST_TIMEOUT_S", 0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30.0)
        sock.connect(server.address)
        sock.sendall(b"KVSH")  # and then nothing
        assert sock.recv(1) == b""  # the node hung up


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a killed node leaves
    loop = LoopThread()
    try:
        first = HandoffServer(path, lambda grant: None)
        loop.run(first.start())
        with pytest.raises(OSError, match="listening"):
            loop.run(HandoffServer(path, lambda grant: None).start())
        loop.run(first.close())
        assert not os.path.exists(path)
    finally:
        loop.stop()


def test_an_unreachable_socket_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        redeem_grant(str(tmp_path / "nothing.sock"), GRANT, 1.0)
    with pytest.raises(OSError):
        redeem_grant("@kvstore-test-no-such-abstract-socket", GRANT, 1.0)
