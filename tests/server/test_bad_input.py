"""Every malformed request gets its status code, and leaves the stored data unchanged."""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import Namespace, block_key
from kvstore.wire import namespace_to_pb, put_requests
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from tests.support.server import MiB, ThreadedServer, kv_blocks, namespace

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture()
def stored(client: KVStoreClient) -> Iterator[tuple[Namespace, list[bytes], list[torch.Tensor]]]:
    """Two blocks stored before the bad call; the test checks they are still there, unchanged, after it."""
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    client.put(ns, hashes, tensors)
    yield ns, hashes, tensors


def _unchanged(client: KVStoreClient, server: ThreadedServer, stored: tuple, blocks_before: int) -> None:
    ns, hashes, tensors = stored
    assert client.lookup(ns, hashes).num_blocks == 2
    for sent, received in zip(tensors, client.get_tensors(ns, hashes)):
        assert torch.equal(sent, received)
    assert client.stats().tier("memory").blocks == blocks_before


def _code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _ns_pb(**fields: object) -> pb.Namespace:
    message = namespace_to_pb(namespace())
    for name, value in fields.items():
        setattr(message, name, value)
    return message


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"model": ""}, "model"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"tp_size": 0}, "tp_rank"),
        ({"block_size": 0}, "block_size"),
        ({"dtype": "float13"}, "dtype"),
        ({"layout": "blocked"}, "layout"),
        ({"hash_algorithm": ""}, "hash_algorithm"),
        ({"hash_algorithm": "md5"}, "hash_algorithm"),
    ],
)
def test_bad_namespace_is_invalid_argument(stub: pb_grpc.KVStoreStub, client: KVStoreClient, server: ThreadedServer,
                                           stored: tuple, fields: dict, needle: str) -> None:
    before = client.stats().tier("memory").blocks
    bad = _ns_pb(**fields)
    h = [b"\x00" * 16]
    for call in (
        lambda: stub.Lookup(pb.LookupRequest(namespace=bad, block_hashes=h)),
        lambda: list(stub.Get(pb.GetRequest(namespace=bad, block_hashes=h))),
        lambda: stub.Delete(pb.DeleteRequest(namespace=bad, block_hashes=h)),
        lambda: stub.Clear(pb.ClearRequest(namespace=bad)),
        lambda: stub.Put(iter([pb.PutRequest(namespace=bad, block_hash=h[0], total_bytes=1, data=b"x")])),
    ):
        code, details = _code_of(call)
        assert code == INVALID and needle in details
    _unchanged(client, server, stored, before)


@pytest.mark.parametrize("length", [0, 15, 17, 32])
def test_malformed_hash_length_is_invalid_argument(stub: pb_grpc.KVStoreStub, client: KVStoreClient,
                                                   server: ThreadedServer, stored: tuple, length: int) -> None:
    ns, hashes, tensors = stored
    before = client.stats().tier("memory").blocks
    ns_pb = namespace_to_pb(ns)
    bad = [hashes[0], b"\x01" * length]
    for call in (
        lambda: stub.Lookup(pb.LookupRequest(namespace=ns_pb, block_hashes=bad)),
        lambda: list(stub.Get(pb.GetRequest(namespace=ns_pb, block_hashes=bad))),
        lambda: stub.Delete(pb.DeleteRequest(namespace=ns_pb, block_hashes=bad)),
    ):
        code, details = _code_of(call)
        assert code == INVALID and "must be 16 bytes" in details
    if length:  # an empty hash is indistinguishable from a continuation chunk: a different error
        code, details = _code_of(lambda: stub.Put(
            iter(_messages(ns, [hashes[0], b"\x01" * length], encode_blocks_of(ns, tensors), 1 << 20))))
        assert code == INVALID and "must be 16 bytes" in details
    _unchanged(client, server, stored, before)


def _messages(ns: Namespace, hashes: list[bytes], blocks: list[bytes], chunk_bytes: int) -> list[pb.PutRequest]:
    """The client's serialized Put stream, parsed back by plain protobuf (which also checks it interoperates)."""
    return [pb.PutRequest.FromString(m) for m in put_requests(ns, hashes, blocks, chunk_bytes)]


def encode_blocks_of(ns: Namespace, tensors: list[torch.Tensor]) -> list[bytes]:
    return [encode_block(t, ns.layout) for t in tensors]


def _corrupt(block: bytes, offset: int, value: int) -> bytes:
    data = bytearray(block)
    data[offset] = value
    return bytes(data)


def _with_shape(ns: Namespace, tensor: torch.Tensor, dim: int, size: int) -> bytes:
    block = bytearray(encode_block(tensor, ns.layout))
    block[28 + 8 * dim: 28 + 8 * dim + 8] = size.to_bytes(8, "little")
    return bytes(block)


@pytest.mark.parametrize(
    ("make_block", "needle"),
    [
        (lambda ns, t: _corrupt(encode_block(t), 6, 99), "unknown dtype code"),
        (lambda ns, t: encode_block(t.to(torch.float32)), "does not match the namespace"),
        (lambda ns, t: _with_shape(ns, t, 4, 65), "does not match payload"),
        (lambda ns, t: encode_block(t)[:-10], "truncated"),
        (lambda ns, t: encode_block(t) + b"\x00" * 64, "trail the payload"),
        (lambda ns, t: _corrupt(encode_block(t), 200, (encode_block(t)[200] + 1) % 256), "checksum"),
        (lambda ns, t: _corrupt(encode_block(t), 0, ord("X")), "not a kvstore block"),
        (lambda ns, t: encode_block(torch.zeros(2, 2, 2, 8, 64, dtype=torch.float16)), "block size"),
    ],
    ids=["unknown-dtype", "dtype-mismatch", "shape-vs-payload", "short-payload", "trailing-bytes", "checksum",
         "magic", "block-size"],
)
def test_bad_block_is_invalid_argument_and_nothing_of_the_batch_is_stored(
    client: KVStoreClient, server: ThreadedServer, stored: tuple, make_block: Callable, needle: str
) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    hashes, tensors = kv_blocks(ns, 3, first_token=5000)
    blocks = [encode_block(t) for t in tensors]
    blocks[1] = make_block(ns, tensors[1])
    with pytest.raises(InvalidArgumentError, match=needle):
        client.put(ns, hashes, blocks)
    assert client.lookup(ns, hashes).num_blocks == 0  # not even the valid first block
    _unchanged(client, server, stored, before)


def test_truncated_put_stream_stores_nothing(stub: pb_grpc.KVStoreStub, client: KVStoreClient,
                                             server: ThreadedServer, stored: tuple) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    hashes, tensors = kv_blocks(ns, 2, first_token=7000)
    messages = _messages(ns, hashes, encode_blocks_of(ns, tensors), 4096)
    code, details = _code_of(lambda: stub.Put(iter(messages[:-1])))  # the last chunk never comes
    assert code == INVALID and "truncated" in details
    code, details = _code_of(lambda: stub.Put(iter(messages[:3] + messages[4:])))  # a chunk goes missing
    assert code == INVALID and "offset" in details
    code, details = _code_of(lambda: stub.Put(iter(messages[1:])))  # no namespace
    assert code == INVALID and "namespace" in details
    assert client.lookup(ns, hashes).num_blocks == 0
    _unchanged(client, server, stored, before)


def test_a_put_may_open_with_a_namespace_only_message_but_not_repeat_it(
        stub: pb_grpc.KVStoreStub, client: KVStoreClient, server: ThreadedServer, stored: tuple) -> None:
    """The namespace is set on the first message only: that message may carry nothing else (observed:
    'chunk of block 0 arrived before that block's first chunk'), and a later one must not carry it (it was
    silently ignored, so blocks were stored under the first)."""
    ns, _, _ = stored
    hashes, tensors = kv_blocks(ns, 2, first_token=7500)
    messages = _messages(ns, hashes, encode_blocks_of(ns, tensors), 4096)
    opening = pb.PutRequest(namespace=namespace_to_pb(ns), priority=50)
    body = [pb.PutRequest(block_index=m.block_index, offset=m.offset, block_hash=m.block_hash,
                          total_bytes=m.total_bytes, data=m.data) for m in messages]
    other = namespace()
    assert other != ns
    body[3].namespace.CopyFrom(namespace_to_pb(other))
    before = client.stats().tier("memory").blocks
    code, details = _code_of(lambda: stub.Put(iter([opening, *body])))
    assert code == INVALID and "namespace" in details
    assert client.lookup(ns, hashes).num_blocks == 0 and client.lookup(other, hashes).num_blocks == 0
    _unchanged(client, server, stored, before)
    body[3].ClearField("namespace")
    assert stub.Put(iter([opening, *body])).num_stored == 2
    for sent, received in zip(tensors, client.get_tensors(ns, hashes)):
        assert torch.equal(sent, received)


def test_put_stream_past_its_deadline_stores_nothing(stub: pb_grpc.KVStoreStub, client: KVStoreClient,
                                                     server: ThreadedServer, stored: tuple) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    hashes, tensors = kv_blocks(ns, 2, first_token=8000)
    messages = _messages(ns, hashes, encode_blocks_of(ns, tensors), 4096)

    released = threading.Event()

    def stalling() -> Iterator[pb.PutRequest]:
        yield from messages[:-1]
        released.wait(30)  # the deadline passes mid-stream: the call ends while the sender waits here
        yield messages[-1]

    try:
        code, _ = _code_of(lambda: stub.Put(stalling(), timeout=0.5))
    finally:
        released.set()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.lookup(ns, hashes).num_blocks == 0
    _unchanged(client, server, stored, before)


def test_block_over_max_block_bytes_is_refused_before_buffering(
    stub: pb_grpc.KVStoreStub, client: KVStoreClient, server: ThreadedServer, stored: tuple
) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    message = pb.PutRequest(namespace=namespace_to_pb(ns), block_hash=b"\x05" * 16,
                            total_bytes=20 * MiB + 1, data=b"\x00" * 1024)
    code, details = _code_of(lambda: stub.Put(iter([message])))  # only 1 KiB sent: refused on the header
    assert code == EXHAUSTED and "max_block_bytes" in details
    big_ns = namespace(layout="mla", dtype="uint8", block_size=1)
    with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
        client.put(big_ns, [b"\x06" * 16], [torch.zeros(1, 1, 1, 20 * MiB, dtype=torch.uint8)])
    _unchanged(client, server, stored, before)


def test_too_many_hashes_is_invalid_argument(client: KVStoreClient, server: ThreadedServer, stored: tuple) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    hashes = [i.to_bytes(16, "little") for i in range(65)]  # max_hashes_per_request is 64 in these tests
    for call in (lambda: client.lookup(ns, hashes), lambda: client.get(ns, hashes),
                 lambda: client.delete(ns, hashes)):
        with pytest.raises(InvalidArgumentError, match="max_hashes_per_request=64"):
            call()
    ns_small = namespace(layout="mla", dtype="uint8", block_size=1)
    blocks = [encode_block(torch.zeros(1, 1, 1, 8, dtype=torch.uint8), "mla")] * 65
    with pytest.raises(InvalidArgumentError, match="max_hashes_per_request=64"):
        client.put(ns_small, hashes, blocks)
    assert client.lookup(ns, hashes[:64]).num_blocks == 0
    _unchanged(client, server, stored, before)


@pytest.mark.parametrize(("priority", "retention_s"), [(101, None), (None, -1.0)])
def test_bad_priority_or_retention_is_invalid_argument(client: KVStoreClient, server: ThreadedServer,
                                                       stored: tuple, priority: int | None,
                                                       retention_s: float | None) -> None:
    ns, _, _ = stored
    before = client.stats().tier("memory").blocks
    hashes, tensors = kv_blocks(ns, 1, first_token=9000)
    with pytest.raises(InvalidArgumentError):
        client.put(ns, hashes, tensors, priority=priority, retention_s=retention_s)
    _unchanged(client, server, stored, before)


@pytest.mark.slow
@pytest.mark.server_config({"store.memory.capacity_bytes": "4MiB"})
def test_no_room_when_everything_is_leased_is_resource_exhausted(fresh_server: ThreadedServer) -> None:
    ns = namespace()
    with KVStoreClient(fresh_server.target, retries=0) as kv:
        hashes, tensors = kv_blocks(ns, 3, num_layers=4, num_kv_heads=8, head_dim=512)  # 1 MiB each
        assert kv.put(ns, hashes, tensors) == 3
        store = fresh_server.server.store
        keys = [block_key(ns, h) for h in hashes]

        held = []

        async def lease(pin: bool) -> None:  # hold the references a long-running reader would hold
            if pin:
                held.extend(store.index.hold(0, key) for key in keys)
            else:
                for entry in held:
                    store.index.release(entry)

        fresh_server.call(lease(True))
        more, more_tensors = kv_blocks(ns, 2, num_layers=4, num_kv_heads=8, head_dim=512, first_token=3000)
        with pytest.raises(ResourceExhaustedError, match="leased"):
            kv.put(ns, more, more_tensors)
        assert kv.lookup(ns, hashes).num_blocks == 3
        assert kv.lookup(ns, more).num_blocks == 0
        fresh_server.call(lease(False))
        assert kv.put(ns, more, more_tensors) == 2  # with the leases gone, eviction makes room


# ---------------------------------------------------------------------- the servicer's namespace cache

def test_a_bad_namespace_is_refused_every_time_and_never_cached(stub: pb_grpc.KVStoreStub, client: KVStoreClient,
                                                                server: ThreadedServer, stored: tuple) -> None:
    ns, hashes, _ = stored
    bad = _ns_pb(block_size=0)
    for _ in range(3):
        code, details = _code_of(lambda: stub.Lookup(pb.LookupRequest(namespace=bad, block_hashes=hashes)))
        assert code == INVALID and "block_size" in details
        code, _ = _code_of(lambda: list(stub.Get(pb.GetRequest(namespace=bad, block_hashes=hashes))))
        assert code == INVALID
    assert bad.SerializeToString() not in server.server.service.namespaces
    good = namespace_to_pb(ns)
    assert stub.Lookup(pb.LookupRequest(namespace=good, block_hashes=hashes)).num_blocks == 2
    assert len(list(stub.Get(pb.GetRequest(namespace=good, block_hashes=hashes)))) == 2
    code, _ = _code_of(lambda: stub.Lookup(pb.LookupRequest(namespace=bad, block_hashes=hashes)))
    assert code == INVALID  # a good namespace in between changes nothing


def test_namespaces_that_differ_in_one_field_are_not_confused(stub: pb_grpc.KVStoreStub, client: KVStoreClient,
                                                              stored: tuple) -> None:
    ns, hashes, _ = stored
    good = namespace_to_pb(ns)
    assert stub.Lookup(pb.LookupRequest(namespace=good, block_hashes=hashes)).num_blocks == 2
    salted = namespace_to_pb(ns)
    salted.cache_salt = "another-tenant"
    assert stub.Lookup(pb.LookupRequest(namespace=salted, block_hashes=hashes)).num_blocks == 0
    bad = namespace_to_pb(ns)
    bad.dtype = "float13"
    code, _ = _code_of(lambda: stub.Lookup(pb.LookupRequest(namespace=bad, block_hashes=hashes)))
    assert code == INVALID
    assert stub.Lookup(pb.LookupRequest(namespace=good, block_hashes=hashes)).num_blocks == 2


def test_the_namespace_cache_is_bounded_in_bytes_and_keeps_the_most_recent(client: KVStoreClient,
                                                                            server: ThreadedServer) -> None:
    cache = server.server.service.namespaces
    namespaces = [namespace() for _ in range(5)]
    entry_bytes = cache.entry_bytes(namespace_to_pb(namespaces[0]).SerializeToString())
    old_max, cache.max_bytes = cache.max_bytes, 2 * entry_bytes + entry_bytes // 2  # room for two
    try:
        for _ in range(2):
            for ns in namespaces:
                hashes, tensors = kv_blocks(ns, 1)
                client.put(ns, hashes, tensors)
                assert client.lookup(ns, hashes).num_blocks == 1
                assert len(cache) <= 2 and cache.nbytes <= cache.max_bytes
        assert namespace_to_pb(namespaces[-1]).SerializeToString() in cache
        assert namespace_to_pb(namespaces[0]).SerializeToString() not in cache
    finally:
        cache.max_bytes = old_max
    for ns in namespaces:
        client.clear(ns)


@pytest.mark.server_config({"security.require_sha256": True})
def test_a_cached_namespace_is_still_checked_for_sha256_on_every_call(fresh_server: ThreadedServer) -> None:
    channel = grpc.insecure_channel(fresh_server.target)
    stub = pb_grpc.KVStoreStub(channel)
    try:
        xxh3 = namespace_to_pb(namespace())
        sha = namespace_to_pb(namespace(hash_algorithm="sha256"))
        assert stub.Lookup(pb.LookupRequest(namespace=sha, block_hashes=[b"\x00" * 32])).num_blocks == 0
        for _ in range(2):
            code, details = _code_of(lambda: stub.Lookup(pb.LookupRequest(namespace=xxh3, block_hashes=[b"\x00" * 16])))
            assert code == INVALID and "sha256" in details
            assert xxh3.SerializeToString() not in fresh_server.server.service.namespaces  # refused: not kept
        assert stub.Lookup(pb.LookupRequest(namespace=sha, block_hashes=[b"\x00" * 32])).num_blocks == 0
    finally:
        channel.close()
