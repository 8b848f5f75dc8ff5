"""Client policies against real servers: deadlines, retries, the in-flight bound, error mapping, fork safety."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from typing import Iterator

import grpc
import pytest

from kvstore.client import InflightSlots, KVStoreClient, backoff_s
from kvstore.errors import InvalidArgumentError, KVStoreError, ResourceExhaustedError, UnavailableError
from kvstore.error_codes import DeadlineExceededError, RemoteError, error_of, status_of
from tests.support.redis import black_hole  # noqa: F401 - a fixture

from tests.support.server import ThreadedServer, kv_blocks, namespace


def _requests_total(server: ThreadedServer, method: str, code: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    match = re.search(rf'^kvstore_requests_total{{code="{code}",method="{method}"}} (\S+)$', text.decode(), re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.slow
def test_deadline_covers_a_server_that_never_answers(black_hole) -> None:  # noqa: F811
    for call in ("health", "stats", "lookup"):
        with KVStoreClient(f"127.0.0.1:{black_hole.port}", timeout_s=0.5, retries=3) as kv:
            with pytest.raises(DeadlineExceededError) as info:  # the connection never completes
                kv.lookup(namespace(), [b"\x00" * 16]) if call == "lookup" else getattr(kv, call)()
            assert isinstance(info.value, UnavailableError) and isinstance(info.value, TimeoutError)


def test_unavailable_is_retried_and_invalid_argument_is_not(fresh_server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 1)
    with KVStoreClient(fresh_server.target, retries=3, backoff_s=0.01, max_backoff_s=0.02) as kv:
        with pytest.raises(InvalidArgumentError, match="hashes"):
            kv.lookup(ns, hashes * 65)  # over the node's limits.max_hashes_per_request (64)
        assert _requests_total(fresh_server, "Lookup", "INVALID_ARGUMENT") == 1

        fresh_server.call(fresh_server.server.begin_shutdown())  # every call now gets UNAVAILABLE
        with pytest.raises(UnavailableError, match="shutting down"):
            kv.lookup(ns, hashes)
        assert _requests_total(fresh_server, "Lookup", "UNAVAILABLE") == 4  # 1 + 3 retries
        with pytest.raises(UnavailableError):
            kv.put(ns, hashes, tensors)
        assert _requests_total(fresh_server, "Put", "UNAVAILABLE") == 4  # put is idempotent: retried too


@pytest.mark.slow
def test_inflight_calls_are_bounded(server: ThreadedServer) -> None:
    from kvstore.client import calls, plan
    from kvstore.blocks.tensors import encode_block
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.wire import put_requests

    ns = namespace()
    hashes, tensors = kv_blocks(ns, 1)
    streaming, release = threading.Event(), threading.Event()
    with KVStoreClient(server.target, max_inflight=1, timeout_s=1.0, retries=0) as kv:
        messages = [pb.PutRequest.FromString(m) for m in put_requests(ns, hashes, [encode_block(tensors[0])], 1024)]

        def slow_stream() -> Iterator[object]:
            yield from messages[:-1]
            streaming.set()  # the call is in flight, holding the only slot
            release.wait(30)
            yield messages[-1]

        def put_for_long(channel: object) -> object:  # the holder's own deadline, past the other call's
            return lambda requests, timeout, metadata: channel.stub.Put(requests, timeout=30, metadata=metadata)

        holder_call = plan.Rpc(plan.REQUEST_STREAM, put_for_long, lambda: plan.RequestStream(iter(slow_stream())),
                               lambda reply: reply)
        holder = threading.Thread(target=lambda: kv.execute(plan.Plan({0: holder_call}, calls.first)))
        holder.start()
        try:
            assert streaming.wait(30)
            with pytest.raises(DeadlineExceededError, match="max_inflight=1"):
                kv.lookup(ns, hashes)
        finally:
            release.set()
            holder.join()
        assert kv.lookup(ns, hashes).num_blocks == 1  # the slot is free again


def test_error_mapping_round_trips() -> None:
    for error in (InvalidArgumentError("a"), ResourceExhaustedError("b"), UnavailableError("c"),
                  DeadlineExceededError("d")):
        code, message = status_of(error)
        assert type(error_of(code, message)) is type(error) and message == str(error)
    code, message = status_of(KeyError("secret"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message
    remote = error_of(grpc.StatusCode.UNAUTHENTICATED, "who?")
    assert isinstance(remote, RemoteError) and isinstance(remote, KVStoreError)
    assert remote.code == grpc.StatusCode.UNAUTHENTICATED


def test_backoff_is_exponential_with_full_jitter() -> None:
    samples = [backoff_s(attempt, 0.1, 1.0) for attempt in range(8) for _ in range(50)]
    assert all(0 <= s <= 1.0 for s in samples)
    assert max(backoff_s(0, 0.1, 1.0) for _ in range(200)) <= 0.1
    assert max(backoff_s(5, 0.1, 1.0) for _ in range(200)) > 0.1


# ---------------------------------------------------------------------- fork safety


# ---------------------------------------------------------------------- zero-copy Get replies

import torch  # noqa: E402

from kvstore.client import AsyncKVStoreClient  # noqa: E402
from kvstore.blocks.tensors import decode_block, encode_block  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.wire import chunk_bytes_for  # noqa: E402

from tests.support.server import MiB  # noqa: E402


def _small_and_large_blocks(ns: Namespace) -> tuple[list[bytes], list[torch.Tensor], list[bytes]]:
    """Two blocks that fit one message each, then one of 12 MiB that takes several."""
    hashes, tensors = kv_blocks(ns, 3)
    generator = torch.Generator().manual_seed(12)
    tensors[2] = torch.randn(4, 2, 8, 16, 6144, generator=generator).to(torch.float16)  # 12 MiB of payload
    blocks = [encode_block(t) for t in tensors]
    assert len(blocks[1]) <= chunk_bytes_for(4 * MiB) < len(blocks[2])
    return hashes, tensors, blocks


def _check_get_reply(got: list, tensors: list[torch.Tensor], blocks: list[bytes]) -> None:
    assert [type(b) for b in got] == [memoryview, memoryview, bytes]
    assert all(b.readonly for b in got[:2])
    assert got == blocks and [bytes(b) for b in got] == blocks
    for received, sent in zip(got, tensors):
        assert torch.equal(decode_block(received), sent)


@pytest.mark.slow
def test_get_lends_one_message_blocks_as_views_and_joins_larger_ones(server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors, blocks = _small_and_large_blocks(ns)
    with KVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=False, bulk=False) as client:  # gRPC's messages
        assert client.put(ns, hashes[:2], blocks[:2]) + client.put(ns, hashes[2:], blocks[2:]) == 3  # two shapes
        _check_get_reply(client.get(ns, hashes), tensors, blocks)
        for received, sent in zip(client.get_tensors(ns, hashes), tensors):
            assert torch.equal(received, sent)
        assert client.delete(ns, hashes) == 3


@pytest.mark.slow
async def test_async_get_lends_one_message_blocks_as_views_and_joins_larger_ones(server: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors, blocks = _small_and_large_blocks(ns)
    async with AsyncKVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=False, bulk=False) as kv:
        assert await kv.put(ns, hashes[:2], blocks[:2]) + await kv.put(ns, hashes[2:], blocks[2:]) == 3
        _check_get_reply(await kv.get(ns, hashes), tensors, blocks)
        for received, sent in zip(await kv.get_tensors(ns, hashes), tensors):
            assert torch.equal(received, sent)
        assert await kv.delete(ns, hashes) == 3


def test_a_view_from_get_stays_valid_after_later_calls(client: KVStoreClient) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    client.put(ns, hashes, tensors)
    first = client.get(ns, hashes[:1])[0]
    client.delete(ns, hashes)
    client.put(ns, *kv_blocks(ns, 2, first_token=1000))
    client.get(ns, kv_blocks(ns, 2, first_token=1000)[0])
    assert first == encode_block(tensors[0])  # the view holds its own message, not a server buffer


@pytest.mark.slow
def test_calls_in_flight_when_the_client_closes_raise_unavailable(server: ThreadedServer) -> None:
    """Regression: they raised RemoteError(CANCELLED, 'Channel closed!'), a status no caller handles."""
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 8, num_layers=8, num_kv_heads=8, head_dim=256)  # 2 MiB each
    with KVStoreClient(server.target, retries=0, timeout_s=30) as kv:
        kv.put(ns, hashes, tensors)
    errors: list[BaseException] = []
    for _ in range(3):
        kv = KVStoreClient(server.target, retries=0, timeout_s=30)
        started = threading.Event()

        def fetch(kv: KVStoreClient = kv, started: threading.Event = started) -> None:
            try:
                while True:
                    kv.get(ns, hashes)
                    started.set()  # connected, one Get done: the next is on its way as close() comes
            except KVStoreError as exc:
                errors.append(exc)

        thread = threading.Thread(target=fetch)
        thread.start()
        assert started.wait(30)
        kv.close()
        thread.join(30)
        assert not thread.is_alive()
    assert len(errors) == 3
    assert all(isinstance(e, UnavailableError) and "closed" in str(e) for e in errors), errors


@pytest.mark.slow
def test_inflight_slots_bound_the_calls_across_threads_and_time_out_when_full() -> None:
    slots = InflightSlots(2)
    active = peak = 0
    lock = threading.Lock()
    both_in = threading.Barrier(2, timeout=10)  # the two holders of a slot meet: overlap by events, not by time

    def work() -> None:
        nonlocal active, peak
        for _ in range(50):  # 6 threads x 50: an even number of holds, so every holder finds its partner
            assert slots.acquire(5.0)
            with lock:
                active += 1
                peak = max(peak, active)
            both_in.wait()
            with lock:
                active -= 1
            slots.release()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak == 2
    assert slots.acquire(0.01) and slots.acquire(0.01)
    start = time.monotonic()
    assert not slots.acquire(0.1)  # full: waits for its timeout, then gives up
    assert time.monotonic() - start >= 0.1
    waiter = threading.Thread(target=lambda: slots.acquire(5.0))
    waiter.start()
    slots.release()  # wakes the waiter
    waiter.join(2.0)
    assert not waiter.is_alive()
