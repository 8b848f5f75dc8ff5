"""The SGLang HiCache backend against real kvstore nodes: tokens and tenants, TLS, several nodes, a node killed or hung."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore.connectors.sglang import KVStoreHiCacheStorage
from kvstore.connectors.sglang.storage import MAX_PAGES_PER_CALL
from tests.connectors.sglang.harness import fill_random, host_indices, mha_pool, page_keys, pages_of, storage_config
from tests.support.kvnode import KVNode
from tests.support.redis import make_tls_files
from tests.support.security import AUTH_TOKENS, TOKEN_A, TOKEN_B, auth_config
from tests.support.server import ThreadedServer, make_config

PAGE = 4

pytestmark = pytest.mark.slow  # starts kvstore nodes (processes)


def connected(pool, extra, **kwargs) -> KVStoreHiCacheStorage:
    """A backend that opens its own client from the extra config, with ``pool`` registered."""
    storage = KVStoreHiCacheStorage(storage_config(extra, **kwargs), {})
    storage.register_mem_pool_host(pool)
    return storage


@pytest.fixture
def auth_server():
    server = ThreadedServer(auth_config())
    yield server
    server.stop()


def token_file(tmp_path, name, token) -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    return str(path)


def test_a_tenant_cannot_read_another_tenants_pages(auth_server, tmp_path):
    keys = page_keys(3, PAGE)
    pool = mha_pool("page_first")
    fill_random(pool, seed=11)
    a = {"target": auth_server.target, "token_file": token_file(tmp_path, "a", TOKEN_A), "tenant": "tenant-a"}
    writer = connected(pool, a)
    assert writer.batch_set_v1(keys, host_indices(0, 3, PAGE)) == [True] * 3
    assert connected(mha_pool("page_first"), a).batch_exists(keys) == 3

    b_token = token_file(tmp_path, "b", TOKEN_B)
    own = connected(mha_pool("page_first"), {"target": auth_server.target, "token_file": b_token,
                                             "tenant": "tenant-b"})
    assert own.batch_exists(keys) == 0 and own.batch_get_v1(keys, host_indices(4, 3, PAGE)) == [False] * 3

    thief_pool = mha_pool("page_first")
    thief = connected(thief_pool, {"target": auth_server.target, "token_file": b_token, "tenant": "tenant-a"})
    assert thief.batch_exists(keys) == 0  # PERMISSION_DENIED: a miss, never an exception
    assert thief.stats().errors == 1
    assert thief.batch_get_v1(keys, host_indices(4, 3, PAGE)) == [False] * 3  # backing off: not even asked
    assert thief.stats().skipped_calls == 1
    assert not thief_pool.kv_buffer.any()
    writer.close()


def test_pages_spread_over_several_nodes_and_a_killed_node_is_a_miss():
    with KVNode(metrics=False) as first, KVNode(metrics=False) as second:
        keys = page_keys(16, PAGE)
        pool = mha_pool("page_first", device_pages=16)
        fill_random(pool, seed=12)
        extra = {"target": [first.target, second.target], "timeout_s": 2.0, "down_backoff_s": 0.5}
        storage = connected(pool, extra)
        src = host_indices(0, 16, PAGE)
        assert storage.batch_set_v1(keys, src) == [True] * 16
        reader_pool = mha_pool("page_first", device_pages=16)
        reader = connected(reader_pool, extra)
        dst = host_indices(16, 16, PAGE)
        assert reader.batch_get_v1(keys, dst) == [True] * 16
        assert all(torch.equal(a, b) for a, b in zip(pages_of(reader_pool, dst, 16), pages_of(pool, src, 16)))

        second.kill()  # between the batch's write and its read: its pages are gone
        again = connected(mha_pool("page_first", device_pages=16), extra)
        result = again.batch_get_v1(keys, dst)
        hits = result.count(True)
        assert result == [True] * hits + [False] * (16 - hits) and hits < 16
        assert again.batch_exists(keys) == hits
        assert again.batch_set_v1(page_keys(4, PAGE, first_token=500), host_indices(0, 4, PAGE)) == [True] * 4


def test_a_killed_or_hung_single_node_gives_misses_and_no_exception():
    with KVNode(metrics=False) as node:
        keys = page_keys(4, PAGE)
        pool = mha_pool("page_first")
        fill_random(pool, seed=13)
        extra = {"target": node.target, "timeout_s": 1.0, "down_backoff_s": 0.2}
        storage = connected(pool, extra)
        assert storage.batch_set_v1(keys, host_indices(0, 4, PAGE)) == [True] * 4

        os.kill(node.pid, signal.SIGSTOP)  # hung: the connection is open, nothing answers
        try:
            hung = connected(mha_pool("page_first"), extra)
            assert hung.batch_get_v1(keys, host_indices(4, 4, PAGE)) == [False] * 4
            assert hung.stats().errors == 1
        finally:
            os.kill(node.pid, signal.SIGCONT)

        node.kill()
        dead = connected(mha_pool("page_first"), extra)
        assert dead.batch_exists(keys) == 0
        assert dead.stats().errors == 1
        assert dead.batch_set_v1(keys, host_indices(0, 4, PAGE)) == [False] * 4  # in its backoff: not stored
        assert dead.stats().skipped_calls == 1


def kill_at_call(monkeypatch, storage, method: str, node: KVNode, call: int) -> list[int]:
    """Make ``storage``'s store kill ``node`` as the ``call``-th ``method`` call begins; returns each call's size."""
    sizes: list[int] = []
    original = getattr(storage.store, method)

    def killing(namespace, hashes, *args, **kwargs):
        sizes.append(len(hashes))
        if len(sizes) == call:
            node.kill()
        return original(namespace, hashes, *args, **kwargs)

    monkeypatch.setattr(storage.store, method, killing)
    return sizes


def test_a_node_killed_between_the_calls_of_one_batch_gives_the_prefix_read_and_misses(monkeypatch):
    num = MAX_PAGES_PER_CALL + 44  # two store calls in one batch: the node dies as the second begins
    with KVNode(metrics=False) as node:
        keys = page_keys(num, PAGE)
        pool = mha_pool("page_first", device_pages=num)
        fill_random(pool, seed=15)
        extra = {"target": node.target, "timeout_s": 5.0, "down_backoff_s": 60.0}
        assert connected(pool, extra).batch_set_v1(keys, host_indices(0, num, PAGE)) == [True] * num

        reader_pool = mha_pool("page_first", device_pages=num)
        reader = connected(reader_pool, extra)
        sizes = kill_at_call(monkeypatch, reader, "get_into", node, call=2)
        dst = host_indices(num, num, PAGE)
        assert reader.batch_get_v1(keys, dst) == [True] * MAX_PAGES_PER_CALL + [False] * 44
        assert sizes == [MAX_PAGES_PER_CALL, 44]
        assert all(torch.equal(a, b) for a, b in zip(pages_of(reader_pool, dst, MAX_PAGES_PER_CALL),
                                                     pages_of(pool, host_indices(0, num, PAGE), MAX_PAGES_PER_CALL)))
        counts = reader.stats()
        assert (counts.hit_pages, counts.errors) == (MAX_PAGES_PER_CALL, 1)


def test_a_node_killed_mid_write_batch_makes_the_write_false_and_raises_nothing(monkeypatch):
    num = MAX_PAGES_PER_CALL + 44
    with KVNode(metrics=False) as node:
        pool = mha_pool("page_first", device_pages=num)
        fill_random(pool, seed=16)
        writer = connected(pool, {"target": node.target, "timeout_s": 5.0, "down_backoff_s": 60.0})
        sizes = kill_at_call(monkeypatch, writer, "put", node, call=2)
        assert writer.batch_set_v1(page_keys(num, PAGE), host_indices(0, num, PAGE)) == [False] * num
        assert sizes == [MAX_PAGES_PER_CALL, 44]
        counts = writer.stats()
        assert (counts.written_pages, counts.errors) == (0, 1)


def test_a_node_killed_while_a_read_waits_on_it_is_a_miss_and_no_exception(monkeypatch):
    with KVNode(metrics=False) as node:
        keys = page_keys(4, PAGE)
        pool = mha_pool("page_first")
        fill_random(pool, seed=17)
        extra = {"target": node.target, "timeout_s": 5.0, "down_backoff_s": 60.0}
        assert connected(pool, extra).batch_set_v1(keys, host_indices(0, 4, PAGE)) == [True] * 4
        reader = connected(mha_pool("page_first"), extra)
        assert reader.batch_exists(keys) == 4  # connected: the read below is the only call in flight

        entered = threading.Event()
        original = reader.store.get_into

        def get_into(*args, **kwargs):
            entered.set()
            return original(*args, **kwargs)

        monkeypatch.setattr(reader.store, "get_into", get_into)
        os.kill(node.pid, signal.SIGSTOP)  # the read is sent, and nothing answers it
        with ThreadPoolExecutor(1) as executor:
            read = executor.submit(reader.batch_get_v1, keys, host_indices(4, 4, PAGE))
            assert entered.wait(60)
            node.kill()
            assert read.result(timeout=60) == [False] * 4
        assert reader.stats().errors == 1


def test_pages_cross_a_mutual_tls_node_with_a_token_and_a_wrong_ca_is_a_miss(tmp_path):
    files, other = make_tls_files(tmp_path / "ca"), make_tls_files(tmp_path / "other-ca")
    server = ThreadedServer(make_config(**{"security.tls_cert_file": files.server_cert,
                                           "security.tls_key_file": files.server_key,
                                           "security.tls_client_ca_file": files.ca_cert,
                                           "security.auth_tokens": AUTH_TOKENS}))
    try:
        keys = page_keys(2, PAGE)
        pool = mha_pool("page_first")
        fill_random(pool, seed=14)
        extra = {"target": server.target, "tls_ca_file": files.ca_cert, "tls_cert_file": files.client_cert,
                 "tls_key_file": files.client_key, "token_file": token_file(tmp_path, "a", TOKEN_A),
                 "tenant": "tenant-a", "timeout_s": 2.0}
        assert connected(pool, extra).batch_set_v1(keys, host_indices(0, 2, PAGE)) == [True, True]
        reader_pool = mha_pool("page_first")
        assert connected(reader_pool, extra).batch_get_v1(keys, host_indices(4, 2, PAGE)) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(pages_of(reader_pool, host_indices(4, 2, PAGE), 2),
                                                     pages_of(pool, host_indices(0, 2, PAGE), 2)))
        wrong = connected(mha_pool("page_first"), {**extra, "tls_ca_file": other.ca_cert})
        assert wrong.batch_exists(keys) == 0 and wrong.stats().errors == 1
    finally:
        server.stop()
