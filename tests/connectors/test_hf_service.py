"""The HF connector through a real ``kvstore serve`` node and ``KVStoreClient``: hits, then the node dies."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvstore.client import KVStoreClient
from kvstore.connectors.hf import HFConnector
from tests.support.hf import MAX_NEW_TOKENS, prompt, reference, tiny_model
from tests.support.kvnode import KVNode

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`


def test_hits_through_a_server_then_falls_back_when_it_dies():
    model = tiny_model("qwen2", kv_heads=1)
    ids = prompt(70)
    expected = reference(model, ids)
    with KVNode(memory_capacity="32MiB", metrics=False) as node:
        node.start()
        with KVStoreClient(node.target, timeout_s=2.0, retries=0) as client, \
                HFConnector(model, client, block_size=16, model_id="tiny-remote", load_timeout_s=5.0) as conn:
            miss = conn.generate(ids, MAX_NEW_TOKENS)
            conn.flush()
            hit = conn.generate(ids, MAX_NEW_TOKENS)
            assert client.lookup(conn.namespace, conn.block_hashes(ids)).num_blocks == 4
            assert client.shared_memory() == ("attached",)  # the node is on this host: loads came through it
            node.kill()  # SIGKILL: the next load and save fail
            down = conn.generate(ids, MAX_NEW_TOKENS)
            conn.flush()
            stats = conn.stats()
    assert (miss.num_cached_tokens, hit.num_cached_tokens) == (0, 64)
    assert miss.token_ids == hit.token_ids == down.token_ids == expected
    assert down.fell_back and down.num_cached_tokens == 0
    assert stats.num_load_failures == 1 and stats.num_save_failures == 1


def test_the_same_tokens_come_over_grpc_and_shared_memory():
    model = tiny_model("llama")
    ids = prompt(50)
    expected = reference(model, ids)
    with KVNode(memory_capacity="32MiB", metrics=False) as node:
        results = []
        for shared_memory in (True, False):
            with KVStoreClient(node.target, timeout_s=10.0, retries=0, shared_memory=shared_memory) as client, \
                    HFConnector(model, client, block_size=16, model_id=f"tiny-{shared_memory}") as conn:
                conn.generate(ids, MAX_NEW_TOKENS)
                conn.flush()
                results.append(conn.generate(ids, MAX_NEW_TOKENS))
                assert client.shared_memory() == (("attached",) if shared_memory else ("off",))
    assert [r.num_cached_tokens for r in results] == [48, 48]
    assert [r.token_ids for r in results] == [expected, expected]
