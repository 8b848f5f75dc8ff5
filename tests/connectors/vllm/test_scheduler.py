"""Tests of the scheduler's half: lookups beyond the local hit, load plans, save plans, roles, failures.

The store is a real embedded store reached through its real lookup endpoint
(``LookupEndpoint``), as the scheduler of an engine without ``target`` reaches it;
requests are vLLM's own ``Request`` objects.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from kvstore.config import Config, MemoryTierConfig, StoreConfig
from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.layout import PageFormat
from kvstore.connectors.vllm.namespaces import ModelIdentity, RankInfo, storage_namespace
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.stores import LookupEndpoint
from kvstore.embedded import EmbeddedStore
from kvstore.errors import UnavailableError
from kvstore.keys import HashAlgorithm, hash_blocks
from tests.connectors.vllm.support import scheduler_output, vllm_request

VLLM_BLOCK = 32
FORMAT = PageFormat(backend="CPU_ATTN", family="split_tokens", interior="cpu_attn:isa=vec", num_layers=2,
                    num_kv_heads=2, head_size=32, unit_tokens=32, dtype="bfloat16", cache_dtype="auto")
IDENTITY = ModelIdentity(model_id="m", revision="", config_digest="c", act_dtype="bfloat16", quantization="",
                         tp_size=1, pp_size=1)
PROMPT = list(range(1, 201))  # 200 tokens: 6 full blocks of 32


@pytest.fixture(scope="module")
def store() -> Any:
    config = Config(store=StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20)))
    with EmbeddedStore(config.store) as store:
        endpoint = LookupEndpoint(store, config)
        yield store, endpoint
        endpoint.close()


def _scheduler(store: Any, *, block_size: int | None = None, load: bool = True, save: bool = True,
               **extra: Any) -> SchedulerSide:
    _, endpoint = store
    config = parse_config({**({"block_size": block_size} if block_size else {}), **extra})
    side = SchedulerSide(config, IDENTITY, VLLM_BLOCK, load=load, save=save)
    side.set_ranks([RankInfo(0, 0, FORMAT, endpoint.target, endpoint.token)])
    return side


def _put(store: Any, tokens: list[int], num_blocks: int, *, block_size: int = VLLM_BLOCK, salt: str = "") -> None:
    """Store the first ``num_blocks`` blocks of ``tokens`` under the scheduler's namespace."""
    embedded, _ = store
    namespace = storage_namespace(IDENTITY, RankInfo(0, 0, FORMAT), block_size=block_size,
                                  hash_algorithm=HashAlgorithm.XXH3_128, cache_salt=salt)
    hashes = hash_blocks(namespace, tokens[: num_blocks * block_size])
    blocks = [torch.zeros(FORMAT.block_shape(block_size), dtype=torch.bfloat16) for _ in hashes]
    embedded.put(namespace, hashes, blocks)


def test_whole_blocks_past_the_local_hit_and_never_the_last_token(store: Any) -> None:
    tokens = list(range(1000, 1192))  # exactly 6 blocks
    _put(store, tokens, 6)
    side = _scheduler(store)
    assert side.get_num_new_matched_tokens(vllm_request("a", tokens), 0) == (160, False)  # 5 blocks: not the last
    assert side.get_num_new_matched_tokens(vllm_request("b", tokens), 64) == (96, False)  # past vLLM's 2 local blocks
    assert side.get_num_new_matched_tokens(vllm_request("c", tokens), 160) == (0, False)
    stats = side.take_stats()
    assert stats is not None and stats.data["lookups"] == 2 and stats.data["hit_blocks"] == 5 + 3


def test_the_hit_stops_at_the_first_missing_block(store: Any) -> None:
    tokens = list(range(2000, 2200))
    _put(store, tokens, 3)
    side = _scheduler(store)
    assert side.get_num_new_matched_tokens(vllm_request("a", tokens), 0) == (96, False)
    assert side.get_num_new_matched_tokens(vllm_request("b", tokens), 32) == (64, False)
    assert side.get_num_new_matched_tokens(vllm_request("c", list(range(1, 200))), 0) == (0, False)


def test_the_load_plan_names_the_allocated_vllm_blocks(store: Any) -> None:
    """kvstore blocks of 64 tokens (2 vLLM blocks); vLLM holds the first 32 tokens itself."""
    tokens = list(range(3000, 3200))
    _put(store, tokens, 3, block_size=64)
    side = _scheduler(store, block_size=64)
    request = vllm_request("r", tokens)
    assert side.get_num_new_matched_tokens(request, 32) == (160, False)
    side.update_state_after_alloc(request, [40, 41, 42, 43, 44, 45, 46], 160)
    meta = side.build_meta(scheduler_output(new=[("r", 32, 200 - 192)]), lambda _: [40, 41, 42, 43, 44, 45, 46])
    (job,) = meta.loads
    assert (job.first_block, job.skip_tokens, job.block_ids) == (0, 32, [41, 42, 43, 44, 45])
    assert len(job.hashes[(0, 0)]) == 3
    assert meta.saves == []  # the loaded blocks are in the store already
    assert side.build_meta(scheduler_output(), lambda _: []).loads == []  # a load is planned once


def test_no_load_when_vllm_takes_no_external_tokens(store: Any) -> None:
    tokens = list(range(3500, 3700))
    _put(store, tokens, 2)
    side = _scheduler(store)
    request = vllm_request("r", tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (64, False)
    side.update_state_after_alloc(request, [1, 2, 3, 4, 5, 6, 7], 0)
    assert side.build_meta(scheduler_output(), lambda _: []).loads == []


def test_prompt_blocks_are_saved_in_the_step_that_completes_them(store: Any) -> None:
    side = _scheduler(store)
    request = vllm_request("r", list(range(4000, 4200)))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    blocks = [10, 11, 12, 13, 14, 15, 16]
    first = side.build_meta(scheduler_output(new=[("r", 0, 80)]), lambda _: blocks)  # chunked prefill: 80 tokens
    assert [(s.block_ids, s.at_finish) for s in first.saves] == [([10, 11], False)]
    second = side.build_meta(scheduler_output(cached=[("r", 80, 120)]), lambda _: blocks)  # the rest of the prompt
    assert [s.block_ids for s in second.saves] == [[12, 13, 14, 15]]
    assert side.build_meta(scheduler_output(cached=[("r", 200, 1)]), lambda _: blocks).saves == []  # decoding


def test_generated_blocks_are_saved_once_when_the_request_ends(store: Any) -> None:
    side = _scheduler(store)
    request = vllm_request("r", list(range(5000, 5200)))
    side.get_num_new_matched_tokens(request, 0)
    blocks = list(range(20, 28))
    side.build_meta(scheduler_output(new=[("r", 0, 200)]), lambda _: blocks)  # saves prompt blocks 0..5
    for token in range(60):  # 60 generated tokens: 259 of 260 tokens computed
        request.append_output_token_ids(7 + token)
    request.num_computed_tokens = 259
    assert side.request_finished(request, blocks) is True  # vLLM keeps the blocks until the copy
    (job,) = side.build_meta(scheduler_output(), lambda _: []).saves
    assert job.at_finish and job.block_ids == [26, 27] and len(job.hashes[(0, 0)]) == 2
    assert side.request_finished(vllm_request("other", [1, 2, 3]), [5]) is False  # nothing to save


def test_roles_and_per_request_options(store: Any) -> None:
    tokens = list(range(6000, 6200))
    _put(store, tokens, 6)
    producer = _scheduler(store, load=False)
    request = vllm_request("p", tokens)
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    assert producer.take_stats() is None  # no lookup at all
    assert producer.build_meta(scheduler_output(new=[("p", 0, 200)]), lambda _: list(range(7))).saves  # saves blocks

    consumer = _scheduler(store, save=False)
    request = vllm_request("c", tokens)
    assert consumer.get_num_new_matched_tokens(request, 0) == (192, False)
    assert consumer.build_meta(scheduler_output(new=[("c", 0, 200)]), lambda _: list(range(7))).saves == []
    assert consumer.request_finished(request, list(range(7))) is False

    both = _scheduler(store)
    opt_out = vllm_request("o", tokens, extra_args={"kv_transfer_params": {"kvstore": {"load": False, "save": False}}})
    assert both.get_num_new_matched_tokens(opt_out, 0) == (0, False)
    assert both.build_meta(scheduler_output(new=[("o", 0, 200)]), lambda _: list(range(7))).saves == []


def test_requests_given_as_embeddings_are_neither_looked_up_nor_saved(store: Any) -> None:
    side = _scheduler(store)
    request = Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(100, 8))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.request_finished(request, [1, 2, 3]) is False


def test_a_failed_lookup_is_a_miss_and_the_store_is_left_alone_for_a_while(store: Any) -> None:
    calls = []

    class Down:
        def lookup(self, namespace: Any, hashes: Any, **agentic: Any) -> Any:
            calls.append(len(hashes))
            raise UnavailableError("node down")

    side = _scheduler(store, down_backoff_s=3600)
    side._clients[(0, 0)] = Down()
    assert side.get_num_new_matched_tokens(vllm_request("a", PROMPT), 0) == (0, False)
    assert side.get_num_new_matched_tokens(vllm_request("b", PROMPT), 0) == (0, False)
    assert len(calls) == 1  # the second request did not wait for a down node
    stats = side.take_stats()
    assert stats is not None and stats.data["lookup_errors"] == 2


def test_a_failed_load_lowers_the_saved_mark_so_the_recomputed_blocks_are_saved(store: Any) -> None:
    tokens = list(range(7000, 7200))
    _put(store, tokens, 6)
    side = _scheduler(store)
    request = vllm_request("r", tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (192, False)
    side.update_state_after_alloc(request, list(range(7)), 192)
    side.build_meta(scheduler_output(new=[("r", 0, 8)]), lambda _: list(range(7)))
    side.load_failed({"r": 4})  # blocks 4 and 5 did not load: vLLM recomputes from token 128
    meta = side.build_meta(scheduler_output(cached=[("r", 128, 72)]), lambda _: list(range(7)))
    assert [s.block_ids for s in meta.saves] == [[4, 5]]


def test_hit_sources_follow_the_tiers(store: Any) -> None:
    tokens = list(range(8000, 8200))
    _put(store, tokens, 4)
    side = _scheduler(store)
    request = vllm_request("r", tokens)
    num_tokens, _ = side.get_num_new_matched_tokens(request, 32)
    assert side.hit_sources(request, num_tokens) == {"host": 96}  # the embedded store's memory tier


def test_external_tokens_that_are_not_whole_kvstore_blocks_are_recomputed(store: Any) -> None:
    """If vLLM takes a part of the hit that ends inside a kvstore block, those tokens are reported as failed."""
    tokens = list(range(9000, 9200))
    _put(store, tokens, 3, block_size=64)
    side = _scheduler(store, block_size=64)
    request = vllm_request("r", tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (192, False)
    side.update_state_after_alloc(request, list(range(7)), 160)  # 2.5 kvstore blocks
    (job,) = side.build_meta(scheduler_output(new=[("r", 0, 8)]), lambda _: list(range(7))).loads
    assert job.hashes == {} and job.block_ids == [0, 1, 2, 3, 4]
