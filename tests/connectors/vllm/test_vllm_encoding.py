"""``kv_encoding=int8`` in a real vLLM CPU engine: a producer stores half the bytes, a fresh consumer hits them.

Outputs are not compared for identity: the weights are random (near-uniform
attention), and an encoding is lossy by design; quality is measured on a
trained model by ``benchmarks/bench_encoding_quality.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import decode_header
from kvstore.keys import hash_blocks
from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, deltas, tokens, write_llama
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [tokens(200, 71), tokens(130, 72)]
EXACT_BLOCK_BYTES = 128 + 2 * 2 * 2 * BLOCK_SIZE * 32 * 2  # header + [2 layers, K/V, 2 KV heads, 32, 32] bf16


@pytest.mark.parametrize("encoding,fraction", [("int8", 0.52), ("int4_v2", 0.33)])
def test_an_encoded_engine_stores_fewer_bytes_and_another_hits_them(tmp_path: Any, encoding: str,
                                                                     fraction: float) -> None:
    """int8 at about half the bytes; int4_v2 (4-bit codes, an 8-bit step and zero point per key channel over the
    block's 16 tokens and per value group of 32 channels) at about 0.3 of them on these heads of 32 channels."""
    model = write_llama(tmp_path / "llama")
    extra = {"kv_encoding": encoding}
    with KVNode(memory_capacity="64MiB") as node, KVStoreClient(node.target, retries=0) as client:
        with Engine(model, kv_role="kv_producer", extra={**extra, "target": node.target}) as producer:
            first = producer.generate(PROMPTS)
            producer.drain()
            namespace = producer.namespace()
        memory = client.stats().tier("memory")
        saved = sum(len(p) // BLOCK_SIZE for p in PROMPTS)
        assert namespace.kv_encoding == encoding and memory.blocks == saved
        assert memory.bytes <= fraction * saved * EXACT_BLOCK_BYTES
        stored = client.get(namespace, hash_blocks(namespace, PROMPTS[0]))
        assert len(stored) == 6 and {decode_header(b).encoding for b in stored} == {encoding}
        with Engine(model, kv_role="kv_consumer", extra={**extra, "target": node.target}) as consumer:
            before = consumer.metrics()
            second = consumer.generate(PROMPTS)
            grew = deltas(before, consumer.metrics(), "hit_blocks", "loaded_blocks", "load_failed_blocks")
    expected = sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
    assert grew == {"hit_blocks": expected, "loaded_blocks": expected, "load_failed_blocks": 0}
    assert [len(s) for s in second] == [len(f) for f in first]
