"""Shared memory bounded and counted: sessions per tenant, leased bytes per tenant and per node, and the pages of
ended leases given back to the kernel (measured by the segments' ``st_blocks``, never by time)."""

from __future__ import annotations

import gc
import queue

import grpc
import pytest
import torch

from kvstore.keys import hash_blocks
from kvstore.security import bearer_metadata
from kvstore.shm.node.sessions import SessionTable
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import namespace_to_pb
from tests.support.security import TOKEN_A, TOKEN_B, auth_config, client_of, sha_namespace
from tests.support.server import ThreadedServer
from tests.support.shm import RawSession
from tests.support.waiting import wait_until

A, B = bearer_metadata(TOKEN_A), bearer_metadata(TOKEN_B)
PAGE = 4096
MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, **kwargs: object) -> SessionTable:
    settings = {"segment_bytes": 64 * PAGE, "max_sessions": 8, "lease_s": 10.0, "grant_s": 5.0, **kwargs}
    return SessionTable(clock=clock, **settings)  # type: ignore[arg-type]


def fill(session, lease) -> None:  # type: ignore[no-untyped-def]
    session.get_segment.view[lease.offset:lease.offset + lease.nbytes] = b"\x01" * lease.nbytes


# ---------------------------------------------------------------- as logic, on the test's clock


def test_a_tenant_past_its_sessions_is_refused_while_another_still_attaches() -> None:
    sessions = table(Clock(), max_sessions_per_tenant=2)
    sessions.open("a"), sessions.open("a")
    with pytest.raises(Exception, match="max_sessions_per_tenant=2") as info:
        sessions.open("a")
    assert type(info.value).__name__ == "ResourceExhaustedError"
    b = sessions.open("b")
    assert sessions.sessions_of("a") == 2 and sessions.sessions_of("b") == 1
    sessions.close(b)
    assert sessions.sessions_of("b") == 0 and sessions.counts.sessions_refused_per_tenant == 1
    sessions.close_all()


def test_leases_count_against_the_tenants_budget_and_the_nodes() -> None:
    sessions = table(Clock(), tenant_leased_bytes=8 * PAGE, max_leased_bytes=12 * PAGE)
    a1, a2, b = sessions.open("a"), sessions.open("a"), sessions.open("b")
    first = sessions.lease(a1, 5 * PAGE)
    assert first is not None and sessions.leased_bytes_of("a") == 5 * PAGE
    assert sessions.lease(a2, 4 * PAGE) is None  # 9 pages: over the tenant's 8, across its two sessions
    assert sessions.counts.tenant_budget_no_room == 1
    assert sessions.lease(a2, 3 * PAGE - 100) is not None  # rounded up to 3 pages: 8, at the budget
    assert sessions.lease(b, 5 * PAGE) is None  # the node's 12 pages: 8 held by a
    assert sessions.counts.node_budget_no_room == 1
    assert sessions.lease(b, 4 * PAGE) is not None
    sessions.release(a1, [first.lease_id])
    assert sessions.leased_bytes_of("a") == 3 * PAGE and sessions.leased_bytes() == 7 * PAGE
    sessions.close(a2)  # a session's end gives its leases' bytes back too
    assert sessions.leased_bytes_of("a") == 0 and sessions.leased_bytes() == 4 * PAGE
    sessions.close_all()


@pytest.mark.parametrize("how", ["released", "expired"])
def test_pages_of_ended_leases_are_given_back_after_release_after_s(how: str) -> None:
    clock = Clock()
    sessions = table(clock, release_after_s=1.0)
    session = sessions.open("a")
    leases = [sessions.lease(session, 16 * PAGE) for _ in range(3)]
    for lease in leases:
        fill(session, lease)
    assert session.get_segment.resident_bytes() == 48 * PAGE
    if how == "released":
        sessions.release(session, [leases[0].lease_id, leases[1].lease_id])
    else:
        clock.now += 10.0  # every lease's 10 s are up: all three expire ...
        assert sessions.expire() == 3
        live = sessions.lease(session, 16 * PAGE)  # ... and a new one is live on the freed pages
        assert live is not None
        fill(session, live)
    assert sessions.reclaim() == 0  # not yet: a busy client reuses warm pages meanwhile
    clock.now += 1.0
    released = sessions.reclaim()
    assert released >= 32 * PAGE
    assert session.get_segment.resident_bytes() == 16 * PAGE  # only the live lease's pages are left
    assert sessions.counts.released_bytes == released
    sessions.close_all()


def test_a_sealed_get_segment_keeps_its_pages_until_its_session_closes() -> None:
    clock = Clock()
    sessions = table(clock, release_after_s=0.0, seal_get_segments=True)
    session = sessions.open("a")
    lease = sessions.lease(session, 16 * PAGE)
    fill(session, lease)
    sessions.release(session, [lease.lease_id])
    assert sessions.reclaim() == 0 and session.get_segment.resident_bytes() == 16 * PAGE
    sessions.close(session)
    assert session.get_segment.resident_bytes() == 0


# ---------------------------------------------------------------- on a real node


def _block(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 2, 16, 64, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


@pytest.mark.slow
def test_a_tenant_that_fills_its_get_segments_and_lets_leases_lapse_gets_its_pages_released() -> None:
    node = ThreadedServer(auth_config(**{"shared_memory.segment_bytes": 8 * MiB, "shared_memory.lease_s": 2.0,
                                         "shared_memory.release_after_s": 0.5}))
    shm = node.server.shm
    assert shm is not None and shm.sessions is not None
    ns = sha_namespace("tenant-a")
    hashes = hash_blocks(ns, list(range(16 * 32)))
    try:
        with client_of(node, TOKEN_A, shared_memory=False, bulk=False) as client:
            client.put(ns, hashes, [_block(i) for i in range(32)])  # 32 blocks of 16 KiB
        before = shm.sessions.resident_bytes()
        hostile = [RawSession(node.target, A) for _ in range(4)]
        try:
            request = pb.GetSharedRequest(namespace=namespace_to_pb(ns), block_hashes=hashes)
            num_leases = 0
            for session in hostile:  # fill each get segment with leased copies of the 512 KiB prefix
                request.session_id = session.session_id
                while (reply := session.stub.GetShared(request, timeout=30, metadata=A)).lease_id:
                    num_leases += 1
                assert reply.no_room
            assert num_leases >= 4 * 3
            filled = shm.sessions.resident_bytes()
            assert filled - before >= num_leases * 32 * _block(0).numel() * 2  # each lease's pages, written
            # nothing is released: every lease lapses, and its pages go release_after_s later
            wait_until(lambda: shm.sessions.resident_bytes() <= before + filled // 20, 30,
                       "the get segments' pages given back once their leases lapsed")
            assert len(shm.sessions) == 4 and shm.counters()["released_bytes"] > 0
            with client_of(node, TOKEN_A) as client:  # the sessions still serve, on fresh pages
                assert torch.equal(client.get_tensors(ns, hashes[:16])[0], _block(0))
        finally:
            for session in hostile:
                session.close()
    finally:
        node.stop()


@pytest.mark.slow
def test_the_65th_session_of_one_tenant_is_refused_while_another_tenant_attaches() -> None:
    node = ThreadedServer(auth_config(**{"shared_memory.segment_bytes": 64 * 1024}))  # the default caps
    channel = grpc.insecure_channel(node.target, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.KVStoreStub(channel)
    streams, idle = [], queue.SimpleQueue()  # type: ignore[var-annotated]
    try:
        for _ in range(64):
            stream = stub.Attach(iter(idle.get, None), metadata=A)  # sends nothing: each stays open
            next(stream)
            streams.append(stream)
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Attach(iter(idle.get, None), metadata=A))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions_per_tenant=64" in info.value.details()
        with RawSession(node.target, B) as other:  # another tenant still attaches, and is served
            assert other.session_id
        with client_of(node, TOKEN_A) as client:  # tenant A's 65th client uses gRPC instead
            ns = sha_namespace("tenant-a")
            hashes = hash_blocks(ns, list(range(16)))
            client.put(ns, hashes, [_block(1)])
            assert torch.equal(client.get_tensors(ns, hashes)[0], _block(1))
            assert "max_sessions_per_tenant" in client.shared_memory()[0]
    finally:
        for stream in streams:
            idle.put(None)
            stream.cancel()
        channel.close()
        node.stop()
        gc.collect()  # the sessions' segments are mapped here (the node is in this process) until collected


@pytest.mark.slow
def test_a_puts_pages_past_the_warm_part_of_the_put_segment_go_back_once_the_node_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.client import KVStoreClient
    from kvstore.shm.client import link
    from tests.support.server import kv_blocks, make_config, namespace

    monkeypatch.setattr(link, "PUT_WARM_BYTES", 1 << 20)  # 1 MiB stays resident, as 32 MiB does by default
    server = ThreadedServer(make_config())
    try:
        with KVStoreClient(server.target, retries=0) as client:
            ns = namespace()
            hashes, tensors = kv_blocks(ns, 8, num_layers=8, num_kv_heads=8, head_dim=128)  # 8 blocks of 512 KiB
            assert client.put(ns, hashes[:1], tensors[:1]) == 1
            session = client._links[0].current()
            assert session is not None and session.put_segment.resident_bytes() <= 1 << 20
            assert client.put(ns, hashes[1:], tensors[1:]) == 7  # 3.5 MiB staged: pages up to 3.5 MiB written
            assert session.put_segment.resident_bytes() <= 1 << 20  # only the warm part is left
            got = client.get_tensors(ns, hashes)  # the node had copied every block out before they went
            assert len(got) == 8 and all(a.equal(b) for a, b in zip(got, tensors))
            assert client.put(ns, hashes[:1], tensors[:1]) == 0  # the warm pages still serve the next put
    finally:
        server.stop()
