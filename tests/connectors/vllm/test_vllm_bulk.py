"""Prefill/decode disaggregation across hosts: a ``kv_producer`` and a ``kv_consumer`` engine whose blocks move on
the node's bulk path (``docs/scaleout.md``), token-identical to the producer.

Both engines run as if on other hosts than the node (``KVSTORE_SHARED_MEMORY=0``
in their environment: no same-host session), so every Put and Get of the
connector goes to the node's bulk listener; the node's metrics show that the
bytes moved there and that no same-host call was made.
"""

from __future__ import annotations

import re
import urllib.request
from typing import Iterator

import pytest

from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, counter, deltas, tokens, write_llama
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [tokens(200, 21), tokens(130, 22), tokens(300, 23)]


def node_samples(node: KVNode) -> dict[str, float]:
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


@pytest.fixture(scope="module")
def remote_env() -> Iterator[None]:
    """The engines start with ``KVSTORE_SHARED_MEMORY=0`` (they inherit this process's environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSTORE_SHARED_MEMORY", "0")
        yield


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="256MiB") as node:
        yield node


def test_a_producer_and_a_consumer_on_other_hosts_move_their_blocks_on_the_bulk_path(
        remote_env: None, node: KVNode, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = write_llama(tmp_path_factory.mktemp("llama") / "model")
    with Engine(model, kv_role="kv_producer", extra={"target": node.target}, max_num_batched_tokens=80) as producer:
        reference = producer.generate(PROMPTS)
        producer.drain()
        saved = counter(producer.metrics(), "saved_blocks")
    assert saved == sum((len(p) + 16 - 1) // BLOCK_SIZE for p in PROMPTS)
    after_put = node_samples(node)
    assert after_put.get('kvstore_bulk_events_total{event="grants_redeemed"}', 0) >= 1
    with Engine(model, kv_role="kv_consumer", extra={"target": node.target}, max_num_batched_tokens=80,
                engine_core_process=True) as consumer:
        before = consumer.metrics()
        assert consumer.generate(PROMPTS) == reference
        grew = deltas(before, consumer.metrics(), "loaded_blocks", "load_failed_blocks")
    assert grew == {"loaded_blocks": sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS), "load_failed_blocks": 0}
    samples = node_samples(node)
    gets = samples.get('kvstore_requests_total{code="OK",method="BulkGetTransfer"}', 0)
    assert gets >= 1 and samples.get('kvstore_requests_total{code="OK",method="BulkPutTransfer"}', 0) >= 1
    assert not any(v for k, v in samples.items() if "kvstore_requests_total" in k and ("Shared" in k or "Attach" in k))
