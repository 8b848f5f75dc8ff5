"""Tensor parallelism in real vLLM CPU engines: TP=2, every rank saves and loads its own shard, a second engine hits.

vLLM's CPU build binds each rank's OpenMP threads to a NUMA node of its own and refuses TP=2 on a machine
with one ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); binding them by hand
(``VLLM_CPU_OMP_THREADS_BIND=0|1``, one core per rank) runs it. Engine A (``kv_producer``) computes and
saves (its outputs are those of no connector); engine B (``kv_consumer``, a fresh pair of workers) loads
every block on both ranks (the connector counts each rank's blocks) and gives token-identical outputs.
Rank by rank in processes of their own, without engines: ``test_tp_ranks.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from tests.connectors.vllm.harness import Engine, deltas, tokens, write_llama
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPTS = [tokens(200, 70), tokens(130, 71)]  # 6 and 4 loadable blocks
TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module", autouse=True)
def bind_threads() -> Any:
    """One core per rank (``VLLM_CPU_OMP_THREADS_BIND``), in the engines' environment."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if before is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def test_every_rank_saves_and_loads_its_shard_and_a_second_engine_hits(tmp_path: Any) -> None:
    model = write_llama(tmp_path / "model")
    with KVNode(memory_capacity="128MiB") as node:
        with Engine(model, kv_role="kv_producer", extra={"target": node.target}, **TP) as producer:
            reference = producer.generate(PROMPTS)
            producer.drain()
        with KVStoreClient(node.target) as client:  # the node, not the workers' counters: those reach vLLM's
            saved = client.stats().tier("memory").blocks  # metrics only with a later step's outputs
        assert saved == 2 * (6 + 4)  # both ranks saved their shard of every full prompt block
        with Engine(model, kv_role="kv_consumer", extra={"target": node.target}, **TP) as consumer:
            before = consumer.metrics()
            assert consumer.generate(PROMPTS) == reference
            grew = deltas(before, consumer.metrics(), "hit_blocks", "loaded_blocks", "load_failed_blocks")
    assert grew == {"hit_blocks": 6 + 4, "loaded_blocks": 2 * (6 + 4), "load_failed_blocks": 0}
