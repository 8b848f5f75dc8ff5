"""A node tells clients where it publishes its events (``Capabilities``), so a connector needs no extra setting."""

from __future__ import annotations

import pytest

from kvstore.client import KVStoreClient
from kvstore.events.discovery import EventStream, discover_events, reachable_address
from kvstore.events.subscriber import EventStreamError, EventSubscriber, TierView, wait_for
from kvstore.security import bearer_metadata
from tests.support.security import AUTH_TOKENS, TOKEN_A
from tests.support.server import ThreadedServer, encoded, kv_blocks, make_config, namespace

pytestmark = pytest.mark.slow


def test_a_node_offers_its_event_stream_and_a_client_follows_what_it_found() -> None:
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0", "events.topic": "kv-a"}))
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        stream = discover_events(server.target)
        assert stream == EventStream(publisher.endpoint, publisher.replay_endpoint, "kv-a")
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 3)
        view = TierView()
        with EventSubscriber(stream.endpoint, stream.replay_endpoint, topic=stream.topic) as sub, \
                KVStoreClient(server.target, retries=0) as kv:
            kv.put(ns, hashes, encoded(ns, tensors))
            assert wait_for(sub, view, lambda: len(view.blocks) == 3, 20)
        assert {h for _, h in view.blocks} == set(hashes)
    finally:
        server.stop()


def test_a_node_without_events_offers_none_and_a_node_with_auth_asks_for_the_token() -> None:
    server = ThreadedServer(make_config())
    try:
        assert discover_events(server.target) is None
    finally:
        server.stop()
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0", "security.auth_tokens": AUTH_TOKENS}))
    try:
        import grpc

        with pytest.raises(grpc.RpcError) as info:
            discover_events(server.target)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with pytest.raises(EventStreamError, match="bearer token"):  # the stream is authenticated too
            discover_events(server.target, metadata=bearer_metadata(TOKEN_A))
        stream = discover_events(server.target, token=TOKEN_A)
        assert stream is not None and stream.endpoint == server.server.events.publisher.endpoint  # type: ignore
        assert stream.token == TOKEN_A and TOKEN_A not in repr(stream)
    finally:
        server.stop()


def test_a_wildcard_address_is_reached_at_the_nodes_host() -> None:
    assert reachable_address("tcp://*:5557", "kv-0:50051") == "tcp://kv-0:5557"
    assert reachable_address("tcp://0.0.0.0:5558", "10.0.0.7:50051") == "tcp://10.0.0.7:5558"
    assert reachable_address("tcp://[::]:5557", "[fd00::1]:50051") == "tcp://[fd00::1]:5557"
    assert reachable_address("tcp://*:5557", "unix:/run/kvstore.sock") == "tcp://127.0.0.1:5557"
    assert reachable_address("tcp://127.0.0.1:5557", "kv-0:50051") == "tcp://127.0.0.1:5557"
    assert reachable_address("ipc:///run/kvstore/events", "kv-0:50051") == "ipc:///run/kvstore/events"
