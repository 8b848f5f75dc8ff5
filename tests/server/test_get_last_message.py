"""The unary-registered Get, whose last message leaves with the status, when its client goes away; ``add_reply``.

The last message of a Get is no longer written by the handler: it goes out in
grpc.aio's own final batch, after the handler (and ``GrpcCall``) returned. A
client that cancels, or whose deadline passes, while that message waits on
flow control must still be counted as CANCELLED / DEADLINE_EXCEEDED and must
not make gRPC log an ERROR.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from typing import Any

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.wire import BlockAssembler, chunk_bytes_for, iter_block_chunks, namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb

from kvstore.server.servicer import KVStoreServicer
from tests.support.server import MiB, ThreadedServer, finished_calls, make_config, namespace, scrape
from tests.support.waiting import wait_until

NUM_STALLED = 8


def _stalled_gets(server: ThreadedServer, timeout: float | None) -> tuple[grpc.Channel, list[Any]]:
    """Gets of one 3 MiB block (one message) on a channel with a small receive window, never read."""
    ns = namespace(layout="mla", dtype="uint8", block_size=1)
    hashes = [b"\x07" * 16]
    with KVStoreClient(server.target, retries=0, shared_memory=False, bulk=False) as kv:  # gRPC's Get: its last message
        kv.put(ns, hashes, [encode_block(torch.full((1, 1, 1, 3 * MiB), 7, dtype=torch.uint8), "mla")])
        assert len(kv.get(ns, hashes)) == 1  # the check Get: the block is served whole
    assert finished_calls(server, "Get", 1) == 1  # counted once sent: before the stalled Gets, not among them
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 4 * MiB),
                                                            ("grpc.http2.bdp_probe", 0)])
    get = channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
                               response_deserializer=lambda b: b)
    request = pb.GetRequest(namespace=namespace_to_pb(ns), block_hashes=hashes)
    return channel, [get(request, timeout=timeout) for _ in range(NUM_STALLED)]


def _get_counts(server: ThreadedServer) -> dict[str, float]:
    return {k: v for k, v in scrape(server).items() if k.startswith("kvstore_requests_total") and "Get" in k}


@pytest.mark.slow
@pytest.mark.parametrize("how, code", [("cancel", "CANCELLED"), ("deadline", "DEADLINE_EXCEEDED")])
def test_a_get_ended_by_its_client_while_its_last_message_waits_is_counted_as_such_and_logs_no_error(
        how: str, code: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    returned, lock = threading.Event(), threading.Lock()
    num_returned = [0]
    real_get = KVStoreServicer.Get

    async def get(self: KVStoreServicer, raw: Any, context: Any) -> Any:  # the handler, noting when it has returned
        reply = await real_get(self, raw, context)
        with lock:
            num_returned[0] += 1
            if num_returned[0] == NUM_STALLED + 1:  # the put's check Get excluded: see _stalled_gets
                returned.set()
        return reply

    monkeypatch.setattr(KVStoreServicer, "Get", get)
    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": "64MiB"}))
    try:
        with caplog.at_level(logging.WARNING):
            channel, streams = _stalled_gets(server, timeout=1.0 if how == "deadline" else None)
            # every Get's handler has returned: its one message now waits for the reader's flow-control window
            assert returned.wait(30)
            assert _get_counts(server) == {'kvstore_requests_total{code="OK",method="Get"}': 1.0}  # the check Get
            if how == "cancel":
                for stream in streams:
                    stream.cancel()
            wait_until(lambda: sum(_get_counts(server).values()) == NUM_STALLED + 1, 30,
                       "every stalled Get counted, once its client has ended it")
            channel.close()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []  # was: "ExecuteBatchError raised in core by servicer method [.../Get]", once per Get
        counts = _get_counts(server)
        # A Get whose failed batch grpc.aio reports (its log record, which the node turns into DEBUG) counts as
        # CANCELLED or DEADLINE_EXCEEDED (a deadline the node sees a little late, since it runs from the request's
        # arrival, reads as the client's cancellation). One whose close grpc.aio saw first is dropped without a
        # word, and counts as OK (``GrpcCall._finish``): which comes first is up to gRPC's core, not the test.
        assert {re.search(r'code="(\w+)"', k).group(1) for k in counts} <= {code, "CANCELLED", "OK"}  # type: ignore[union-attr]
        assert sum(counts.values()) == NUM_STALLED + 1  # each stalled Get once, and the check Get
    finally:
        server.stop()


async def test_a_reply_grpc_reports_lost_is_counted_as_ended_by_the_client() -> None:
    """The accounting behind the test above, with no race: a task whose lost reply grpc.aio logged is counted
    CANCELLED, or DEADLINE_EXCEEDED once its deadline has passed; the log record becomes one DEBUG line."""
    from kvstore.server import call as call_module
    from kvstore.server.metrics import ServiceMetrics

    class Context:
        def __init__(self, remaining: float | None) -> None:
            self.remaining = remaining

        def cancelled(self) -> bool:
            return False

        def time_remaining(self) -> float | None:
            return self.remaining

    class Servicer:
        admission = type("Admission", (), {"release": staticmethod(lambda ticket: None)})()
        metrics = ServiceMetrics()

    lost = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 0,
                             f"{call_module.ReplyLostFilter.PREFIX}Get]", None, None)

    async def call_whose_reply_is_lost(remaining: float | None) -> None:
        call_module.REPLY_LOST.filter(lost)  # the record grpc.aio logs inside the call's task
        call = call_module.GrpcCall(Servicer(), "Get", Context(remaining))  # type: ignore[arg-type]
        call._start_s = 0.0
        asyncio.current_task().add_done_callback(call._finish)  # type: ignore[union-attr]

    await asyncio.ensure_future(call_whose_reply_is_lost(None))
    await asyncio.ensure_future(call_whose_reply_is_lost(0.0))
    await asyncio.sleep(0)  # the done callbacks run on the next turn
    counts = dict(Servicer.metrics.calls._calls)
    assert counts == {("Get", "CANCELLED"): 1, ("Get", "DEADLINE_EXCEEDED"): 1}
    assert lost.levelno == logging.DEBUG


def test_add_reply_skips_an_empty_message_after_a_chunked_block() -> None:
    """The .proto: an empty BlockChunk carries no block and is skipped, wherever it comes."""
    block = b"r" * 25
    assembler = BlockAssembler(1000, 2, copy=False)
    for message in iter_block_chunks([block], 10):
        assembler.add_reply(message)
    assembler.add_reply(b"")  # was: opened a phantom 0-byte block
    assert assembler.finish() == [block]
    full = BlockAssembler(1000, 1, copy=False)
    for message in iter_block_chunks([block], 10):
        full.add_reply(message)
    full.add_reply(b"")  # was: InvalidArgumentError "more than max_hashes_per_request=1 blocks"
    assert full.finish() == [block]
