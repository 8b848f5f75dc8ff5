"""``kvstore serve`` on a Unix socket: ``unix:`` targets, file permissions, no TCP port, stale and live socket files."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.server.app import KVStoreServer
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace


def test_a_node_listens_on_its_unix_socket_alone_and_serves_unix_targets(tmp_path: Path) -> None:
    path = tmp_path / "run" / "kvstore.sock"  # its directory is made
    server = ThreadedServer(make_config(**{"server.unix_socket": str(path), "server.port": -1}))
    try:
        assert server.target == f"unix://{path}" and server.server.port == 0
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660 and stat.S_ISSOCK(os.stat(path).st_mode)
        handoff = Path(server.server.shm.handoff_address)  # type: ignore[union-attr]
        assert handoff == path.with_name("kvstore.sock.shm")  # beside it: one shared directory carries both
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 2)
        for target in (f"unix://{path}", f"unix:{path}"):
            with KVStoreClient(target, retries=0) as client:
                client.put(ns, hashes, tensors)
                assert client.lookup(ns, hashes).num_blocks == 2
                assert all(torch.equal(a, b) for a, b in zip(client.get_tensors(ns, hashes), tensors))
                assert client.shared_memory() == ("attached",)
                assert client.health() == "SERVING"
    finally:
        server.stop()
    assert not path.exists() and not handoff.exists()


def test_a_stale_socket_file_is_replaced_and_a_live_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # what a killed node leaves behind
    first = ThreadedServer(make_config(**{"server.unix_socket": str(path)}))
    try:
        with KVStoreClient(first.server.unix_target, retries=0) as client:
            assert client.health() == "SERVING"
        with pytest.raises(OSError, match="listening"):
            asyncio.run(KVStoreServer(make_config(**{"server.unix_socket": str(path)})).start())
        with KVStoreClient(first.server.unix_target, retries=0) as client:  # the first one is untouched
            assert client.health() == "SERVING"
    finally:
        first.stop()


def test_a_path_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.sock"
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        asyncio.run(KVStoreServer(make_config(**{"server.unix_socket": str(path)})).start())
    assert path.read_text() == "not a socket"


def test_no_tcp_port_needs_a_unix_socket() -> None:
    with pytest.raises(ConfigError, match="server.port"):
        make_config(**{"server.port": -1})
