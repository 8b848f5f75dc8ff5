"""A Get stream whose client deadline passes mid-stream is counted as DEADLINE_EXCEEDED, not INTERNAL.

Regression: grpc.aio may fail the handler's ``context.write`` with ``ExecuteBatchError`` rather than
cancel it; ``_Call.__aexit__`` now asks the context whether the call ended before mapping an error.
"""
import time

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from kvstore.client import KVStoreClient
from kvstore.codec import encode_block
from kvstore.server.wire import namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from tests.server.conftest import MiB, ThreadedServer, make_config, namespace


def _get_codes(server):
    lines = generate_latest(server.server.metrics.registry).decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("kvstore_requests_total{") and 'method="Get"' in line:
            code = line.split('code="')[1].split('"')[0]
            out[code] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_get_stream_ended_by_the_client_is_counted_with_its_code(how: str) -> None:
    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": "64MiB"}))
    try:
        ns = namespace(layout="mla", dtype="uint8", block_size=1)
        hashes = [bytes([i]) * 16 for i in range(1, 5)]
        blocks = [encode_block(torch.full((1, 1, 1, 12 * MiB), i, dtype=torch.uint8), "mla") for i in range(4)]
        with KVStoreClient(server.target, retries=0) as kv:
            kv.put(ns, hashes, blocks)
        channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 4 * MiB),
                                                            ("grpc.http2.bdp_probe", 0)])  # a fixed window: stalls
        get = channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
                                   response_deserializer=lambda b: b)
        request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes)
        for _ in range(5):
            stream = get(request, timeout=0.2 if how == "deadline" else None)
            next(stream)                       # the server is now blocked in context.write (flow control)
            if how == "cancel":
                stream.cancel()
            else:
                time.sleep(0.3)
            with pytest.raises(grpc.RpcError):
                list(stream)
        channel.close()
        expected = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"
        deadline = time.monotonic() + 10
        while sum(_get_codes(server).values()) < 5 and time.monotonic() < deadline:  # handlers finish after
            time.sleep(0.02)
        codes = _get_codes(server)
        assert "INTERNAL" not in codes, codes
        assert codes.get(expected) == 5, codes
    finally:
        server.stop()
