"""A hit is pinned from the scheduler's lookup to the worker's load, and every rank's lookup goes out at once.

Through a real embedded store and its lookup endpoint (the scheduler's Lookups
cross gRPC, the worker reads in process): puts that fill the store between the
lookup and the load evict other blocks, not the looked-up prefix
(``hit_pin_s``, the lookup's ``ttl_s`` pin); without the pin the prefix is
evicted, and the load counts it as lost rather than recomputing it silently.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import torch

from kvstore.api import LookupResult
from kvstore.config import Config, MemoryTierConfig, StoreConfig
from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.namespaces import RankInfo, storage_namespace
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.stores import LookupEndpoint
from kvstore.embedded import EmbeddedStore
from kvstore.keys import HashAlgorithm, Namespace, hash_blocks
from tests.connectors.vllm.support import (
    WORKER_FORMAT,
    WORKER_IDENTITY,
    cpu_caches,
    cpu_worker,
    scheduler_output,
    vllm_request,
)

VLLM_BLOCK = 32
BLOCK_BYTES = WORKER_FORMAT.num_layers * 2 * WORKER_FORMAT.num_kv_heads * VLLM_BLOCK * WORKER_FORMAT.head_size * 2
NUM_PROMPT_BLOCKS = 6
CAPACITY_BLOCKS = 16


def _namespace() -> Namespace:
    return storage_namespace(WORKER_IDENTITY, RankInfo(0, 0, WORKER_FORMAT), block_size=VLLM_BLOCK,
                             hash_algorithm=HashAlgorithm.XXH3_128)


def _put(store: EmbeddedStore, tokens: list[int], num_blocks: int) -> None:
    hashes = hash_blocks(_namespace(), tokens[:num_blocks * VLLM_BLOCK])
    store.put(_namespace(), hashes, [torch.randn(WORKER_FORMAT.block_shape(VLLM_BLOCK)).bfloat16() for _ in hashes])


def _load_after_evictions(store: EmbeddedStore, endpoint: LookupEndpoint, hit_pin_s: float, first_token: int) -> Any:
    """Look a 6-block prompt up, fill the store past its capacity with other blocks, then load the prompt; the
    worker's counts."""
    tokens = list(range(first_token, first_token + NUM_PROMPT_BLOCKS * VLLM_BLOCK + 8))
    _put(store, tokens, NUM_PROMPT_BLOCKS)
    side = SchedulerSide(parse_config({"hit_pin_s": hit_pin_s}), WORKER_IDENTITY, VLLM_BLOCK, load=True, save=False)
    side.set_ranks([RankInfo(0, 0, WORKER_FORMAT, endpoint.target, endpoint.token)])
    request = vllm_request(f"r{first_token}", tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (NUM_PROMPT_BLOCKS * VLLM_BLOCK, False)
    block_ids = list(range(NUM_PROMPT_BLOCKS + 1))
    side.update_state_after_alloc(request, block_ids, NUM_PROMPT_BLOCKS * VLLM_BLOCK)
    meta = side.build_meta(scheduler_output(new=[(request.request_id, 0, len(tokens))]), lambda _: block_ids)
    side.close()
    filler = list(range(first_token + 100_000, first_token + 100_000 + 2 * CAPACITY_BLOCKS * VLLM_BLOCK))
    for first in range(0, len(filler), 2 * VLLM_BLOCK):  # other requests' saves: twice what the store holds
        _put(store, filler[first:first + 2 * VLLM_BLOCK], 2)
    worker = cpu_worker(store, cpu_caches(0), block_size=VLLM_BLOCK)
    worker.start_load(meta)
    errors = worker.take_load_errors()
    stats = worker.take_stats()
    assert stats is not None
    return stats.data, errors


def test_a_pinned_hit_survives_evictions_between_lookup_and_load_and_a_lost_one_is_counted() -> None:
    config = Config(store=StoreConfig(memory=MemoryTierConfig(capacity_bytes=CAPACITY_BLOCKS * (BLOCK_BYTES + 4096),
                                                              page_bytes=4096)))
    with EmbeddedStore(config.store) as store:
        endpoint = LookupEndpoint(store, config)
        try:
            pinned, errors = _load_after_evictions(store, endpoint, hit_pin_s=60, first_token=1)
            assert pinned["loaded_blocks"] == NUM_PROMPT_BLOCKS and pinned["lost_blocks"] == 0 and not errors
            lost, errors = _load_after_evictions(store, endpoint, hit_pin_s=0, first_token=10_000)
            assert lost["loaded_blocks"] == 0 and lost["lost_blocks"] == NUM_PROMPT_BLOCKS
            assert lost["load_failed_blocks"] == NUM_PROMPT_BLOCKS and len(errors) == NUM_PROMPT_BLOCKS
        finally:
            endpoint.close()


class _Meeting:
    """A rank's lookup client that answers only once every rank's lookup has arrived (serial lookups time out)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier
        self.calls: list[dict[str, Any]] = []

    def lookup(self, namespace: Any, hashes: Any, **extra: Any) -> LookupResult:
        self.calls.append(extra)
        self.barrier.wait()
        return LookupResult(len(hashes), ("memory",) * len(hashes))

    def close(self) -> None:
        """Nothing to close."""


def test_every_ranks_lookup_goes_out_at_once_and_pins_the_hit() -> None:
    side = SchedulerSide(parse_config({"target": "127.0.0.1:1", "hit_pin_s": 7}), replace(WORKER_IDENTITY, tp_size=2),
                         VLLM_BLOCK, load=True, save=False)
    side.set_ranks([RankInfo(0, 0, WORKER_FORMAT), RankInfo(0, 1, WORKER_FORMAT)])
    barrier = threading.Barrier(2, timeout=10)
    ranks = [_Meeting(barrier), _Meeting(barrier)]
    for key, client in zip([(0, 0), (0, 1)], ranks):
        side._clients.pop(key).close()  # a client of the (absent) node: the ranks get clients that meet instead
        side._clients[key] = client
    tokens = list(range(1, 201))
    assert side.get_num_new_matched_tokens(vllm_request("r", tokens), 0) == (192, False)
    assert [call["ttl_s"] for rank in ranks for call in rank.calls] == [7, 7]
    request = vllm_request("s", tokens, extra_args={"kv_transfer_params": {"kvstore": {"ttl_s": 300}}})
    side.get_num_new_matched_tokens(request, 0)
    assert [rank.calls[-1]["ttl_s"] for rank in ranks] == [300, 300]  # the request's own TTL pins it instead
    side.close()
