"""Faults under a real engine: wrong KV (the negative control), a bad block, a node killed or frozen mid-run.

The engine and node are the session's shared ones (``conftest.py``). Every
reference output comes from the same engine run with ``{"load": false, "save":
false}``: no block from the store takes part in it.
"""

from __future__ import annotations

import os
import signal
import time
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import hash_blocks
from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, deltas, tokens
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 32  # write_llama's shape
COUNTS = ("hit_blocks", "loaded_blocks", "load_failed_blocks", "lookup_errors", "saved_blocks", "save_failed_blocks")


@pytest.fixture()
def node(shared_node: KVNode) -> KVNode:
    return shared_node


@pytest.fixture()
def engine(shared_engine: Engine) -> Engine:
    return shared_engine


def _reference(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate([{"tokens": p, "load": False, "save": False} for p in prompts])


def _block(fill: torch.Tensor | None = None, num_layers: int = LAYERS) -> torch.Tensor:
    shape = (num_layers, 2, KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    return (torch.randn(shape) if fill is None else fill).to(torch.bfloat16)


def test_wrong_kv_changes_the_output(engine: Engine, node: KVNode) -> None:
    """The negative control: well-formed blocks of the wrong KV are loaded, and the output changes.

    So the equality tests can fail: were the loaded KV ignored or recomputed,
    this output would equal the reference.
    """
    prompt = tokens(200, 31)
    (reference,) = _reference(engine, [prompt])
    namespace = engine.namespace()
    hashes = hash_blocks(namespace, prompt[: 6 * BLOCK_SIZE])
    with KVStoreClient(node.target) as client:
        assert client.put(namespace, hashes, [_block() for _ in hashes]) == 6
    before = engine.metrics()
    (output,) = engine.generate([prompt])
    grew = deltas(before, engine.metrics(), *COUNTS)
    assert grew["loaded_blocks"] == 6 and grew["load_failed_blocks"] == 0
    assert output != reference


def test_a_block_of_the_wrong_shape_is_recomputed_then_replaced(engine: Engine, node: KVNode) -> None:
    prompt = tokens(200, 32)
    (reference,) = _reference(engine, [prompt])
    assert engine.generate([prompt]) == [reference]  # saves its 6 blocks
    engine.drain()
    namespace = engine.namespace()
    hashes = hash_blocks(namespace, prompt[: 6 * BLOCK_SIZE])
    with KVStoreClient(node.target) as client:
        assert client.delete(namespace, hashes[3:4]) == 1
        assert client.put(namespace, hashes[3:4], [_block(num_layers=LAYERS + 1)]) == 1  # a buggy writer's block
    before = engine.metrics()
    assert engine.generate([prompt]) == [reference]
    grew = deltas(before, engine.metrics(), *COUNTS)
    assert grew["hit_blocks"] == 6 and grew["loaded_blocks"] == 3 and grew["load_failed_blocks"] == 3
    engine.drain()  # the bad block was deleted and the recomputed ones saved
    before = engine.metrics()
    assert engine.generate([prompt]) == [reference]
    grew = deltas(before, engine.metrics(), *COUNTS)
    assert grew["loaded_blocks"] == 6 and grew["load_failed_blocks"] == 0


def _recover(engine: Engine, prompt: list[int], reference: list[int], timeout_s: float = 120.0) -> None:
    """Serve ``prompt`` until it loads from the store again (the connector's backoff ends, the node is back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = engine.metrics()
        assert engine.generate([prompt]) == [reference]
        engine.drain()
        if deltas(before, engine.metrics(), "loaded_blocks")["loaded_blocks"] > 0:
            return
    pytest.fail("the connector did not load from the node again")


def test_the_node_killed_mid_run(engine: Engine, node: KVNode) -> None:
    """Two requests run, two are in flight and four wait when the node dies: all eight finish correctly."""
    prompts = [tokens(200, 40 + i) for i in range(8)]
    references = _reference(engine, prompts)
    assert engine.generate(prompts[:4]) == references[:4]  # their blocks are in the node now
    engine.drain()
    before = engine.metrics()
    outputs = engine.generate_pausing(prompts, pause_after=2, on_pause=node.kill, max_tokens=16)
    assert outputs == references
    grew = deltas(before, engine.metrics(), *COUNTS)
    assert grew["loaded_blocks"] >= 2 * 6  # the first requests loaded from the node
    assert grew["lookup_errors"] + grew["save_failed_blocks"] > 0  # the later ones met a dead node
    node.start()  # an empty node on the same port
    assert engine.generate([prompts[5]]) == [references[5]]
    _recover(engine, prompts[5], references[5])


def test_a_frozen_node_is_a_miss_after_the_timeout(engine: Engine, node: KVNode) -> None:
    prompt = tokens(200, 50)
    (reference,) = _reference(engine, [prompt])
    assert engine.generate([prompt]) == [reference]
    engine.drain()
    assert node.pid is not None
    os.kill(node.pid, signal.SIGSTOP)  # the node answers nothing, and does not close its connections
    try:
        before = engine.metrics()
        assert engine.generate([prompt]) == [reference]
        grew = deltas(before, engine.metrics(), *COUNTS)
        assert grew["loaded_blocks"] == 0 and grew["load_failed_blocks"] == 0 and grew["lookup_errors"] >= 1
    finally:
        os.kill(node.pid, signal.SIGCONT)
    _recover(engine, prompt, reference)
