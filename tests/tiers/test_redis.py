"""The Redis tier against real redis-server processes and a real 3-node Redis Cluster, and its circuit breaker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest

from kvstore.config import RedisTierConfig
from kvstore.errors import ConfigError, UnavailableError
from kvstore.keys import Namespace, block_key
from kvstore.tiers.breaker import BreakerState, CircuitBreaker
from kvstore.tiers.redis import CHUNK_BYTES, RedisTier
from tests.support.clock import FakeClock
from tests.support.redis import (  # noqa: F401 - fixtures are used by name
    BlackHole,
    RedisClusterProcess,
    RedisProcess,
    black_hole,
    make_tls_files,
    redis_binaries,
    redis_cluster,
    redis_cluster_session,
    redis_server,
)
from tests.support.tier_contract import TierContract, make_block, make_key, make_sized_block, meta

MiB = 1 << 20

pytestmark = pytest.mark.skipif(redis_binaries() is None, reason="redis-server / redis-cli not installed")


def tier_config(url: str, **overrides: object) -> RedisTierConfig:
    """A tier config with short timeouts and a fast breaker, for tests."""
    fields: dict[str, object] = {
        "url": url, "connect_timeout_s": 2.0, "socket_timeout_s": 2.0,  # a loaded machine answers in time
        "breaker_failures": 3, "breaker_reset_s": 0.2,
    }
    fields.update(overrides)
    return RedisTierConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
async def redis_tier(redis_server: RedisProcess) -> AsyncIterator[RedisTier]:
    tier = RedisTier(tier_config(redis_server.url))
    yield tier
    await tier.close()


# -- the shared contract ----------------------------------------------------------------------


class _RedisContractOverrides(TierContract):
    """The contract, with its ``resident()``-based checks restated for a tier that the store does not index.

    The Redis tier lists nothing in ``resident()`` by design (other nodes write to
    Redis; the store asks it instead), and Redis keeps no priorities. The
    overridden tests check the same behaviour through ``get`` and ``contains``.
    """

    async def test_put_of_a_held_key_replaces_value_and_meta(self, tier: RedisTier) -> None:
        key = make_key(0)
        first, second = make_block(1), make_block(2, shape=(2, 2, 4, 16, 8))
        await tier.put([key], [first], [meta(10)])
        assert await tier.put([key], [second], [meta(90)]) == [True]
        assert await tier.get([key]) == [second]
        assert await tier.resident() == []

    async def test_last_occurrence_of_a_key_in_one_batch_wins(self, tier: RedisTier) -> None:
        key, other = make_key(0), make_key(1)
        first, second, third = make_block(1), make_block(2), make_block(3)
        assert await tier.put([key, other, key], [first, third, second], [meta(20), meta(), meta(70)]) == [True] * 3
        assert await tier.get([key, other]) == [second, third]

    async def test_concurrent_puts_of_one_key_both_succeed_and_store_one_whole_value(self, tier: RedisTier) -> None:
        key = make_key(0)
        first, second = make_block(1, shape=(4, 2, 8, 16, 64)), make_block(2, shape=(4, 2, 8, 16, 64))
        results = await asyncio.gather(tier.put([key], [first], [meta()]), tier.put([key], [second], [meta()]))
        assert results == [[True], [True]]
        [got] = await tier.get([key])
        assert got in (first, second)

    async def test_a_delete_takes_effect_when_called_so_a_later_put_survives_it(self, tier: RedisTier) -> None:
        """Not so here: the shared tier's delete is a best-effort ``UNLINK`` on the wire, which the store never
        orders against its own writes (``docs/redis.md``); a delete awaited before the put is what holds."""
        key, value = make_key(0), make_block(0)
        await tier.put([key], [value], [meta()])
        await tier.delete([key])
        assert await tier.get([key]) == [None]
        assert await tier.put([key], [value], [meta()]) == [True]
        assert await tier.get([key]) == [value]

    async def test_resident_lists_every_block_held_with_its_meta(self, tier: RedisTier) -> None:
        keys = [make_key(i) for i in range(3)]
        await tier.put(keys, [make_block(i) for i in range(3)], [meta()] * 3)
        assert await tier.resident() == []  # not indexed: see RedisTier's docstring
        assert await tier.contains(keys) == [True] * 3


class TestRedisTierContract(_RedisContractOverrides):
    @pytest.fixture
    async def tier(self, redis_server: RedisProcess) -> AsyncIterator[RedisTier]:
        tier = RedisTier(tier_config(redis_server.url))
        yield tier
        await tier.close()


@pytest.mark.slow
class TestRedisClusterTierContract(_RedisContractOverrides):
    @pytest.fixture
    async def tier(self, redis_cluster: RedisClusterProcess) -> AsyncIterator[RedisTier]:
        tier = RedisTier(tier_config(redis_cluster.url, cluster=True))
        yield tier
        await tier.close()

    async def test_keys_spread_over_every_node_and_clear_scans_them_all(self, tier: RedisTier,
                                                                      redis_cluster: RedisClusterProcess) -> None:
        keys = [make_key(i) for i in range(64)]
        assert await tier.put(keys, [make_block(i) for i in range(64)], [meta()] * 64) == [True] * 64
        per_node = []
        for node in redis_cluster.nodes:
            with node.client() as client:
                per_node.append(client.dbsize())
        assert sum(per_node) == 64 and all(n > 0 for n in per_node)
        generation = await tier.clear_namespace(keys[0][:8])
        assert await tier.contains(keys) == [False] * 64  # at once, on every node: the keys' generation is old
        assert await tier.sweep_namespace(keys[0][:8], generation) == 64


# -- keys, values, TTL, corruption, size limits --------------------------------------------


async def test_keys_have_the_documented_form_and_values_are_the_codec_bytes(
    redis_tier: RedisTier, redis_server: RedisProcess
) -> None:
    namespace = Namespace("tests/redis-form")
    block_hash = bytes(range(16))
    key = block_key(namespace, block_hash)
    value = make_block(7)
    assert await redis_tier.put([key], [value], [meta()]) == [True]
    expected = f"kvstore:{namespace.tag.hex()}:0:{block_hash.hex()}"  # generation 0: never cleared
    assert redis_tier.redis_key(key) == expected
    with redis_server.client() as client:
        assert client.keys("*") == [expected.encode()]
        assert client.get(expected) == value
        assert client.pttl(expected) == -1  # no TTL unless configured


@pytest.mark.slow
async def test_ttl_is_set_when_configured(redis_server: RedisProcess) -> None:
    tier = RedisTier(tier_config(redis_server.url, ttl_s=30.0, prefix="ttl"))
    try:
        key = make_key(1)
        assert await tier.put([key], [make_block(1)], [meta()]) == [True]
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.redis_key(key)) <= 30_000
    finally:
        await tier.close()


@pytest.mark.parametrize("damage", ["flip_payload_byte", "not_a_block", "truncated"])
async def test_a_corrupt_value_is_a_miss_and_is_deleted_and_counted(
    redis_tier: RedisTier, redis_server: RedisProcess, damage: str
) -> None:
    good_key, bad_key = make_key(1), make_key(2)
    value = make_block(2)
    await redis_tier.put([good_key, bad_key], [make_block(1), value], [meta()] * 2)
    damaged = {
        "flip_payload_byte": value[:-1] + bytes([value[-1] ^ 0x01]),
        "not_a_block": b"hello",
        "truncated": value[:-2],
    }[damage]
    with redis_server.client() as client:
        client.set(redis_tier.redis_key(bad_key), damaged)
    assert await redis_tier.get([good_key, bad_key]) == [make_block(1), None]
    assert redis_tier.counters()["corrupt_records"] == 1
    with redis_server.client() as client:
        assert client.exists(redis_tier.redis_key(bad_key)) == 0
        assert client.exists(redis_tier.redis_key(good_key)) == 1


@pytest.mark.parametrize("damage", ["dtype", "flags", "padding", "checksum"])
async def test_a_value_with_a_damaged_header_is_a_miss_and_is_deleted(
    redis_tier: RedisTier, redis_server: RedisProcess, damage: str
) -> None:
    """Regression (issue 18, finding 1): a flipped flags or padding byte was served, the checksum covering the
    payload alone; the dtype (float16 as bfloat16) only the store's namespace check caught."""
    key, value = make_key(3), make_block(3)
    await redis_tier.put([key], [value], [meta()])
    damaged = bytearray(value)
    damaged[{"dtype": 6, "flags": 9, "padding": 100, "checksum": 21}[damage]] ^= 0x01
    with redis_server.client() as client:
        client.set(redis_tier.redis_key(key), bytes(damaged))
    assert await redis_tier.get([key]) == [None]
    assert redis_tier.counters()["corrupt_records"] == 1
    with redis_server.client() as client:
        assert client.exists(redis_tier.redis_key(key)) == 0


async def test_a_block_of_another_format_version_is_a_miss_left_in_place(
    redis_tier: RedisTier, redis_server: RedisProcess
) -> None:
    """A node of another release sharing the Redis wrote it: not served, not deleted, counted."""
    key, value = make_key(4), bytearray(make_block(4))
    value[4:6] = (1).to_bytes(2, "little")  # codec version 1
    with redis_server.client() as client:
        client.set(redis_tier.redis_key(key), bytes(value))
    assert await redis_tier.get([key]) == [None]
    assert redis_tier.counters()["foreign_records"] == 1 and redis_tier.counters()["corrupt_records"] == 0
    with redis_server.client() as client:
        assert client.exists(redis_tier.redis_key(key)) == 1


async def test_a_value_over_max_value_bytes_is_refused_before_sending(redis_server: RedisProcess) -> None:
    tier = RedisTier(tier_config(redis_server.url, max_value_bytes=64 * 1024))
    try:
        small, big = make_sized_block(1, 4096), make_sized_block(2, 64 * 1024 + 64)
        keys = [make_key(1), make_key(2)]
        assert await tier.put(keys, [small, big], [meta()] * 2) == [True, False]
        assert tier.counters()["oversized"] == 1
        with redis_server.client() as client:
            assert client.exists(tier.redis_key(keys[1])) == 0
            assert client.dbsize() == 1
    finally:
        await tier.close()


async def test_the_servers_proto_max_bulk_len_is_respected() -> None:
    with RedisProcess(extra_args=["--proto-max-bulk-len", "1mb"]) as server:
        tier = RedisTier(tier_config(server.url))  # max_value_bytes is 512 MiB by default
        try:
            keys = [make_key(1), make_key(2)]
            values = [make_sized_block(1, MiB - 4096), make_sized_block(2, MiB + 4096)]
            assert await tier.put(keys, values, [meta()] * 2) == [True, False]
            assert tier.counters()["oversized"] == 1
            assert tier.counters()["errors"] == 0  # refused here, not by the server
            with server.client() as client:
                assert client.exists(tier.redis_key(keys[1])) == 0
        finally:
            await tier.close()


@pytest.mark.slow
async def test_batches_larger_than_a_chunk_round_trip(redis_tier: RedisTier) -> None:
    num_blocks = CHUNK_BYTES // (512 * 1024) + 5  # more than one chunk of 512 KiB values
    keys = [make_key(i) for i in range(num_blocks)]
    values = [make_sized_block(i, 512 * 1024) for i in range(num_blocks)]
    assert await redis_tier.put(keys, values, [meta()] * num_blocks) == [True] * num_blocks
    assert await redis_tier.get(keys) == values
    assert await redis_tier.get(list(reversed(keys))) == list(reversed(values))


@pytest.mark.slow
async def test_clear_namespace_removes_only_that_namespace(redis_tier: RedisTier) -> None:
    ns_a, ns_b = Namespace("tests/a"), Namespace("tests/b")
    keys_a = [make_key(i, ns_a) for i in range(2500)]  # more than one SCAN batch
    keys_b = [make_key(i, ns_b) for i in range(3)]
    block = make_block(0)
    await redis_tier.put(keys_a + keys_b, [block] * (len(keys_a) + 3), [meta()] * (len(keys_a) + 3))
    generation = await redis_tier.clear_namespace(ns_a.tag)
    assert generation == 1
    assert await redis_tier.contains(keys_a[:5] + keys_b) == [False] * 5 + [True] * 3
    assert await redis_tier.put(keys_a[:1], [block], [meta()]) == [True]  # a put after the clear: the new generation
    assert await redis_tier.sweep_namespace(ns_a.tag, generation) == len(keys_a)  # the old keys only
    assert await redis_tier.contains(keys_a[:2] + keys_b) == [True, False] + [True] * 3
    assert await redis_tier.clear_namespace(ns_a.tag) == 2
    assert await redis_tier.sweep_namespace(ns_a.tag, 2) == 1


async def test_a_clear_on_one_tier_is_seen_by_another_at_its_next_call(redis_server: RedisProcess) -> None:
    """Two nodes' tiers over one Redis: a clear through one moves the namespace on for both, with no message between
    them. A get under an old generation is made again under the new one; a write under it lands where nothing
    reads, is unlinked and counted as skipped, and teaches the tier the new generation."""
    ns = Namespace("tests/two-nodes")
    keys = [make_key(i, ns) for i in range(4)]
    block = make_block(0)
    node_a, node_b = RedisTier(tier_config(redis_server.url)), RedisTier(tier_config(redis_server.url))
    try:
        assert await node_a.put(keys, [block] * 4, [meta()] * 4) == [True] * 4
        assert await node_b.get(keys[:2]) == [block] * 2 and node_b.generation(ns.tag) == 0
        assert await node_a.clear_namespace(ns.tag) == 1
        assert await node_b.get(keys) == [None] * 4  # node b still knew generation 0: it read it again
        assert node_b.generation(ns.tag) == 1 and node_b.counters()["stale_generation"] == 1
        node_c = RedisTier(tier_config(redis_server.url))  # a node that never saw the namespace writes under 0 first
        assert await node_c.put(keys[:1], [block], [meta()]) == [False]
        assert node_c.generation(ns.tag) == 1 and node_c.counters()["skipped_writes"] == 1
        assert await node_a.get(keys[:1]) == [None]
        assert await node_c.put(keys[:1], [block], [meta()]) == [True]
        assert await node_a.get(keys[:1]) == [block]
        with redis_server.client() as client:  # node c unlinked its stale write (key 0); the old keys wait for the sweep
            assert [client.exists(node_a.redis_key(key, 0)) for key in keys] == [0, 1, 1, 1]
        assert await node_a.sweep_namespace(ns.tag, 1) == 3
        await node_c.close()
    finally:
        await node_a.close()
        await node_b.close()


# -- failures never reach the caller -------------------------------------------------------


async def test_oom_from_a_full_server_refuses_the_put_without_raising() -> None:
    with RedisProcess(maxmemory_bytes=3 * MiB, maxmemory_policy="noeviction") as server:
        tier = RedisTier(tier_config(server.url))
        try:
            keys = [make_key(i) for i in range(12)]
            values = [make_sized_block(i, 512 * 1024) for i in range(12)]
            stored = []
            for key, value in zip(keys, values):  # one at a time: the server checks memory before each write
                stored += await tier.put([key], [value], [meta()])
            assert not all(stored)
            counts = tier.counters()
            assert counts["oom_rejected"] == stored.count(False) > 0
            assert tier.breaker_state is BreakerState.CLOSED  # a full server is up
            written = [k for k, ok in zip(keys, stored) if ok]
            assert await tier.get(written) == [v for v, ok in zip(values, stored) if ok]
        finally:
            await tier.close()


async def test_redis_killed_mid_loop_opens_the_breaker_and_writes_resume_after_restart() -> None:
    with RedisProcess() as server:
        clock = FakeClock()
        tier = RedisTier(tier_config(server.url, breaker_failures=3, breaker_reset_s=0.2), breaker_clock=clock)
        try:
            value = make_block(1)
            for i in range(60):
                if i == 20:
                    server.kill()
                key = make_key(i)
                stored = await tier.put([key], [value], [meta()])
                got = await tier.get([key])
                assert await tier.contains([key]) == [stored[0]]
                assert got == ([value] if stored[0] else [None])
                await tier.delete([make_key(1000 + i)])
                if i < 20:
                    assert stored == [True]
            counts = tier.counters()
            assert counts["errors"] >= 3
            assert counts["breaker_trips"] >= 1 and counts["breaker_open"] > 0
            assert tier.breaker_state in (BreakerState.OPEN, BreakerState.HALF_OPEN)
            assert not await tier.ping()

            server.start()  # same port
            for _ in range(10):  # each try past breaker_reset_s: its call is the trial
                clock.advance(0.2)
                if await tier.put([make_key(500)], [value], [meta()]) == [True]:
                    break
            else:
                pytest.fail("writes did not resume after Redis restarted")
            assert tier.breaker_state is BreakerState.CLOSED
            assert await tier.get([make_key(500)]) == [value]
        finally:
            await tier.close()


async def test_ping_closes_the_breaker_when_redis_is_back() -> None:
    with RedisProcess() as server:
        tier = RedisTier(tier_config(server.url, breaker_failures=1, breaker_reset_s=60.0))
        try:
            server.kill()
            assert await tier.get([make_key(1)]) == [None]
            assert tier.breaker_state is BreakerState.OPEN
            assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [False]  # short-circuited
            server.start()
            assert await tier.ping()
            assert tier.breaker_state is BreakerState.CLOSED
            assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [True]
        finally:
            await tier.close()


@pytest.mark.slow
async def test_a_black_hole_never_hangs_a_call(black_hole: BlackHole) -> None:
    timeout_s = 0.2
    tier = RedisTier(tier_config(black_hole.url, connect_timeout_s=timeout_s, socket_timeout_s=timeout_s,
                                 breaker_failures=100))
    bound_s = timeout_s * 3 + 1.0  # a hang detector, not a performance assertion
    calls: list[tuple[str, Callable[[], object]]] = [
        ("get", lambda: tier.get([make_key(1), make_key(2)])),
        ("contains", lambda: tier.contains([make_key(1)])),
        ("put", lambda: tier.put([make_key(1)], [make_sized_block(1, 4 * MiB)], [meta()])),
        ("delete", lambda: tier.delete([make_key(1)])),
        ("ping", lambda: tier.ping()),
        ("clear_namespace", lambda: tier.clear_namespace(make_key(1)[:8])),
    ]
    expected = {"get": [None, None], "contains": [False], "put": [False], "delete": None, "ping": False}
    try:
        for name, call in calls:
            start = time.monotonic()
            if name == "clear_namespace":
                with pytest.raises(UnavailableError):
                    await call()  # type: ignore[misc]
            else:
                assert await call() == expected[name], name  # type: ignore[misc]
            assert time.monotonic() - start < bound_s, name
        assert black_hole.num_accepted > 0
        assert tier.counters()["timeouts"] >= len(calls)
    finally:
        await tier.close()


async def test_the_breaker_short_circuits_a_black_hole(black_hole: BlackHole) -> None:
    tier = RedisTier(tier_config(black_hole.url, socket_timeout_s=0.1, breaker_failures=2, breaker_reset_s=60.0))
    try:
        await tier.get([make_key(1)])
        await tier.get([make_key(1)])
        assert tier.breaker_state is BreakerState.OPEN
        timeouts = tier.counters()["timeouts"]
        assert await tier.get([make_key(1)]) == [None]
        assert await tier.contains([make_key(1)]) == [False]
        assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [False]
        counts = tier.counters()
        assert counts["timeouts"] == timeouts  # nothing was sent
        assert counts["breaker_open"] == 3
        assert counts["skipped_writes"] == 1
    finally:
        await tier.close()


@pytest.mark.slow
async def test_a_killed_cluster_node_fails_soft_and_the_tier_recovers() -> None:
    with RedisClusterProcess(3, node_timeout_ms=1000) as cluster:
        tier = RedisTier(tier_config(cluster.url, cluster=True, breaker_reset_s=0.2))
        try:
            keys = [make_key(i) for i in range(30)]
            values = [make_block(i) for i in range(30)]
            assert await tier.put(keys, values, [meta()] * 30) == [True] * 30
            cluster.kill_node(1)
            for _ in range(5):
                got = await tier.get(keys)
                assert all(g in (None, v) for g, v in zip(got, values))
                await tier.put(keys[:3], values[:3], [meta()] * 3)
            assert tier.counters()["errors"] > 0
            cluster.restart_node(1)  # rejoins with its slots, without its data
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline:
                if await tier.put(keys, values, [meta()] * 30) == [True] * 30:
                    break
                await asyncio.sleep(0.1)  # polling: the cluster offers nothing to wait on until node 1 serves again
            assert await tier.get(keys) == values
        finally:
            await tier.close()


# -- auth, ACL, TLS, config ------------------------------------------------------------------


async def test_password_and_password_file(tmp_path: Path) -> None:
    with RedisProcess(password="s3cret") as server:
        plain_url = f"redis://127.0.0.1:{server.port}/0"
        secret = tmp_path / "redis.pass"
        secret.write_text("s3cret\n")
        for cfg in (tier_config(plain_url, password="s3cret"), tier_config(plain_url, password_file=str(secret))):
            tier = RedisTier(cfg)
            assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [True]
            await tier.close()
        wrong = RedisTier(tier_config(plain_url, password="wrong"))
        try:
            assert await wrong.put([make_key(2)], [make_block(2)], [meta()]) == [False]
            assert await wrong.get([make_key(1)]) == [None]
            assert wrong.counters()["errors"] >= 2
        finally:
            await wrong.close()


async def test_acl_username(redis_server: RedisProcess) -> None:
    with redis_server.client() as client:
        client.execute_command("ACL", "SETUSER", "kv", "on", ">kvpass", "~kvstore:*", "+@all")
    tier = RedisTier(tier_config(redis_server.url, username="kv", password="kvpass"))
    other = RedisTier(tier_config(redis_server.url, username="kv", password="kvpass", prefix="elsewhere"))
    try:
        assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [True]
        assert await tier.get([make_key(1)]) == [make_block(1)]
        assert await other.put([make_key(1)], [make_block(1)], [meta()]) == [False]  # NOPERM on its keys
        assert other.counters()["errors"] >= 1
    finally:
        await tier.close()
        await other.close()


@pytest.mark.slow
async def test_mutual_tls(tmp_path: Path) -> None:
    try:
        tls = make_tls_files(tmp_path)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with RedisProcess(tls=tls) as server:
        tier = RedisTier(tier_config(server.tls_url, ssl_ca_certs=tls.ca_cert, ssl_certfile=tls.client_cert,
                                     ssl_keyfile=tls.client_key))
        anonymous = RedisTier(tier_config(server.tls_url, ssl_ca_certs=tls.ca_cert))
        try:
            assert await tier.put([make_key(1)], [make_block(1)], [meta()]) == [True]
            assert await tier.get([make_key(1)]) == [make_block(1)]
            assert await anonymous.get([make_key(1)]) == [None]  # no client certificate: refused, softly
            assert anonymous.counters()["errors"] >= 1
        finally:
            await tier.close()
            await anonymous.close()


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="url"):
        RedisTier(RedisTierConfig(url=""))
    with pytest.raises(ConfigError, match="url"):
        RedisTier(RedisTierConfig(url="http://127.0.0.1:6379"))
    with pytest.raises(ConfigError, match="rediss"):
        RedisTier(RedisTierConfig(url="redis://127.0.0.1:6379", ssl_ca_certs="/ca.pem"))
    with pytest.raises(ConfigError, match="password"):
        RedisTier(RedisTierConfig(url="redis://127.0.0.1:6379", password="a", password_file="/p"))
    with pytest.raises(ConfigError, match="password_file"):
        RedisTier(RedisTierConfig(url="redis://127.0.0.1:6379", password_file=str(tmp_path / "missing")))


async def test_a_closed_tier_raises_unavailable(redis_server: RedisProcess) -> None:
    tier = RedisTier(tier_config(redis_server.url))
    await tier.close()
    for call in (tier.get([make_key(1)]), tier.contains([make_key(1)]), tier.delete([make_key(1)]),
                 tier.put([make_key(1)], [make_block(1)], [meta()]), tier.ping()):
        with pytest.raises(UnavailableError):
            await call


# -- the circuit breaker, pure logic with a fake clock -----------------------------------------


def test_breaker_opens_after_n_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(3, 1.0, clock=FakeClock(100.0))
    for _ in range(5):  # failures interrupted by a success never add up
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and breaker.num_trips == 1
    assert not breaker.allow()


def test_breaker_half_open_admits_one_trial_after_reset_s() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(1, 2.0, clock=clock)
    breaker.record_failure()
    clock.now_s += 1.999
    assert not breaker.allow()
    clock.now_s += 0.001
    assert breaker.allow()  # the trial
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow() and not breaker.allow()  # everyone else waits for it
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow() and breaker.allow()


def test_breaker_failed_trial_reopens_for_another_reset_s() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(2, 1.0, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.now_s += 1.0
    assert breaker.allow()
    breaker.record_failure()  # one failed trial is enough
    assert breaker.state is BreakerState.OPEN and breaker.num_trips == 2
    clock.now_s += 0.5
    assert not breaker.allow()
    clock.now_s += 0.5
    assert breaker.allow()


def test_breaker_trial_that_never_reports_expires() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(1, 1.0, clock=clock)
    breaker.record_failure()
    clock.now_s += 1.0
    assert breaker.allow()  # the trial task is cancelled and never reports
    clock.now_s += 0.9
    assert not breaker.allow()
    clock.now_s += 0.1
    assert breaker.allow()


def test_breaker_late_failures_while_open_restart_the_wait() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(1, 1.0, clock=clock)
    breaker.record_failure()
    clock.now_s += 0.8
    breaker.record_failure()  # a call admitted before it opened fails late
    clock.now_s += 0.8
    assert not breaker.allow()
    clock.now_s += 0.2
    assert breaker.allow()


def test_breaker_with_no_threshold_never_opens_and_rejects_negative_reset() -> None:
    breaker = CircuitBreaker(0, 1.0, clock=FakeClock(100.0))
    for _ in range(100):
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.num_consecutive_failures == 100
    with pytest.raises(ValueError):
        CircuitBreaker(3, -1.0)
