"""Tensor parallelism, rank by rank: every rank saves and loads its own shard, in processes of their own.

Without a TP=2 engine (whether vLLM's CPU build runs one here: ``benchmarks/results/hitpath.md``), this
drives the connector's two halves as a TP=2 engine would: the scheduler's real
``SchedulerSide`` plans the saves and the loads for both ranks, and each rank's ``WorkerSide`` runs in a
process of its own (``rank_worker.py``) against one ``kvstore serve`` node. A second "engine" (two new
processes) hits, and each rank gets back its own shard, never the other's; a prefix that one rank lacks
is a miss for both (the scheduler takes the shortest hit over the ranks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.namespaces import RankInfo
from kvstore.connectors.vllm.scheduler import SchedulerSide
from tests.connectors.vllm.harness import REPO_ROOT
from tests.connectors.vllm.rank_worker import FORMAT, N, identity, shard
from tests.connectors.vllm.support import scheduler_output, vllm_request
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = list(range(1, 201))  # 6 full blocks of 32 tokens, and 8 more
SAVED_IDS = [3, 4, 9, 1, 0, 7, 12]
LOADED_IDS = [5, 6, 10, 11, 2, 8, 14]


@pytest.fixture(scope="module")
def node() -> Any:
    with KVNode(memory_capacity="64MiB") as node:
        yield node


def _ranks(node: KVNode) -> Any:
    side = SchedulerSide(parse_config({"target": node.target, "timeout_s": 30}), identity(2), N, load=True, save=True)
    side.set_ranks([RankInfo(0, 0, FORMAT), RankInfo(0, 1, FORMAT)])
    return side


def _run_ranks(node: KVNode, job: str, hashes: dict[int, list[bytes]], block_ids: list[int]) -> dict[int, dict]:
    """Run each rank's job in its own process, all at once; each one's JSON line, by TP rank."""
    procs = {rank: subprocess.Popen(
        [sys.executable, "-m", "tests.connectors.vllm.rank_worker", json.dumps({
            "target": node.target, "tp_rank": rank, "tp_size": 2, "job": job,
            "hashes": [h.hex() for h in chain], "block_ids": block_ids})],
        cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank, chain in hashes.items()}
    results = {}
    for rank, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results[rank] = json.loads(out.strip().splitlines()[-1])
    return results


def _plan_save(side: SchedulerSide, req_id: str, tokens: list[int]) -> dict[int, list[bytes]]:
    request = vllm_request(req_id, tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # a miss: prefilled, then saved
    (job,) = side.build_meta(scheduler_output(new=[(req_id, 0, len(tokens))]), lambda _: SAVED_IDS).saves
    return {tp: job.hashes[(0, tp)] for tp in (0, 1)}


def test_every_rank_saves_and_loads_its_own_shard(node: KVNode) -> None:
    side = _ranks(node)
    try:
        hashes = _plan_save(side, "a", PROMPT)
        assert hashes[0] != hashes[1]  # each rank's blocks have keys of their own
        assert {r["saved"] for r in _run_ranks(node, "save", hashes, SAVED_IDS[:6]).values()} == {6}
        # the second engine: its scheduler finds the prefix on both ranks, and each rank loads its shard
        request = vllm_request("b", PROMPT)
        assert side.get_num_new_matched_tokens(request, 0) == (6 * N, False)
        side.update_state_after_alloc(request, LOADED_IDS, 6 * N)
        (job,) = side.build_meta(scheduler_output(new=[("b", 6 * N, 8)]), lambda _: LOADED_IDS).loads
        loaded = _run_ranks(node, "load", {tp: job.hashes[(0, tp)] for tp in (0, 1)}, job.block_ids)
        for tp in (0, 1):
            assert loaded[tp]["errors"] == []
            expected = [layer[SAVED_IDS[:6]].view(torch.uint8).numpy().tobytes().hex() for layer in shard(tp)]
            assert loaded[tp]["layers"] == expected
        assert loaded[0]["layers"] != loaded[1]["layers"]
    finally:
        side.close()


def test_a_prefix_one_rank_lacks_is_a_miss_for_both(node: KVNode) -> None:
    side = _ranks(node)
    try:
        tokens = list(range(1000, 1200))
        hashes = _plan_save(side, "c", tokens)
        _run_ranks(node, "save", {0: hashes[0]}, SAVED_IDS[:6])  # rank 1 never saved it
        assert side.get_num_new_matched_tokens(vllm_request("d", tokens), 0) == (0, False)
    finally:
        side.close()
