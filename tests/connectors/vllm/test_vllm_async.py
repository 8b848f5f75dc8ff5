"""Asynchronous loads in a real vLLM engine: outputs token-identical to no connector, loads reported as received.

Engine A (``kv_producer``) serves the prompts and saves their blocks: its
greedy outputs are those of a run without the connector. Engine B
(``kv_consumer``, ``load_async``) serves them again: vLLM parks each hit in
``WAITING_FOR_REMOTE_KVS`` while a worker thread loads it, and schedules it once
``get_finished`` reports it; a batch of hits and misses runs together, so misses
prefill while hits load. (Failed, timed-out and aborted asynchronous loads: ``test_worker.py``,
``test_vllm_async_faults.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.connectors.vllm.harness import Engine, deltas, tokens, write_llama
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

HITS = [tokens(n, 40 + i) for i, n in enumerate([200, 130, 260])]  # 6, 4 and 8 loadable blocks
MISSES = [tokens(n, 50 + i) for i, n in enumerate([90, 170])]


@pytest.fixture(scope="module")
def node() -> Any:
    with KVNode(memory_capacity="256MiB") as node:
        yield node


@pytest.fixture(scope="module")
def reference(node: KVNode, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = write_llama(tmp_path_factory.mktemp("llama") / "model")
    with Engine(model, kv_role="kv_producer", extra={"target": node.target}) as engine:
        outputs = {"hits": engine.generate(HITS), "misses": engine.generate([{"tokens": p, "save": False}
                                                                          for p in MISSES])}
        engine.drain()
    return {"model": model, **outputs}


def test_asynchronous_loads_give_the_outputs_of_no_connector(node: KVNode, reference: dict[str, Any]) -> None:
    with Engine(reference["model"], kv_role="kv_consumer", extra={"target": node.target, "load_async": True},
                engine_core_process=True) as engine:
        before = engine.metrics()
        outputs = engine.generate([*HITS, *MISSES])
        grew = deltas(before, engine.metrics(), "hit_blocks", "loaded_blocks", "load_failed_blocks")
        assert outputs == [*reference["hits"], *reference["misses"]]
        assert grew == {"hit_blocks": 6 + 4 + 8, "loaded_blocks": 6 + 4 + 8, "load_failed_blocks": 0}
        # again, one at a time: each hit waits for its own load alone
        assert [engine.generate([p])[0] for p in HITS] == reference["hits"]

