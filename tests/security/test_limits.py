"""Limits on a real server: hashes per request, block bytes, calls in flight per connection, bytes per tenant."""

from __future__ import annotations

import asyncio
import threading
from typing import Iterator

import grpc
import pytest

from kvstore.errors import ResourceExhaustedError
from kvstore.keys import Namespace
from kvstore.security import bearer_metadata
from kvstore.error_codes import DeadlineExceededError
from kvstore.server.inflight import InflightLimiter
from kvstore.server.quota import TenantQuota
from kvstore.server.watchdog import StreamWatchdog
from kvstore.wire import namespace_to_pb, put_requests
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.support.clock import FakeClock, turns_until
from tests.support.server import ThreadedServer, encoded, kv_blocks
from tests.support.waiting import wait_until

from tests.support.security import TOKEN_A, TOKEN_B, auth_config, client_of, raw_channel, sha_namespace

KiB = 1 << 10


def _code(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


# ---------------------------------------------------------------- pure logic


def test_inflight_limiter_counts_per_peer() -> None:
    limiter = InflightLimiter(2)
    limiter.acquire("ipv4:1"), limiter.acquire("ipv4:1"), limiter.acquire("ipv4:2")
    with pytest.raises(ResourceExhaustedError, match="max_inflight_per_connection=2"):
        limiter.acquire("ipv4:1")
    limiter.release("ipv4:1")
    limiter.acquire("ipv4:1")
    for peer in ("ipv4:1", "ipv4:1", "ipv4:2"):
        limiter.release(peer)
    assert limiter.snapshot() == {} and limiter.num_connections == 0


def test_tenant_quota_sums_namespaces_and_holds_puts_in_progress() -> None:
    held: dict[bytes, int] = {}
    quota = TenantQuota(100, lambda tag: held.get(tag, 0))
    ns1, ns2, other = Namespace("m1", cache_salt="t"), Namespace("m2", cache_salt="t"), Namespace("m1", cache_salt="u")
    with quota.reserve(ns1, 60):
        held[ns1.tag] = 60
        with pytest.raises(ResourceExhaustedError, match="tenant_quota_bytes=100"):
            with quota.reserve(ns2, 41):  # 60 stored + 60 in progress already
                pass
        with quota.reserve(other, 100):  # another tenant has its own quota
            pass
    with quota.reserve(ns2, 40):
        held[ns2.tag] = 40
    assert quota.used_bytes("t") == 100
    with pytest.raises(ResourceExhaustedError):
        with quota.reserve(ns1, 1):
            pass
    held[ns1.tag] = 0  # deleted
    assert quota.used_bytes("t") == 40


async def test_stream_watchdog_ends_a_stream_past_its_limit_and_only_that_one() -> None:
    clock = FakeClock()
    watchdog = StreamWatchdog(0.2, clock=clock, sleep=clock.sleep)
    assert watchdog.check_every_s == 0.05
    release_quick = asyncio.Event()

    async def stream(until: asyncio.Event) -> str:
        async with watchdog.watch("Get"):
            await until.wait()
        return "done"

    stalled = asyncio.create_task(stream(asyncio.Event()))  # never set: a reader that stalls
    quick = asyncio.create_task(stream(release_quick))
    await turns_until(lambda: watchdog.num_open == 2 and clock.num_sleeping == 1)
    clock.advance(0.15)  # within the limit: both still run
    await turns_until(lambda: clock.num_sleeping == 1)
    release_quick.set()
    assert await quick == "done"
    assert not stalled.done()
    clock.advance(0.1)  # 0.25 s: past the limit
    with pytest.raises(DeadlineExceededError, match=r"Get stream took longer than limits.max_stream_s=0.2 s"):
        await stalled
    assert not stalled.cancelled() and stalled.cancelling() == 0  # the watchdog's cancellation became the error
    assert watchdog.num_open == 0
    watchdog.close()


async def test_a_watch_opened_soon_starts_at_the_first_wait_and_ends_a_stalled_stream() -> None:
    clock = FakeClock()
    watchdog = StreamWatchdog(0.2, clock=clock, sleep=clock.sleep)

    async def stream(until: asyncio.Event | None) -> str:
        watch = watchdog.watch("Get").open_soon()
        assert watchdog.num_open == 0  # not yet: the watch starts once the task first waits
        try:
            if until is not None:
                await until.wait()
        except asyncio.CancelledError:
            if watch.close(asyncio.CancelledError):
                raise watch.error() from None
            raise
        assert not watch.close(None)
        return "done"

    assert await stream(None) == "done"  # left before it ever waited: never watched, nothing left behind
    await asyncio.sleep(0)  # one turn of the loop, the turn in which open_soon's (cancelled) open would have run
    assert watchdog.num_open == 0
    stalled = asyncio.create_task(stream(asyncio.Event()))
    await turns_until(lambda: watchdog.num_open == 1 and clock.num_sleeping == 1)
    clock.advance(0.2)
    with pytest.raises(DeadlineExceededError, match="max_stream_s=0.2"):
        await stalled
    released = asyncio.Event()
    released.set()
    assert await stream(released) == "done"
    assert watchdog.num_open == 0
    watchdog.close()


async def test_stream_watchdog_leaves_an_outside_cancellation_alone_and_stops_when_idle() -> None:
    clock = FakeClock()
    watchdog = StreamWatchdog(10, clock=clock, sleep=clock.sleep)
    inside = asyncio.Event()

    async def stream() -> None:
        async with watchdog.watch("Put"):
            inside.set()
            await asyncio.Event().wait()  # stalls until cancelled

    task = asyncio.create_task(stream())
    await inside.wait()
    assert watchdog.num_open == 1 and len(asyncio.all_tasks()) == 3  # this test, the stream, the watchdog's timer
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and watchdog.num_open == 0
    await turns_until(lambda: clock.num_sleeping == 1)
    clock.advance(watchdog.check_every_s)
    await turns_until(lambda: asyncio.all_tasks() == {asyncio.current_task()})  # no stream open: the timer ended
    async with watchdog.watch("Get"):  # and starts again with the next stream
        assert len(asyncio.all_tasks()) == 2
    watchdog.close()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


def test_stream_watchdog_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="limit_s must be > 0"):
        StreamWatchdog(0)


# ---------------------------------------------------------------- a real server


def test_too_many_hashes_is_invalid_argument_and_big_block_is_exhausted() -> None:
    threaded = ThreadedServer(auth_config(**{"limits.max_hashes_per_request": 4, "store.max_block_bytes": 64 * KiB}))
    try:
        ns = sha_namespace("tenant-a")
        md = bearer_metadata(TOKEN_A)
        with raw_channel(threaded) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            code, details = _code(lambda: stub.Lookup(
                pb.LookupRequest(namespace=namespace_to_pb(ns), block_hashes=[b"\0" * 32] * 5), metadata=md))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_hashes_per_request=4" in details
            put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                                       response_deserializer=pb.PutResponse.FromString)
            big = [pb.PutRequest(namespace=namespace_to_pb(ns), block_hash=b"\1" * 32, total_bytes=65 * KiB,
                                 data=b"x").SerializeToString()]
            code, details = _code(lambda: put(iter(big), metadata=md))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_block_bytes" in details
    finally:
        threaded.stop()


def test_a_put_stream_over_max_put_bytes_is_exhausted_and_stores_nothing() -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 4)
    blocks = encoded(ns, tensors)
    threaded = ThreadedServer(auth_config(**{"limits.max_put_bytes": 3 * len(blocks[0]) + 100}))
    try:
        with client_of(threaded, TOKEN_A) as kv:
            with pytest.raises(ResourceExhaustedError, match="max_put_bytes"):
                kv.put(ns, hashes, blocks)
            assert kv.lookup(ns, hashes).num_blocks == 0
            assert kv.put(ns, hashes[:3], blocks[:3]) == 3  # under the limit: stored
    finally:
        threaded.stop()


def test_calls_in_flight_are_limited_per_connection() -> None:
    threaded = ThreadedServer(auth_config(**{"limits.max_inflight_per_connection": 2}))
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 2)
    messages = list(put_requests(ns, hashes, encoded(ns, tensors), 1 << 20))
    md = bearer_metadata(TOKEN_A)
    release = threading.Event()

    def held_open(first: bytes) -> Iterator[bytes]:
        yield first
        release.wait(30)  # the stream stays open, so the call stays in flight

    try:
        with raw_channel(threaded) as channel, raw_channel(threaded) as other_channel:
            put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                                       response_deserializer=pb.PutResponse.FromString)
            futures = [put.future(held_open(messages[0]), metadata=md, timeout=30) for _ in range(2)]

            def inflight() -> list[int]:
                async def read() -> list[int]:
                    return list(threaded.server.admission.inflight.snapshot().values())
                return threaded.call(read())

            wait_until(lambda: inflight() == [2], 20, "both Puts in flight on one connection")
            lookup = pb.LookupRequest(namespace=namespace_to_pb(ns), block_hashes=hashes)
            code, details = _code(lambda: pb_grpc.KVStoreStub(channel).Lookup(lookup, metadata=md, timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight_per_connection=2" in details
            reply = pb_grpc.KVStoreStub(other_channel).Lookup(lookup, metadata=md, timeout=10)  # its own connection
            assert reply.num_blocks == 0
            release.set()
            assert [f.result(timeout=30).num_blocks for f in futures] == [1, 1]
            assert pb_grpc.KVStoreStub(channel).Lookup(lookup, metadata=md, timeout=10).num_blocks == 1
            # a call's slot comes back when gRPC has sent its status, a moment after the client has it
            wait_until(lambda: inflight() == [], 20, "every slot back once the calls have ended")
    finally:
        release.set()
        threaded.stop()


def test_tenant_quota_refuses_a_put_over_it_and_stores_nothing_of_it() -> None:
    ns_a, ns_a2, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-a"), sha_namespace("tenant-b")
    hashes, tensors = kv_blocks(ns_a, 4)
    footprint = len(encoded(ns_a, tensors[:1])[0]) + BLOCK_OVERHEAD_BYTES  # one block in the node's heap tier
    threaded = ThreadedServer(auth_config(**{"limits.tenant_quota_bytes": 3 * footprint + footprint // 2}))
    try:  # 3 blocks fit, a 4th does not
        with client_of(threaded, TOKEN_A) as a, client_of(threaded, TOKEN_B) as b:
            assert a.put(ns_a, hashes[:3], tensors[:3]) == 3
            with pytest.raises(ResourceExhaustedError, match="tenant_quota_bytes"):
                a.put(ns_a, hashes[3:], tensors[3:])
            assert a.lookup(ns_a, hashes).num_blocks == 3  # the refused block was not stored
            hashes2, tensors2 = kv_blocks(ns_a2, 1)
            with pytest.raises(ResourceExhaustedError):  # the quota spans all of a tenant's namespaces
                a.put(ns_a2, hashes2, tensors2)
            hashes_b, tensors_b = kv_blocks(ns_b, 3)
            assert b.put(ns_b, hashes_b, tensors_b) == 3  # another tenant has its own quota
            assert a.delete(ns_a, hashes[2:3]) == 1
            assert a.put(ns_a2, hashes2, tensors2) == 1  # room again
    finally:
        threaded.stop()
