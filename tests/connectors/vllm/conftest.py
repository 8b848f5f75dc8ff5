"""The vLLM connector's tests run only where vLLM is installed (the ``.venv-vllm`` that ``make test-vllm`` builds).

Everything else in the suite runs from ``.venv``, whose transformers vLLM 0.32 does
not accept; ``make test`` runs this directory a second time from ``.venv-vllm``.
Tests that start real engines are marked ``vllm`` (``-m "not vllm"`` skips them).

An engine takes about a minute to start on these machines, so the fault and
isolation tests share one: a Llama engine with LoRA against one ``kvstore serve``
node (``shared_node``, ``shared_engine``), started for whichever of them runs first.
Each test puts into the node what it needs and uses prompts of its own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterator

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]


@pytest.fixture(scope="session")
def shared_node() -> Iterator[Any]:
    from tests.support.kvnode import KVNode

    with KVNode(memory_capacity="256MiB") as node:
        yield node


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.connectors.vllm.harness import write_llama, write_lora, write_qwen2

    root = tmp_path_factory.mktemp("models")
    return {"llama": write_llama(root / "llama"), "qwen2": write_qwen2(root / "qwen2"),
            "lora": write_lora(root / "lora-x", seed=7)}


@pytest.fixture(scope="session")
def shared_engine(shared_node: Any, models: dict[str, Path]) -> Iterator[Any]:
    """A Llama ``kv_both`` engine with LoRA, a 1 s store timeout and a short backoff, two requests at a time."""
    from tests.connectors.vllm.harness import Engine

    extra = {"target": shared_node.target, "timeout_s": 1.0, "down_backoff_s": 0.2}
    with Engine(models["llama"], extra=extra, max_num_seqs=2, enable_lora=True, max_lora_rank=8,
                max_loras=2) as engine:
        yield engine
