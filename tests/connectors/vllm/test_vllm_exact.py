"""Exact match across engines: a producer fills a ``kvstore serve`` node, a fresh consumer loads from it (Llama, GQA).

Engine A (``kv_producer``) serves the prompts and saves their blocks; it never
loads, so its greedy outputs are those of a run without the connector (the
prompts that must not be saved run with ``save: false``). Engine B
(``kv_consumer``, a fresh process with vLLM's own prefix caching off) serves
the same prompts and prompts sharing their prefixes: every full block it can
find comes from the node, and its outputs must be token-identical to A's.
Both prefill in chunks of 80 tokens, so chunk boundaries fall inside blocks;
B runs vLLM's engine core (the scheduler) in a process of its own, as ``vllm
serve`` does, so its scheduler learns the worker's page format through vLLM's
handshake across processes.
Together the two engines are the prefill/decode disaggregation of the issue:
a producer that only saves and a consumer that only loads, through one node.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.client import KVStoreClient
from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, counter, deltas, tokens, write_llama
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

CHUNK = 80  # max_num_batched_tokens: prefill chunks that end inside blocks
MID_BLOCK = tokens(200, 1)  # 6 full blocks and 8 tokens
WHOLE_BLOCKS = tokens(192, 2)  # exactly 6 blocks: the last one holds the last token, so 5 can be loaded
BATCH = [tokens(n, 10 + i) for i, n in enumerate([70, 130, 260, 96, 33, 180])]
LONG = tokens(300, 4)
TURN_1 = tokens(150, 3)
SHARED = [MID_BLOCK[:160] + tokens(70, 5), LONG[:128] + tokens(200, 6)]  # never saved: only the prefix hits
COUNTS = ("lookups", "lookup_blocks", "hit_blocks", "loaded_blocks", "load_failed_blocks", "saved_blocks")


def full_blocks(num_tokens: int) -> int:
    """Blocks of a prompt the connector may load: whole ones, never the one that holds the last token."""
    return (num_tokens - 1) // BLOCK_SIZE


@pytest.fixture(scope="module")
def node() -> Any:
    with KVNode(memory_capacity="256MiB") as node:
        yield node


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def producer(node: KVNode, model: Any) -> dict[str, Any]:
    """Engine A's outputs (the reference), the multi-turn conversation it held, and its counters."""
    with Engine(model, kv_role="kv_producer", extra={"target": node.target},
                max_num_batched_tokens=CHUNK) as engine:
        ref: dict[str, Any] = {}
        ref["mid"], ref["whole"] = engine.generate([MID_BLOCK, WHOLE_BLOCKS])
        ref["batch"] = engine.generate(BATCH)
        ref["long"] = engine.generate([LONG])[0]
        ref["turn_1"] = engine.generate([TURN_1], max_tokens=48)[0]  # its generated blocks are saved at the end
        ref["turn_2_prompt"] = TURN_1 + ref["turn_1"] + tokens(40, 7)
        ref["turn_2"] = engine.generate([{"tokens": ref["turn_2_prompt"], "save": False}])[0]
        ref["shared"] = engine.generate([{"tokens": p, "save": False} for p in SHARED])
        engine.drain()
        ref["metrics"] = engine.metrics()
    return ref


@pytest.fixture(scope="module")
def consumer(node: KVNode, model: Any, producer: dict[str, Any]) -> Any:
    with Engine(model, kv_role="kv_consumer", extra={"target": node.target}, max_num_batched_tokens=CHUNK,
                engine_core_process=True) as engine:
        yield engine


def test_the_producer_saves_every_full_block_and_never_looks_up(producer: dict[str, Any], node: KVNode) -> None:
    """Prompt blocks as prefill computes them, then the blocks of generated tokens when a request ends."""
    metrics = producer["metrics"]
    computed = [n + 16 - 1 for n in [200, 192, *(len(p) for p in BATCH), 300]]  # the last token has no KV yet
    computed.append(len(TURN_1) + 48 - 1)
    saved = sum(n // BLOCK_SIZE for n in computed)
    assert counter(metrics, "saved_blocks") == saved
    assert counter(metrics, "lookups") == 0 and counter(metrics, "save_failed_blocks") == 0
    with KVStoreClient(node.target) as client:
        assert client.stats().tier("memory").blocks == saved


def test_a_prompt_ending_mid_block_loads_every_full_block(consumer: Engine, producer: dict[str, Any]) -> None:
    before = consumer.metrics()
    assert consumer.generate([MID_BLOCK]) == [producer["mid"]]
    grew = deltas(before, consumer.metrics(), *COUNTS)
    assert grew == {"lookups": 1, "lookup_blocks": 6, "hit_blocks": 6, "loaded_blocks": 6, "load_failed_blocks": 0,
                    "saved_blocks": 0}


def test_a_fully_cached_prompt_leaves_the_block_of_its_last_token(consumer: Engine, producer: dict[str, Any]) -> None:
    before = consumer.metrics()
    assert consumer.generate([WHOLE_BLOCKS]) == [producer["whole"]]
    grew = deltas(before, consumer.metrics(), "hit_blocks", "loaded_blocks")
    assert grew == {"hit_blocks": 5, "loaded_blocks": 5}  # vLLM must compute the last token's logits


def test_a_batch_of_concurrent_requests(consumer: Engine, producer: dict[str, Any]) -> None:
    before = consumer.metrics()
    assert consumer.generate(BATCH) == producer["batch"]
    expected = sum(full_blocks(len(p)) for p in BATCH)
    assert deltas(before, consumer.metrics(), "loaded_blocks") == {"loaded_blocks": expected}


def test_chunked_prefill_across_block_boundaries(consumer: Engine, producer: dict[str, Any]) -> None:
    """9 loaded blocks, then the rest; and 4 loaded blocks, then 200 tokens in 80-token chunks across blocks."""
    before = consumer.metrics()
    assert consumer.generate([LONG]) == [producer["long"]]
    assert consumer.generate([SHARED[1]]) == [producer["shared"][1]]
    assert deltas(before, consumer.metrics(), "loaded_blocks") == {"loaded_blocks": 9 + 4}


def test_prompts_sharing_a_prefix_load_the_prefix(consumer: Engine, producer: dict[str, Any]) -> None:
    before = consumer.metrics()
    assert consumer.generate([SHARED[0]]) == [producer["shared"][0]]
    grew = deltas(before, consumer.metrics(), "lookup_blocks", "hit_blocks", "loaded_blocks")
    assert grew == {"lookup_blocks": full_blocks(len(SHARED[0])), "hit_blocks": 5, "loaded_blocks": 5}


def test_a_multi_turn_conversation_reuses_the_generated_blocks(consumer: Engine, producer: dict[str, Any]) -> None:
    """Turn 2's prompt is turn 1 and its answer: the blocks the producer saved when turn 1 ended are loaded."""
    assert consumer.generate([TURN_1], max_tokens=48) == [producer["turn_1"]]
    before = consumer.metrics()
    assert consumer.generate([producer["turn_2_prompt"]]) == [producer["turn_2"]]
    computed_turn_1 = len(TURN_1) + len(producer["turn_1"]) - 1
    assert deltas(before, consumer.metrics(), "loaded_blocks") == {"loaded_blocks": computed_turn_1 // BLOCK_SIZE}


def test_the_consumer_never_saves(consumer: Engine) -> None:
    metrics = consumer.metrics()
    assert counter(metrics, "saved_blocks") == 0 and counter(metrics, "load_failed_blocks") == 0
    assert counter(metrics, "lookup_errors") == 0
