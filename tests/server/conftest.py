"""Fixtures of the service tests: a real in-process server per module or per test (``tests/support/server.py``)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import grpc
import pytest

from kvstore.client import KVStoreClient
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.support.server import MiB, ThreadedServer, make_config


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    """One in-process server for a whole test module."""
    threaded = ThreadedServer(make_config())
    yield threaded
    threaded.stop()


@pytest.fixture()
def fresh_server(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    """A server of its own for one test; ``@pytest.mark.parametrize`` can't reach it, a marker can:
    ``@pytest.mark.server_config({"store.memory.capacity_bytes": ...})``."""
    marker = request.node.get_closest_marker("server_config")
    overrides: Mapping[str, Any] = marker.args[0] if marker else {}
    threaded = ThreadedServer(make_config(**overrides))
    yield threaded
    threaded.stop()


@pytest.fixture()
def client(server: ThreadedServer) -> Iterator[KVStoreClient]:
    """A synchronous client of the module's server (no retries, so failures show at once)."""
    with KVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        yield kv


@pytest.fixture()
def stub(server: ThreadedServer) -> Iterator[pb_grpc.KVStoreStub]:
    """A raw generated stub of the module's server, for sending malformed messages."""
    channel = grpc.insecure_channel(
        server.target,
        options=[("grpc.max_send_message_length", 4 * MiB), ("grpc.max_receive_message_length", 4 * MiB)],
    )
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server_config(overrides): dotted config overrides of fresh_server")
