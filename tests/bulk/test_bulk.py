"""The bulk path end to end: a real node (in process, or a ``kvstore serve`` subprocess), real sockets, real clients.

Remote-style clients (``shared_memory=False``) read and write through the bulk
listener with byte-identical results; hostile peers (a grant never issued, a
grant used twice or expired, another tenant's namespace, a Put that announces
more than it sends, a reader that stops reading, a peer that resets or is
killed mid-transfer) get a refusal, a miss or a clear error, and the node stays
healthy with nothing partial stored and what the grant held given back.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from typing import Any, Iterator

import grpc
import pytest
import torch

from kvstore.bulk.client.transfer import Refused, receive_into, reply_head, request
from kvstore.bulk.frames import MAGIC, REDEEM, REPLY, REQUEST, TransferCut
from kvstore.bulk.node.setup import bulk_refusal
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.config import load_config
from kvstore.error_codes import PermissionDeniedError
from kvstore.keys import hash_blocks
from kvstore.security import bearer_metadata
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import cached_namespace_pb, request_with_hashes
from tests.support.kvnode import KVNode
from tests.support.security import AUTH_TOKENS, TOKEN_A, TOKEN_B, sha_namespace
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace
from tests.support.waiting import wait_until

MiB = 1 << 20


def remote(server: ThreadedServer | KVNode, **kwargs: Any) -> KVStoreClient:
    """A client that takes the node for one on another host: no shared memory, the bulk path."""
    return KVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=False, **kwargs)


def counters(server: ThreadedServer) -> dict[str, int]:
    assert server.server.bulk is not None
    return server.server.bulk.counters()


def held_nothing(server: ThreadedServer) -> bool:
    c = counters(server)
    return c["grant_held_bytes"] == 0 and c["grants_outstanding"] == 0 and c["connections"] <= 1


def stub_of(target: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pb_grpc.KVStoreStub(channel)


def bulk_port(stub: Any, metadata: Any = ()) -> int:
    return stub.Capabilities(pb.CapabilitiesRequest(), timeout=10, metadata=metadata).bulk.port


def raw_request(port: int, grant: bytes, rest: bytes = b"") -> socket.socket:
    """A connection that redeems ``grant`` (and sends ``rest`` after it)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(REQUEST.pack(MAGIC, REDEEM, 0, len(grant)) + grant + rest)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, bytes, int]:
    head = b""
    while len(head) < REPLY.size:
        chunk = sock.recv(REPLY.size - len(head))
        assert chunk, "the node closed the connection without a reply"
        head += chunk
    magic, code, body_bytes, data_bytes = REPLY.unpack(head)
    assert magic == MAGIC
    body = b""
    while len(body) < body_bytes:
        body += sock.recv(body_bytes - len(body))
    return code, body, data_bytes


def closed(sock: socket.socket) -> bool:
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture()
def node(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    """A node of its own; ``indirect`` parametrization gives its config overrides."""
    server = ThreadedServer(make_config(**getattr(request, "param", {})))
    yield server
    server.stop()


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("node", [{}, {"shared_memory.enabled": False}], indirect=True, ids=["pool", "heap"])
def test_remote_clients_read_and_write_through_the_bulk_path_byte_for_byte(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 12)
    with remote(node) as client:
        assert client.put(ns, hashes, tensors) == 12
        assert client.bulk() == ("on",)
        stacked = torch.stack(tensors)
        into = torch.zeros_like(stacked)
        assert client.get_into(ns, hashes, list(into.unbind(0))) == 12
        assert torch.equal(into, stacked)
        assert [bytes(b) for b in client.get(ns, hashes)] == [encode_block(t, ns.layout) for t in tensors]
        assert all(torch.equal(a, b) for a, b in zip(client.get_tensors(ns, hashes), tensors))
        with client.read(ns, hashes[:5]) as blocks:
            assert [bytes(b) for b in blocks] == [encode_block(t, ns.layout) for t in tensors[:5]]
        assert client.get_into(ns, hash_blocks(ns, list(range(7, 7 + 16))), [torch.empty_like(tensors[0])]) == 0
    c = counters(node)
    assert c["grants_redeemed"] == 5 and c["transfers_cut"] == 0  # one Put, four Gets with blocks (not the miss)
    wait_until(lambda: held_nothing(node), 30, "the grants' leases and room given back")
    assert node.server.service.store.stats().tier("memory").blocks == 12


def test_encoded_blocks_a_strided_destination_and_a_prefix_cut_by_a_miss(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    with remote(node) as client:
        assert client.put(ns, hashes[:3], [encode_block(t, ns.layout) for t in tensors[:3]]) == 3  # bytes, as they are
        cache = torch.zeros(2, 2, 2, 4 * 16, 64, dtype=torch.float16)  # [layers, K/V, heads, tokens, head_dim]
        views = [cache[:, :, :, i * 16:(i + 1) * 16] for i in range(4)]  # not contiguous: copied from a buffer
        assert client.get_into(ns, hashes, views) == 3
        for view, tensor in zip(views[:3], tensors):
            assert torch.equal(view, tensor)
        assert not views[3].any()


async def test_the_asyncio_client_uses_the_bulk_path(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 6)
    async with AsyncKVStoreClient(node.target, timeout_s=30.0, retries=0, shared_memory=False) as client:
        assert await client.put(ns, hashes, tensors) == 6
        into = [torch.empty_like(t) for t in tensors]
        assert await client.get_into(ns, hashes, into) == 6
        assert all(torch.equal(a, b) for a, b in zip(into, tensors))
        assert client.bulk() == ("on",)
    assert counters(node)["grants_redeemed"] == 2


@pytest.mark.parametrize("node", [{"bulk.tenant_grant_bytes": 1, "bulk.max_grant_bytes": 1}], indirect=True)
def test_a_full_grant_budget_sends_the_call_over_grpc(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    channel, stub = stub_of(node.target)
    with channel, remote(node) as client:
        held = stub.BulkGet(request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns), hashes), timeout=10)
        assert not held.grant  # nothing stored yet
        assert client.put(ns, hashes, tensors) == 4
        first = stub.BulkGet(request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns), hashes), timeout=10)
        assert first.grant  # one grant larger than the budget runs alone; it stays unredeemed
        into = [torch.empty_like(t) for t in tensors]
        assert client.get_into(ns, hashes, into) == 4  # no_room: over Get, the same bytes
        assert all(torch.equal(a, b) for a, b in zip(into, tensors))
    assert counters(node)["grants_over_budget"] >= 1


# ---------------------------------------------------------------------------------------------------- tenancy, grants


@pytest.fixture()
def auth_node() -> Iterator[ThreadedServer]:
    server = ThreadedServer(make_config(**{"security.auth_tokens": AUTH_TOKENS, "bulk.grant_s": 0.5}))
    yield server
    server.stop()


def test_another_tenants_blocks_are_refused_on_the_control_call(auth_node: ThreadedServer) -> None:
    ns_a = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns_a, 3)
    with remote(auth_node, metadata=bearer_metadata(TOKEN_A)) as owner:
        assert owner.put(ns_a, hashes, tensors) == 3
        assert owner.bulk() == ("on",)
    with remote(auth_node, metadata=bearer_metadata(TOKEN_B)) as other:
        with pytest.raises(PermissionDeniedError):
            other.get_into(ns_a, hashes, [torch.empty_like(t) for t in tensors])
    channel, stub = stub_of(auth_node.target)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.BulkGet(request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns_a), hashes), timeout=10,
                     metadata=bearer_metadata(TOKEN_B))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert counters(auth_node)["grants_issued"] == 1  # the owner's Put; nothing for tenant B


def test_a_grant_is_random_one_time_and_expires(auth_node: ThreadedServer) -> None:
    ns_a = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns_a, 2)
    token = bearer_metadata(TOKEN_A)
    with remote(auth_node, metadata=token) as owner:
        assert owner.put(ns_a, hashes, tensors) == 2
    channel, stub = stub_of(auth_node.target)
    with channel:
        port = bulk_port(stub, token)
        get = request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns_a), hashes)
        never_issued = os.urandom(32)  # a client that was never granted a range
        sock = raw_request(port, never_issued)
        code, body, data = read_reply(sock)
        assert (code, data) == (grpc.StatusCode.PERMISSION_DENIED.value[0], 0) and b"grant" in body
        assert closed(sock)
        grants = [stub.BulkGet(get, timeout=10, metadata=token).grant for _ in range(2)]
        assert len(set(grants)) == 2 and all(len(g) == 32 for g in grants)
        sock = raw_request(port, grants[0])
        code, _, data = read_reply(sock)
        assert code == 0 and data == sum(len(encode_block(t, ns_a.layout)) for t in tensors)
        sock.close()
        again = raw_request(port, grants[0])  # used once already
        assert read_reply(again)[0] == grpc.StatusCode.PERMISSION_DENIED.value[0]
        wait_until(lambda: counters(auth_node)["grants_expired"] >= 1, 30, "the unredeemed grant expired")
        late = raw_request(port, grants[1])
        assert read_reply(late)[0] == grpc.StatusCode.PERMISSION_DENIED.value[0]
    wait_until(lambda: held_nothing(auth_node), 30, "the leases of the expired and used grants given back")


def test_a_request_that_is_not_the_format_is_refused(node: ThreadedServer) -> None:
    channel, stub = stub_of(node.target)
    with channel:
        sock = socket.create_connection(("127.0.0.1", bulk_port(stub)), timeout=30)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(16))
        assert read_reply(sock)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert closed(sock)
    with remote(node) as client:
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 1)
        assert client.put(ns, hashes, tensors) == 1


def test_off_loopback_a_node_with_tokens_offers_the_bulk_path_only_over_tls() -> None:
    tokens = {"security.auth_tokens": AUTH_TOKENS}
    assert bulk_refusal(load_config(env={}, overrides={**tokens, "server.host": "0.0.0.0"})) is not None
    assert bulk_refusal(load_config(env={}, overrides={**tokens, "server.host": "127.0.0.1"})) is None
    assert bulk_refusal(load_config(env={}, overrides={"server.host": "0.0.0.0"})) is None  # a plaintext node
    assert bulk_refusal(load_config(env={}, overrides={"bulk.enabled": False})) == "bulk.enabled is off"


# ---------------------------------------------------------------------------------------------------- hostile peers


@pytest.mark.parametrize("node", [{"bulk.min_transfer_s": 0.5, "bulk.min_bytes_per_s": 1 << 30}], indirect=True)
def test_a_put_that_announces_more_than_it_sends_stores_nothing_and_gives_its_room_back(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    blocks = [encode_block(t, ns.layout) for t in tensors]
    channel, stub = stub_of(node.target)
    with channel:
        put = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(ns), hashes)
        put.sizes.extend(len(b) for b in blocks)
        grant = stub.BulkPut(put, timeout=10).grant
        sock = raw_request(bulk_port(stub), grant, b"".join(blocks[:2]) + blocks[2][:100])  # two and a bit
        assert closed(sock)  # cut at its deadline
    wait_until(lambda: counters(node)["transfers_cut"] == 1 and held_nothing(node), 30, "the stalled Put cut")
    with remote(node) as client:
        assert client.lookup(ns, hashes).num_blocks == 0  # nothing partial stored
        assert client.put(ns, hashes, tensors) == 4  # the node goes on


@pytest.mark.parametrize("node", [{"bulk.min_transfer_s": 0.5, "bulk.min_bytes_per_s": 1 << 30}], indirect=True)
def test_a_reader_that_stops_reading_is_cut_and_its_lease_given_back(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 48, num_layers=8, head_dim=256)  # 12 MiB: more than the socket buffers hold
    with remote(node) as client:
        assert client.put(ns, hashes, tensors) == 48
    channel, stub = stub_of(node.target)
    with channel:
        grant = stub.BulkGet(request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns), hashes), timeout=10).grant
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", bulk_port(stub)))
        sock.sendall(REQUEST.pack(MAGIC, REDEEM, 0, len(grant)) + grant)  # and never reads
        wait_until(lambda: counters(node)["transfers_cut"] == 1, 30, "the stalled reader cut")
        sock.close()
    wait_until(lambda: held_nothing(node), 30, "the stalled reader's lease given back")
    into = [torch.empty_like(t) for t in tensors]
    with remote(node) as client:
        assert client.get_into(ns, hashes, into) == 48
    assert all(torch.equal(a, b) for a, b in zip(into, tensors))


def test_a_put_reset_mid_block_stores_nothing(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 8, num_layers=8, head_dim=128)
    blocks = [encode_block(t, ns.layout) for t in tensors]
    channel, stub = stub_of(node.target)
    with channel:
        put = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(ns), hashes)
        put.sizes.extend(len(b) for b in blocks)
        grant = stub.BulkPut(put, timeout=10).grant
        sock = raw_request(bulk_port(stub), grant, b"".join(blocks[:5]) + blocks[5][:1000])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset (RST), mid-block
    wait_until(lambda: counters(node)["transfers_cut"] == 1 and held_nothing(node), 30, "the reset Put cut")
    with remote(node) as client:
        assert client.lookup(ns, hashes).num_blocks == 0
        assert client.put(ns, hashes, tensors) == 8


def test_a_corrupt_block_fails_the_put_with_its_status_and_stores_nothing(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    blocks = [bytearray(encode_block(t, ns.layout)) for t in tensors]
    blocks[1][-1] ^= 0xFF  # the payload's last byte
    channel, stub = stub_of(node.target)
    with channel:
        put = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(ns), hashes)
        put.sizes.extend(len(b) for b in blocks)
        grant = stub.BulkPut(put, timeout=10).grant
        sock = raw_request(bulk_port(stub), grant, b"".join(blocks))
        code, body, _ = read_reply(sock)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"checksum" in body
    with remote(node) as client:
        assert client.lookup(ns, hashes).num_blocks == 0
    wait_until(lambda: held_nothing(node), 30, "the refused Put's room given back")


_CLIENT_KILLED_MID_PUT = textwrap.dedent("""
    import socket, sys
    from pathlib import Path
    from kvstore.bulk.frames import MAGIC, REDEEM, REQUEST
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    grant = bytes.fromhex(sys.argv[2])
    sock.sendall(REQUEST.pack(MAGIC, REDEEM, 0, len(grant)) + grant + Path(sys.argv[3]).read_bytes())
    print("sent", flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_client_killed_mid_put_leaves_the_node_healthy_with_nothing_stored(node: ThreadedServer,
                                                                           tmp_path: Any) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4, num_layers=8, head_dim=128)
    blocks = [encode_block(t, ns.layout) for t in tensors]
    channel, stub = stub_of(node.target)
    with channel:
        put = request_with_hashes(pb.BulkPutRequest, cached_namespace_pb(ns), hashes)
        put.sizes.extend(len(b) for b in blocks)
        grant = stub.BulkPut(put, timeout=10).grant
        sent = tmp_path / "sent"
        sent.write_bytes(blocks[0] + blocks[1][:4096])  # a block and the start of the next
        child = subprocess.Popen([sys.executable, "-c", _CLIENT_KILLED_MID_PUT, str(bulk_port(stub)), grant.hex(),
                                  str(sent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"sent"
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=30)
    wait_until(lambda: counters(node)["transfers_cut"] == 1 and held_nothing(node), 30,
               f"the killed Put cut: {counters(node)}")
    with remote(node) as client:
        assert client.lookup(ns, hashes).num_blocks == 0
        assert client.put(ns, hashes, tensors) == 4
        into = [torch.empty_like(t) for t in tensors]
        assert client.get_into(ns, hashes, into) == 4


def test_a_node_killed_mid_get_is_a_miss_for_the_blocks_not_complete() -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 128, num_layers=8, head_dim=128)  # 16 MiB: more than the socket buffers hold
    with KVNode(memory_capacity="256MiB", metrics=False) as kvnode:
        with remote(kvnode) as client:
            assert client.put(ns, hashes, tensors) == 128
            assert client.bulk() == ("on",)
        channel, stub = stub_of(kvnode.target)
        with channel:
            reply = stub.BulkGet(request_with_hashes(pb.BulkGetRequest, cached_namespace_pb(ns), hashes), timeout=10)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.connect(("127.0.0.1", bulk_port(stub)))
        deadline = time.monotonic() + 30
        request(sock, REDEEM, reply.grant, deadline)
        reply_head(sock, deadline)
        into = [torch.zeros_like(t) for t in tensors]
        first = receive_into(sock, reply.sizes[:2], into, ns.layout, True, deadline)  # two blocks, then the kill
        assert first.copied.num_copied == 2 and first.cut is None
        kvnode.kill()
        rest = receive_into(sock, reply.sizes[2:], into[2:], ns.layout, True, deadline)
        sock.close()
    assert isinstance(rest.cut, TransferCut)
    num_whole = 2 + rest.copied.num_copied
    assert 2 <= num_whole < 128 and rest.copied.num_found == rest.copied.num_copied  # the cut block is no hit
    for i in range(num_whole):
        assert torch.equal(into[i], tensors[i])


def test_a_node_gone_between_calls_is_a_clear_error_and_a_restarted_one_serves_again() -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    with KVNode(memory_capacity="64MiB", metrics=False) as kvnode:
        with KVStoreClient(kvnode.target, timeout_s=10.0, shared_memory=False) as client:  # retries UNAVAILABLE
            assert client.put(ns, hashes, tensors) == 4
            kvnode.kill()
            from kvstore.errors import UnavailableError
            with pytest.raises(UnavailableError):
                client.get_into(ns, hashes, [torch.empty_like(t) for t in tensors])
            kvnode.start()  # a fresh node on the same ports (and a new bulk port): nothing cached
            wait_until(lambda: _serving(client), 30, "the client's channel reconnected")
            into = [torch.empty_like(t) for t in tensors]
            assert client.put(ns, hashes, tensors) == 4
            assert client.get_into(ns, hashes, into) == 4
            assert all(torch.equal(a, b) for a, b in zip(into, tensors))


def _serving(client: KVStoreClient) -> bool:
    try:
        return client.health() == "SERVING"
    except Exception:  # noqa: BLE001 - not yet
        return False


def test_a_refused_transfer_raises_the_status_as_a_typed_error() -> None:
    refused = Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the quota")
    assert type(refused.error).__name__ == "ResourceExhaustedError" and "over the quota" in str(refused.error)
