"""An engine without ``target``: its worker keeps an embedded store, which the scheduler reaches for lookups.

Its kvstore blocks are 64 tokens, two of vLLM's 32-token blocks each, so the
mapping of one kvstore block onto several vLLM blocks runs in a real engine too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.connectors.vllm.harness import Engine, deltas, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(models: dict[str, Any]) -> Any:
    # no target: an embedded store per worker
    with Engine(models["llama"], kv_role="kv_both", extra={"block_size": 64}) as engine:
        yield engine


def test_a_repeated_prompt_loads_from_the_embedded_store(engine: Engine) -> None:
    prompts = [tokens(230, 61), tokens(100, 62)]
    first = engine.generate(prompts)  # vLLM's prefix caching is off: nothing is reused but through kvstore
    engine.drain()
    before = engine.metrics()
    assert engine.generate(prompts) == first
    grew = deltas(before, engine.metrics(), "lookups", "hit_blocks", "loaded_blocks", "load_failed_blocks")
    assert grew == {"lookups": 2, "hit_blocks": 229 // 64 + 99 // 64, "loaded_blocks": 3 + 1, "load_failed_blocks": 0}


def test_the_embedded_store_stays_in_the_workers_namespace(engine: Engine) -> None:
    namespace = engine.namespace()
    assert namespace.layout == "kv" and namespace.block_size == 64 and "CPU_ATTN" in namespace.model
    assert "/N32/" in namespace.model  # vLLM's kernel block size is part of the page format
