"""kvstore under a running SGLang server (CPU): a flushed prefix comes back from storage; faults during a prefetch.

One SGLang server with HiCache and kvstore's backend against one ``kvstore
serve`` node, started once for the module (``docs/sglang.md``'s launch line,
``page_first``). The reference outputs come first from a server of the same
model without HiCache, closed before the HiCache server starts. SGLang's own
``meta_info.cached_tokens_details`` says where a request's cached tokens came
from (``device``, ``host``, ``storage``); ``/flush_cache`` empties the device and
host tiers and leaves storage. Which backend calls ran, and when, comes from the
server's call probe (``cpu_site/kvstore_sglang_probe.py``).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.connectors.sglang.pages import block_hashes
from tests.connectors.sglang.server import (
    PAGE_SIZE, SGLangServer, kvstore_config, kvstore_namespace, kvstore_page_shape, page_keys, prompt, wait_stored,
    warm_page_hash)
from tests.connectors.sglang.cpu_site.kvstore_sglang_cpu import ADAPTATIONS
from tests.support.kvnode import KVNode
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT_TOKENS = 600
"""37 full pages and 8 tokens: SGLang reuses the 592 tokens of the full pages (it computes the last token itself)."""
STORED_TOKENS = PROMPT_TOKENS // PAGE_SIZE * PAGE_SIZE
PROMPTS = {name: prompt(PROMPT_TOKENS, seed) for seed, name in enumerate(
    ("flush", "wrong-kv", "frozen", "killed"), start=100)}
WAIT_S = 120.0
"""Bound on waits for what a server does in the background (a backup reaching the node); not a timing check."""


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> dict[str, list[int]]:
    """Each prompt's output from a server of the same model without HiCache (closed before the HiCache server starts)."""
    with SGLangServer(models["qwen2"]) as plain:
        return {name: plain.generate(ids).output_ids for name, ids in PROMPTS.items()}


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="256MiB", metrics=False) as started:
        yield started


@pytest.fixture(scope="module")
def server(models: dict[str, Path], node: KVNode, references: dict[str, list[int]]) -> Iterator[SGLangServer]:
    """The HiCache server: kvstore's backend on ``node``, a store call may take 30 s (SGLang's prefetch timeout, 1 s
    and a bit, is the shorter bound), a 0.2 s backoff after a failure."""
    warm_page_hash()
    storage = kvstore_config(node.target, timeout_s=30.0, down_backoff_s=0.2)
    with SGLangServer(models["qwen2"], storage=storage) as started:
        yield started


def wait_stored_by(model: Path, node: KVNode, ids: list[int]) -> None:
    """Wait until the server's backup thread put every full page of ``ids`` in the node (write-through, asynchronous)."""
    wait_stored(node.target, kvstore_namespace(model), ids, WAIT_S)


def entered(server: SGLangServer, call: str, since: int) -> bool:
    """Whether the backend's ``call`` started after the first ``since`` probe records."""
    return any(r["call"] == call and r["phase"] == "enter" for r in server.storage_calls()[since:])


def test_the_cpu_scaffolding_is_still_needed(server: SGLangServer) -> None:
    """Every CPU adaptation found its defect in SGLang 0.5.23: one that did not is fixed upstream, and goes."""
    report = server.scaffolding_report()
    seen = {r["adaptation"] for r in report}
    assert seen == set(ADAPTATIONS), f"checks that never ran (SGLang no longer goes there?): {set(ADAPTATIONS) - seen}"
    not_needed = [r for r in report if not r["needed"]]
    assert not not_needed, f"adaptations SGLang or torchvision no longer needs; remove them: {not_needed}"


def test_a_flushed_prefix_comes_back_from_kvstore(server: SGLangServer, node: KVNode, models: dict[str, Path],
                                                  references: dict[str, list[int]]) -> None:
    ids = PROMPTS["flush"]
    first = server.generate(ids)
    assert (first.cached_tokens, first.storage) == (0, 0)
    wait_stored_by(models["qwen2"], node, ids)
    server.flush_cache()
    again = server.generate(ids)
    assert (again.device, again.host, again.storage) == (0, 0, STORED_TOKENS), again
    assert again.cached_tokens == STORED_TOKENS and again.storage_backend == "KVStoreHiCacheStorage"
    assert again.output_ids == first.output_ids == references["flush"]
    reads = [r for r in server.storage_calls() if r["call"] == "batch_get_v1" and r["phase"] == "exit"]
    assert reads and reads[-1]["result"] == STORED_TOKENS // PAGE_SIZE


def test_wrong_pages_in_kvstore_change_the_output(server: SGLangServer, node: KVNode, models: dict[str, Path],
                                                  references: dict[str, list[int]]) -> None:
    """The negative control: random pages under the prompt's keys are loaded, and the output changes.

    So the equality above can fail: had SGLang recomputed the prefix, or
    ignored what it read, this output would equal the reference.
    """
    ids = PROMPTS["wrong-kv"]
    hashes = block_hashes(page_keys(ids))
    generator = torch.Generator().manual_seed(5)
    pages = [torch.randn(kvstore_page_shape(), generator=generator).to(torch.bfloat16) for _ in hashes]
    with KVStoreClient(node.target) as client:
        assert client.put(kvstore_namespace(models["qwen2"]), hashes, pages) == len(hashes)
    output = server.generate(ids)
    assert output.storage == STORED_TOKENS, output
    assert output.output_ids != references["wrong-kv"]


def _stored_then_flushed(server: SGLangServer, node: KVNode, model: Path, ids: list[int]) -> None:
    server.generate(ids)
    wait_stored_by(model, node, ids)
    server.flush_cache()


def _writes(server: SGLangServer, since: int) -> list[dict[str, Any]]:
    return [r for r in server.storage_calls()[since:] if r["call"] == "batch_set_v1" and r["phase"] == "exit"]


def _hits_again(server: SGLangServer, node: KVNode, model: Path, name: str, seeds: Any) -> None:
    """Once the node answers again (and the backend's backoff is over), a fresh prompt is stored and read back.

    A prompt whose backup the backend skipped or failed (its ``batch_set_v1``
    stored fewer pages than it was given, as the probe shows) is given up for the
    next one.
    """
    def round_trip() -> bool:
        ids = prompt(PROMPT_TOKENS, next(seeds))
        pages = len(page_keys(ids))
        since = len(server.storage_calls())
        first = server.generate(ids)
        wait_until(lambda: sum(r["keys"] for r in _writes(server, since)) >= pages, WAIT_S,
                   "SGLang backs the prompt's pages up", pause_s=0.2)
        if any(r["result"] < r["keys"] for r in _writes(server, since)):
            return False  # a write in the backoff, or one that failed: another prompt
        wait_stored_by(model, node, ids)
        server.flush_cache()
        again = server.generate(ids)
        assert again.output_ids == first.output_ids
        return again.storage == STORED_TOKENS

    wait_until(round_trip, WAIT_S, f"after the {name} node, a prompt is read back from kvstore", pause_s=0.2)


def test_a_node_frozen_during_a_prefetch_is_recomputed_within_sglangs_timeout(
        server: SGLangServer, node: KVNode, models: dict[str, Path], references: dict[str, list[int]]) -> None:
    """SIGSTOP: the lookup waits on the node; SGLang's prefetch timeout ends the wait, and the prefix is recomputed."""
    ids = PROMPTS["frozen"]
    _stored_then_flushed(server, node, models["qwen2"], ids)
    since = len(server.storage_calls())
    os.kill(node.pid, signal.SIGSTOP)  # connections stay open; nothing answers
    try:
        output = server.generate(ids)
        calls = server.storage_calls()[since:]
        lookups = [r for r in calls if r["call"] == "batch_exists"]
        # the request finished while the lookup still waited on the node: SGLang did not wait for it
        assert [r["phase"] for r in lookups] == ["enter"], calls
    finally:
        os.kill(node.pid, signal.SIGCONT)
    assert output.storage == 0 and output.output_ids == references["frozen"], output
    wait_until(lambda: sum(r["call"] == "batch_exists" and r["phase"] == "exit"
                           for r in server.storage_calls()[since:]) >= 1, WAIT_S, "the lookup returns once thawed")
    _hits_again(server, node, models["qwen2"], "thawed", iter(range(1000, 2000)))


def test_a_node_killed_during_a_prefetch_is_recomputed_and_hit_again_once_back(
        server: SGLangServer, node: KVNode, models: dict[str, Path], references: dict[str, list[int]]) -> None:
    """The node dies while SGLang's lookup waits on it: a miss, the prefix recomputed; the restarted node serves again."""
    ids = PROMPTS["killed"]
    _stored_then_flushed(server, node, models["qwen2"], ids)
    since = len(server.storage_calls())
    os.kill(node.pid, signal.SIGSTOP)  # the lookup will wait on it...
    with ThreadPoolExecutor(1) as executor:
        request = executor.submit(server.generate, ids)
        wait_until(lambda: entered(server, "batch_exists", since), WAIT_S, "SGLang's lookup reaches the node")
        node.kill()  # ...and the node dies under it
        output = request.result(timeout=WAIT_S)
    assert output.storage == 0 and output.output_ids == references["killed"], output
    node.start()  # same port, empty (a memory tier)
    _hits_again(server, node, models["qwen2"], "restarted", iter(range(2000, 3000)))
