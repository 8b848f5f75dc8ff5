"""SGLang servers sharing one ``kvstore serve`` node: the second hits what the first stored; a tenant or a model
keeps servers apart.

The module's first server stays up; each test starts the other server it needs
once and stops it (they take about 2 GB each). Every server runs
``docs/sglang.md``'s launch line against the same node. An isolation test
also shows that the other server does store and read its own pages, so its
miss on the first server's pages is the namespace at work, not a broken backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.connectors.sglang.server import (
    PAGE_SIZE, SGLangServer, kvstore_config, kvstore_namespace, prompt, wait_stored, warm_page_hash)
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT_TOKENS = 600
STORED_TOKENS = PROMPT_TOKENS // PAGE_SIZE * PAGE_SIZE


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="256MiB", metrics=False) as started:
        yield started


@pytest.fixture(scope="module")
def first(models: dict[str, Path], node: KVNode) -> Iterator[SGLangServer]:
    warm_page_hash()
    with SGLangServer(models["qwen2"], storage=kvstore_config(node.target)) as started:
        yield started


def stored_by_first(first: SGLangServer, node: KVNode, seed: int) -> tuple[list[int], list[int]]:
    """A fresh prompt run on the first server and its pages in the node: the prompt and its output."""
    ids = prompt(PROMPT_TOKENS, seed)
    output = first.generate(ids)
    assert output.storage == 0
    wait_stored(node.target, kvstore_namespace(first.model), ids)
    return ids, output.output_ids


def reads_its_own_pages(server: SGLangServer, node: KVNode, ids: list[int], output: list[int], tenant: str = "") -> None:
    """``server`` stored ``ids`` under its own namespace and, flushed, reads them back with the same output."""
    wait_stored(node.target, kvstore_namespace(server.model, tenant=tenant), ids)
    server.flush_cache()
    again = server.generate(ids)
    assert again.storage == STORED_TOKENS and again.output_ids == output, again


def test_a_second_server_hits_the_pages_the_first_stored(first: SGLangServer, node: KVNode,
                                                        models: dict[str, Path]) -> None:
    ids, reference = stored_by_first(first, node, seed=300)
    with SGLangServer(models["qwen2"], storage=kvstore_config(node.target)) as second:
        output = second.generate(ids)
    assert (output.device, output.host, output.storage) == (0, 0, STORED_TOKENS), output
    assert output.output_ids == reference


def test_a_tenant_keeps_servers_apart(first: SGLangServer, node: KVNode, models: dict[str, Path]) -> None:
    ids, reference = stored_by_first(first, node, seed=301)
    with SGLangServer(models["qwen2"], storage=kvstore_config(node.target, tenant="tenant-b")) as other:
        output = other.generate(ids)
        assert output.storage == 0, output  # the first server's pages are there, under the empty tenant
        assert output.output_ids == reference  # the same model: the same output, computed
        reads_its_own_pages(other, node, ids, output.output_ids, tenant="tenant-b")


def test_a_model_difference_keeps_servers_apart(first: SGLangServer, node: KVNode, models: dict[str, Path]) -> None:
    ids, reference = stored_by_first(first, node, seed=302)
    with SGLangServer(models["qwen2-other"], storage=kvstore_config(node.target)) as other:
        output = other.generate(ids)
        assert output.storage == 0, output
        assert output.output_ids != reference  # other weights, another output: the first's pages would be wrong here
        reads_its_own_pages(other, node, ids, output.output_ids)
