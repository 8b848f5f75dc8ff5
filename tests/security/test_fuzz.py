"""Fuzzing a real server with random and malformed messages (hypothesis).

Invariants, for every example: the call ends with one of the expected status
codes (never UNKNOWN or INTERNAL), a refused Put stores nothing of itself, and
the blocks stored before fuzzing come back byte for byte; after each run the
server still reports SERVING. About 260 examples in all, well under a minute on
two cores.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.keys import Namespace, hash_blocks
from kvstore.security import bearer_metadata
from kvstore.wire import GET_METHOD, PUT_METHOD, namespace_to_pb, put_requests
from kvstore.v1 import kvstore_pb2 as pb
from tests.support.server import ThreadedServer, encoded, kv_blocks

from tests.support.security import TOKEN_A, auth_config, raw_channel, sha_namespace

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
DENIED = grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
MD = bearer_metadata(TOKEN_A)
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
_FRESH = itertools.count(1_000_000)  # first token ids of blocks no earlier example stored


class Fuzzed:
    """A module's server, a channel to it, its raw multicallables and the known blocks stored before fuzzing."""

    def __init__(self) -> None:
        self.server = ThreadedServer(auth_config(**{"limits.max_hashes_per_request": 16,
                                                    "store.max_block_bytes": 1 << 20}))
        self.channel = raw_channel(self.server)
        self.unary = {name: self.channel.unary_unary(f"/kvstore.v1.KVStore/{name}", request_serializer=None,
                                                     response_deserializer=None)
                      for name in ("Lookup", "Delete", "Clear", "Stats")}
        self.get = self.channel.unary_stream(GET_METHOD, request_serializer=None, response_deserializer=None)
        self.put = self.channel.stream_unary(PUT_METHOD, request_serializer=None, response_deserializer=None)
        self.known_ns = sha_namespace("tenant-a", model="fuzz-known")
        self.known_hashes, tensors = kv_blocks(self.known_ns, 3)
        self.known_blocks = encoded(self.known_ns, tensors)
        self.template_ns = sha_namespace("tenant-a", model="fuzz-target")
        assert self.code(lambda: self.put(put_requests(self.known_ns, self.known_hashes, self.known_blocks, 1 << 20),
                                          metadata=MD, timeout=30)) == OK
        self.known_raw = self.get_raw(self.known_ns, self.known_hashes)

    def get_raw(self, ns: Namespace, hashes: list[bytes]) -> list[bytes]:
        request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes).SerializeToString()
        return list(self.get(request, metadata=MD, timeout=30))

    def lookup(self, ns: Namespace, hashes: list[bytes]) -> int:
        request = pb.LookupRequest(namespace=namespace_to_pb(ns), block_hashes=hashes).SerializeToString()
        return pb.LookupResponse.FromString(self.unary["Lookup"](request, metadata=MD, timeout=30)).num_blocks

    @staticmethod
    def code(call: Any) -> grpc.StatusCode:
        try:
            result = call()
            if isinstance(result, Iterator):
                list(result)
        except grpc.RpcError as exc:
            return exc.code()
        return OK

    def check_known_blocks(self) -> None:
        assert self.get_raw(self.known_ns, self.known_hashes) == self.known_raw

    def check_healthy(self) -> None:
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    target = Fuzzed()
    yield target
    target.check_healthy()
    target.check_known_blocks()
    target.close()


# ---------------------------------------------------------------- strategies

salts = st.sampled_from(["tenant-a", "tenant-a", "", "tenant-b"]) | st.text(max_size=8)
namespaces = st.builds(
    pb.Namespace,
    model=st.sampled_from(["", "fuzz-target", "fuzz-known-not"]) | st.text(max_size=12),
    revision=st.text(max_size=4),
    dtype=st.sampled_from(["float16", "bfloat16", "float13", ""]),
    layout=st.sampled_from(["kv", "mla", "blocked", ""]),
    block_size=st.sampled_from([0, 1, 16, 1 << 20, (1 << 20) + 1, (1 << 32) - 1]),
    tp_size=st.sampled_from([0, 1, 2, (1 << 32) - 1]),
    tp_rank=st.sampled_from([0, 1, 2]),
    adapter=st.text(max_size=4),
    cache_salt=salts,
    hash_algorithm=st.sampled_from(["sha256", "sha256", "xxh3_128", "", "md5"]),
)
hash_lists = st.lists(st.binary(min_size=0, max_size=40) | st.binary(min_size=32, max_size=32), max_size=20)


# ---------------------------------------------------------------- random bytes


@settings(FUZZ, max_examples=60)
@given(method=st.sampled_from(["Lookup", "Delete", "Clear", "Stats", "Get"]), payload=st.binary(max_size=300))
def test_random_bytes_as_requests(fuzzed: Fuzzed, method: str, payload: bytes) -> None:
    if method == "Get":
        code = fuzzed.code(lambda: fuzzed.get(payload, metadata=MD, timeout=30))
    else:
        code = fuzzed.code(lambda: fuzzed.unary[method](payload, metadata=MD, timeout=30))
    assert code in {OK, INVALID, DENIED}


@settings(FUZZ, max_examples=30)
@given(messages=st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_bytes_as_put_streams(fuzzed: Fuzzed, messages: list[bytes]) -> None:
    code = fuzzed.code(lambda: fuzzed.put(iter(messages), metadata=MD, timeout=30))
    assert code in {OK, INVALID, DENIED, EXHAUSTED}
    fuzzed.check_known_blocks()


@settings(FUZZ, max_examples=25)
@given(authorization=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60))
def test_random_authorization_metadata(fuzzed: Fuzzed, authorization: str) -> None:
    request = pb.LookupRequest(namespace=namespace_to_pb(fuzzed.known_ns),
                               block_hashes=fuzzed.known_hashes).SerializeToString()
    code = fuzzed.code(lambda: fuzzed.unary["Lookup"](request, metadata=[("authorization", authorization)],
                                                      timeout=30))
    assert code == UNAUTHENTICATED


# ---------------------------------------------------------------- well-formed protobuf, wrong contents


@settings(FUZZ, max_examples=60)
@given(method=st.sampled_from(["Lookup", "Get", "Delete", "Clear"]), namespace=namespaces, hashes=hash_lists)
def test_random_namespaces_and_hash_lengths(fuzzed: Fuzzed, method: str, namespace: pb.Namespace,
                                            hashes: list[bytes]) -> None:
    if method == "Clear":
        payload = pb.ClearRequest(namespace=namespace).SerializeToString()
    else:
        payload = pb.LookupRequest(namespace=namespace, block_hashes=hashes).SerializeToString()  # same fields
    if method == "Get":
        code = fuzzed.code(lambda: fuzzed.get(payload, metadata=MD, timeout=30))
    else:
        code = fuzzed.code(lambda: fuzzed.unary[method](payload, metadata=MD, timeout=30))
    assert code in {OK, INVALID, DENIED}
    if code is OK and method != "Clear":
        assert len(hashes) <= 16 and all(len(h) == 32 for h in hashes) and namespace.cache_salt == "tenant-a"
    fuzzed.check_known_blocks()


@st.composite
def put_streams(draw: st.DrawFn) -> tuple[Namespace, list[bytes], list[bytes], list[bytes]]:
    """A two-block Put of fresh blocks, then mutated: header bytes, shapes, lengths, offsets, hashes, namespace."""
    ns = sha_namespace("tenant-a", model="fuzz-target")
    first = next(_FRESH) * 2
    tokens = list(range(first, first + 2 * ns.block_size))
    hashes = [bytes(h) for h in hash_blocks(ns, tokens)]
    _, tensors = kv_blocks(ns, 2, first_token=first % 1000)
    blocks = [bytearray(b) for b in encoded(ns, tensors)]
    victim = draw(st.integers(0, 1))
    mutation = draw(st.sampled_from(["none", "header_byte", "huge_shape", "truncate", "extend", "hash_length",
                                     "total_bytes", "offset", "namespace"]))
    messages = list(put_requests(ns, hashes, [bytes(b) for b in blocks], 1 << 20))
    if mutation == "header_byte":
        position = draw(st.integers(0, 63))
        blocks[victim][position] = draw(st.integers(0, 255).filter(lambda v: v != blocks[victim][position]))
    elif mutation == "huge_shape":
        dim = draw(st.integers(0, 4))
        struct.pack_into("<Q", blocks[victim], 28 + 8 * dim, draw(st.integers(0, (1 << 64) - 1)))
    elif mutation == "truncate":
        del blocks[victim][draw(st.integers(0, len(blocks[victim]) - 1)):]
    elif mutation == "extend":
        blocks[victim] += draw(st.binary(min_size=1, max_size=64))
    if mutation in ("header_byte", "huge_shape", "truncate", "extend"):
        messages = list(put_requests(ns, hashes, [bytes(b) for b in blocks], 1 << 20))
    if mutation in ("hash_length", "total_bytes", "offset", "namespace"):
        head = pb.PutRequest.FromString(messages[victim])
        if mutation == "hash_length":
            head.block_hash = draw(st.binary(max_size=40).filter(lambda h: len(h) != 32))
        elif mutation == "total_bytes":
            head.total_bytes = draw(st.integers(0, (1 << 64) - 1).filter(lambda n: n != len(blocks[victim])))
        elif mutation == "offset":
            head.offset = draw(st.integers(1, (1 << 64) - 1))
        else:
            head.namespace.CopyFrom(draw(namespaces))
        messages[victim] = head.SerializeToString()
    return ns, hashes, messages, [mutation]


@settings(FUZZ, max_examples=85)
@given(case=put_streams())
def test_malformed_put_streams_store_nothing_of_themselves(fuzzed: Fuzzed, case: tuple) -> None:
    ns, hashes, messages, (mutation,) = case
    code = fuzzed.code(lambda: fuzzed.put(iter(messages), metadata=MD, timeout=30))
    assert code in {OK, INVALID, DENIED, EXHAUSTED}, mutation
    if mutation == "none":
        assert code is OK
    if code is not OK:
        assert fuzzed.lookup(ns, hashes) == 0, mutation  # no block of a refused Put was stored
    fuzzed.check_known_blocks()
