"""Namespace fields have length limits, and the servicer's namespace cache holds only authorized calls' (issue 18,
finding 5). The figures of a node under many such calls are in ``test_hostile_clients.py``."""

from __future__ import annotations

import grpc
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.keys import NAMESPACE_FIELD_MAX_BYTES, Namespace
from kvstore.security import bearer_metadata
from kvstore.wire import MAX_NAMESPACE_WIRE_BYTES, namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.support.server import ThreadedServer, make_config

from tests.support.security import TOKEN_A, auth_config, raw_channel, sha_namespace

TEXT_FIELDS = ["model", "revision", "dtype", "layout", "adapter", "cache_salt", "hash_algorithm", "kv_encoding"]


def test_every_text_field_of_a_namespace_has_a_limit() -> None:
    assert sorted(NAMESPACE_FIELD_MAX_BYTES) == sorted(TEXT_FIELDS)
    assert MAX_NAMESPACE_WIRE_BYTES < 2048
    at_limit = {name: "x" * NAMESPACE_FIELD_MAX_BYTES[name] for name in ("model", "revision", "adapter", "cache_salt")}
    Namespace(**at_limit)  # at the limit: accepted
    for name in at_limit:
        with pytest.raises(InvalidArgumentError, match=f"namespace.{name} is"):
            Namespace(**{**at_limit, name: "é" * (NAMESPACE_FIELD_MAX_BYTES[name] // 2 + 1)})  # UTF-8 bytes count


def _wire_namespace(**fields: object) -> pb.Namespace:
    message = namespace_to_pb(Namespace(model="tests/limits"))
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def _code(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def open_server():
    server = ThreadedServer(make_config())
    yield server
    server.stop()


@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_a_field_over_its_limit_is_invalid_argument_naming_it_and_is_not_cached(open_server: ThreadedServer,
                                                                               field: str) -> None:
    channel = raw_channel(open_server)
    stub = pb_grpc.KVStoreStub(channel)
    try:
        message = _wire_namespace(**{field: "x" * (NAMESPACE_FIELD_MAX_BYTES[field] + 1)})
        code, details = _code(lambda: stub.Lookup(pb.LookupRequest(namespace=message, block_hashes=[b"\0" * 16])))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and field in details
        assert message.SerializeToString() not in open_server.server.service.namespaces
    finally:
        channel.close()


def test_a_huge_namespace_is_refused_before_it_is_parsed(open_server: ThreadedServer) -> None:
    """Regression: a 4 MB model string was parsed, cached by its wire bytes and kept (1,024 of them)."""
    channel = raw_channel(open_server)
    stub = pb_grpc.KVStoreStub(channel)
    try:
        message = _wire_namespace(model="m" * ((4 << 20) - 4096))
        for method in (stub.Lookup, stub.Delete):
            request_type = pb.LookupRequest if method is stub.Lookup else pb.DeleteRequest
            code, details = _code(lambda: method(request_type(namespace=message, block_hashes=[b"\0" * 16])))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and f"limit of {MAX_NAMESPACE_WIRE_BYTES}" in details
            assert len(details) < 1024  # the message does not echo the field
        code, _ = _code(lambda: list(stub.Get(pb.GetRequest(namespace=message, block_hashes=[b"\0" * 16]))))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert len(open_server.server.service.namespaces) < 8
    finally:
        channel.close()


@pytest.mark.slow
def test_refused_callers_leave_nothing_in_the_namespace_cache() -> None:
    """Regression: the cache was filled before the tenant check, so PERMISSION_DENIED calls pinned memory."""
    server = ThreadedServer(auth_config())
    channel = raw_channel(server)
    stub = pb_grpc.KVStoreStub(channel)
    try:
        cache = server.server.service.namespaces
        md = bearer_metadata(TOKEN_A)
        for i in range(50):  # tenant A asking for other tenants' namespaces
            other = namespace_to_pb(sha_namespace(f"tenant-b-{i}"))
            code, _ = _code(lambda: stub.Lookup(pb.LookupRequest(namespace=other, block_hashes=[b"\0" * 32]),
                                                metadata=md))
            assert code is grpc.StatusCode.PERMISSION_DENIED
        for i in range(20):  # and no token at all
            other = namespace_to_pb(sha_namespace("tenant-a"))
            code, _ = _code(lambda: stub.Lookup(pb.LookupRequest(namespace=other, block_hashes=[b"\0" * 32])))
            assert code is grpc.StatusCode.UNAUTHENTICATED
        assert len(cache) == 0 and cache.nbytes == 0
        mine = namespace_to_pb(sha_namespace("tenant-a"))
        assert stub.Lookup(pb.LookupRequest(namespace=mine, block_hashes=[b"\0" * 32]), metadata=md).num_blocks == 0
        assert mine.SerializeToString() in cache  # an authorized call's is kept
    finally:
        channel.close()
        server.stop()
