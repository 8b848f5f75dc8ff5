"""Isolation, Qwen2, and vLLM's own prefix cache: engines that must not share blocks, and two that must.

The session's shared node and Llama engine (``conftest.py``), then engines of
this module's own against the same node; in turn:

1. the Llama engine, with LoRA, saves a prompt for the base model, for tenant ``a``
   (``cache_salt``) and for adapter ``x#1``. Tenant ``b`` and adapter ``x#2``
   (same name, another id) get no hit; tenant ``a`` and ``x#1`` do (the positive
   controls, so the misses are not an accident);
2. the same Llama with another KV dtype (fp8 where the CPU has AVX-512, which
   vLLM's fp8 CPU kernels need, else float32) gets no hit on the bf16 blocks,
   then hits its own;
3. a Qwen2 engine gets no hit on Llama's blocks of the same tokens (another
   model), and saves prompts of its own;
4. a fresh Qwen2 engine with vLLM's prefix caching on loads those prompts with
   outputs identical to the first Qwen2's, and loads only what its local cache lacks.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, counter, deltas, tokens
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPT = tokens(200, 21)  # 6 loadable blocks
QWEN_X = tokens(256, 22)
QWEN_X_TAIL = QWEN_X + tokens(64, 23)
QWEN_SHARED = QWEN_X[:96] + tokens(100, 24)  # never saved: 3 blocks hit
HITS = ("lookup_blocks", "hit_blocks", "loaded_blocks")


def _other_kv_dtype() -> dict[str, str]:
    """fp8 KV where vLLM's CPU kernels support it (AVX-512 or AMX), else float32 KV (and activations)."""
    import torch

    if torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX")):
        return {"kv_cache_dtype": "fp8"}
    return {"dtype": "float32"}


@pytest.fixture(scope="module")
def node(shared_node: KVNode) -> KVNode:
    return shared_node


def _serve(engine: Engine, prompt: dict[str, Any]) -> tuple[list[int], dict[str, float]]:
    """The output of one prompt and how the hit counters grew."""
    before = engine.metrics()
    output = engine.generate([prompt])[0]
    return output, deltas(before, engine.metrics(), *HITS)


@pytest.fixture(scope="module")
def lora_run(shared_engine: Engine, models: dict[str, Any]) -> dict[str, Any]:
    lora, engine = str(models["lora"]), shared_engine
    run: dict[str, Any] = {}
    for name, prompt in {"base": {"tokens": PROMPT}, "salt_a": {"tokens": PROMPT, "salt": "a"},
                         "lora_x1": {"tokens": PROMPT, "lora": ["x", 1, lora]}}.items():
        run[name] = _serve(engine, prompt)
    engine.drain()
    for name, prompt in {"salt_b": {"tokens": PROMPT, "salt": "b"}, "salt_a_again": {"tokens": PROMPT, "salt": "a"},
                         "lora_x2": {"tokens": PROMPT, "lora": ["x", 2, lora], "save": False},
                         "lora_x1_again": {"tokens": PROMPT, "lora": ["x", 1, lora]}}.items():
        run[name] = _serve(engine, prompt)
    return run


def test_no_hit_across_cache_salts(lora_run: dict[str, Any]) -> None:
    assert lora_run["salt_a"][1]["hit_blocks"] == 0  # the first request of tenant a: the base model's blocks are not its
    assert lora_run["salt_b"][1] == {"lookup_blocks": 6, "hit_blocks": 0, "loaded_blocks": 0}
    assert lora_run["salt_a_again"][1]["hit_blocks"] == 6  # positive control
    assert lora_run["salt_b"][0] == lora_run["salt_a_again"][0] == lora_run["base"][0]


def test_no_hit_across_lora_adapter_ids(lora_run: dict[str, Any]) -> None:
    assert lora_run["lora_x1"][0] != lora_run["base"][0]  # the adapter changes the KV and the output
    assert lora_run["lora_x1"][1]["hit_blocks"] == 0
    assert lora_run["lora_x2"][1] == {"lookup_blocks": 6, "hit_blocks": 0, "loaded_blocks": 0}
    assert lora_run["lora_x1_again"][1]["hit_blocks"] == 6  # positive control
    assert lora_run["lora_x1_again"][0] == lora_run["lora_x1"][0] == lora_run["lora_x2"][0]


@pytest.fixture(scope="module")
def other_dtype_run(node: KVNode, models: dict[str, Any], lora_run: dict[str, Any]) -> dict[str, Any]:
    with Engine(models["llama"], extra={"target": node.target}, **_other_kv_dtype()) as engine:
        first = _serve(engine, {"tokens": PROMPT})
        engine.drain()
        again = _serve(engine, {"tokens": PROMPT})
        namespace = engine.namespace()
    return {"first": first, "again": again, "namespace": namespace}


def test_no_hit_across_kv_cache_dtypes(other_dtype_run: dict[str, Any]) -> None:
    run = other_dtype_run
    assert run["first"][1] == {"lookup_blocks": 6, "hit_blocks": 0, "loaded_blocks": 0}
    assert run["again"][1]["loaded_blocks"] == 6  # its own blocks load
    assert run["again"][0] == run["first"][0]
    assert run["namespace"].dtype in ("float8_e4m3fn", "float8_e5m2", "uint8", "float32")
    if run["namespace"].dtype.startswith("float8"):
        assert "kv=fp8" in run["namespace"].model


@pytest.fixture(scope="module")
def qwen_producer(node: KVNode, models: dict[str, Any], lora_run: dict[str, Any]) -> dict[str, Any]:
    with Engine(models["qwen2"], extra={"target": node.target}) as engine:
        run: dict[str, Any] = {"llama_prompt": _serve(engine, {"tokens": PROMPT, "save": False})}
        run["x"], run["x_tail"] = engine.generate([QWEN_X, QWEN_X_TAIL])
        run["shared"] = engine.generate([{"tokens": QWEN_SHARED, "save": False}])[0]
        engine.drain()
    return run


def test_no_hit_across_models(qwen_producer: dict[str, Any]) -> None:
    """The node holds Llama's blocks of the same tokens; a Qwen2 engine must not see them."""
    assert qwen_producer["llama_prompt"][1] == {"lookup_blocks": 6, "hit_blocks": 0, "loaded_blocks": 0}


@pytest.fixture(scope="module")
def qwen_consumer(node: KVNode, models: dict[str, Any], qwen_producer: dict[str, Any]) -> Any:
    with Engine(models["qwen2"], extra={"target": node.target}, prefix_caching=True) as engine:
        yield engine


def test_qwen2_outputs_are_identical_across_engines(qwen_consumer: Engine, qwen_producer: dict[str, Any]) -> None:
    output, grew = _serve(qwen_consumer, {"tokens": QWEN_X})
    assert output == qwen_producer["x"]
    assert grew == {"lookup_blocks": 7, "hit_blocks": 7, "loaded_blocks": 7}
    output, grew = _serve(qwen_consumer, {"tokens": QWEN_SHARED})
    assert output == qwen_producer["shared"]


def test_with_local_prefix_caching_only_what_vllm_lacks_is_loaded(qwen_consumer: Engine,
                                                                  qwen_producer: dict[str, Any]) -> None:
    """After X ran here, vLLM's own cache holds X's 8 blocks: of X + tail, only block 8 comes from kvstore."""
    qwen_consumer.generate([QWEN_X])  # X's blocks are in the local prefix cache (again)
    before = qwen_consumer.metrics()
    assert qwen_consumer.generate([QWEN_X_TAIL]) == [qwen_producer["x_tail"]]
    after = qwen_consumer.metrics()
    grew = deltas(before, after, *HITS)
    assert grew == {"lookup_blocks": (len(QWEN_X_TAIL) - 1) // BLOCK_SIZE - 8, "hit_blocks": 1, "loaded_blocks": 1}
    local = counter(after, "prefix_cache_hits", prefix="") - counter(before, "prefix_cache_hits", prefix="")
    assert local == 8 * BLOCK_SIZE
