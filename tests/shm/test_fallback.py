"""A node the client cannot share memory with (off, on another host, older, unreachable) is used over gRPC, with
no error: the client learns which at connect time (Capabilities) and says why (``shared_memory()``)."""

from __future__ import annotations

import logging
from typing import Any, Iterator

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.server.servicer import KVStoreServicer
from kvstore.shm.client import link
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace, scrape


def round_trip(client: KVStoreClient) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    assert client.put(ns, hashes, tensors) == 3
    into = [torch.empty_like(t) for t in tensors]
    assert client.get_into(ns, hashes, into) == 3
    assert all(torch.equal(a, b) for a, b in zip(into, tensors))
    assert all(torch.equal(a, b) for a, b in zip(client.get_tensors(ns, hashes), tensors))
    with client.read(ns, hashes) as blocks:
        assert len(blocks) == 3


def shared_calls(server: ThreadedServer) -> float:
    samples = scrape(server)
    return sum(v for k, v in samples.items() if "kvstore_requests_total" in k and ("Shared" in k or "Attach" in k))


@pytest.fixture()
def node(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    """A node of its own; ``indirect`` parametrization gives its config overrides."""
    server = ThreadedServer(make_config(**getattr(request, "param", {})))
    yield server
    server.stop()


@pytest.mark.parametrize("node", [{"shared_memory.enabled": False}], indirect=True)
def test_a_node_that_offers_none_is_used_over_grpc(node: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvstore.shm.client.link"), KVStoreClient(node.target, retries=0) as client:
        round_trip(client)
        round_trip(client)
        assert client.shared_memory() == ("the node offers none",)
    assert shared_calls(node) == 0
    assert [r.levelno for r in caplog.records if "no same-host data plane" in r.getMessage()] == [logging.INFO]


def test_a_node_on_another_host_is_used_over_grpc(node: ThreadedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "host_id", lambda: "boot-id-of-another-host")
    with KVStoreClient(node.target, retries=0) as client:
        round_trip(client)
        assert client.shared_memory() == ("the node is on another host",)
    assert node.server.shm.counters()["sessions_opened"] == 0  # type: ignore[union-attr]


def test_a_node_older_than_the_data_plane_is_used_over_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    async def unimplemented(self: Any, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(KVStoreServicer, "Capabilities", unimplemented)
    server = ThreadedServer(make_config())
    try:
        with KVStoreClient(server.target, retries=0) as client:
            round_trip(client)
            assert client.shared_memory() == ("the node predates the same-host data plane",)
    finally:
        server.stop()


def test_a_handoff_socket_out_of_reach_is_used_over_grpc_and_tried_again_later(node: ThreadedServer) -> None:
    real = node.server.shm.handoff_address  # type: ignore[union-attr]
    node.server.shm.handoff_address = "/nonexistent/kvstore.sock.shm"  # type: ignore[union-attr]  # another mount
    with KVStoreClient(node.target, retries=0) as client:
        round_trip(client)
        (state,) = client.shared_memory()
        assert state.startswith("FileNotFoundError")
        node.server.shm.handoff_address = real  # type: ignore[union-attr]
        client._links[0]._retry_at = 0.0  # type: ignore[union-attr]  # the retry's pause, skipped
        round_trip(client)
        assert client.shared_memory() == ("attached",)
    sessions = node.server.shm.counters()  # type: ignore[union-attr]
    assert sessions["grants_redeemed"] == 1  # the first session's grant was never redeemed; it lapses


@pytest.mark.slow
def test_the_client_can_be_told_to_use_grpc(node: ThreadedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with KVStoreClient(node.target, retries=0, shared_memory=False, bulk=False) as client:
        round_trip(client)
        assert client.shared_memory() == ("off",)
    monkeypatch.setenv("KVSTORE_SHARED_MEMORY", "0")
    with KVStoreClient(node.target, retries=0) as client:
        round_trip(client)
        assert client.shared_memory() == ("off",)
    assert shared_calls(node) == 0


def test_a_node_that_stops_offering_it_is_used_over_grpc_without_an_error(node: ThreadedServer) -> None:
    with KVStoreClient(node.target, retries=0) as client:
        round_trip(client)
        assert client.shared_memory() == ("attached",)
        node.server.service.same_host.offering = False  # type: ignore[union-attr]  # it stops offering the path
        round_trip(client)  # FAILED_PRECONDITION: the client re-attaches, learns there is none, uses gRPC
        assert client.shared_memory() == ("the node offers none",)
