"""An engine without ``target``: its worker keeps an embedded store, which the scheduler reaches for lookups."""

from __future__ import annotations

from typing import Any

import pytest

from tests.connectors.vllm.harness import Engine, deltas, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(models: dict[str, Any]) -> Any:
    with Engine(models["llama"], kv_role="kv_both", extra={}) as engine:  # no target: an embedded store per worker
        yield engine


def test_a_repeated_prompt_loads_from_the_embedded_store(engine: Engine) -> None:
    prompts = [tokens(230, 61), tokens(100, 62)]
    first = engine.generate(prompts)  # vLLM's prefix caching is off: nothing is reused but through kvstore
    engine.drain()
    before = engine.metrics()
    assert engine.generate(prompts) == first
    grew = deltas(before, engine.metrics(), "lookups", "hit_blocks", "loaded_blocks", "load_failed_blocks")
    assert grew == {"lookups": 2, "hit_blocks": 7 + 3, "loaded_blocks": 7 + 3, "load_failed_blocks": 0}


def test_the_embedded_store_stays_in_the_workers_namespace(engine: Engine) -> None:
    namespace = engine.namespace()
    assert namespace.layout == "kv" and namespace.block_size == 32 and "CPU_ATTN" in namespace.model
