"""The replay against the reference figures of benchmarks/traces/README.md, and policy/tier sanity."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.sim import BeladyPolicy, NextUseOracle, simulate
from kvstore.trace import TraceRequest, read_trace

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"


@pytest.fixture(scope="module")
def conversation() -> list[TraceRequest]:
    return read_trace(TRACES / "mooncake_conversation_trace.jsonl")


@pytest.fixture(scope="module")
def synthetic() -> list[TraceRequest]:
    return read_trace(TRACES / "mooncake_synthetic_trace.jsonl")


def test_conversation_reference_figures(conversation: list[TraceRequest]) -> None:
    infinite = simulate(conversation, "lru", None)
    assert infinite.hit_ratio == pytest.approx(0.3664, abs=0.002)
    assert infinite.num_unique_blocks == 182790
    lru = simulate(conversation, "lru", 5859)
    assert lru.hit_ratio == pytest.approx(0.136, abs=0.002)
    belady = simulate(conversation, "belady", 5859)
    assert belady.hit_ratio == pytest.approx(0.350, abs=0.01)
    priority = simulate(conversation, "priority", 5859)
    assert lru.hit_ratio <= priority.hit_ratio <= belady.hit_ratio <= infinite.hit_ratio
    assert lru.hit_tokens <= lru.input_tokens


def test_synthetic_reference_figures(synthetic: list[TraceRequest]) -> None:
    assert simulate(synthetic, "lru", None).hit_ratio == pytest.approx(0.6396, abs=0.002)
    lru = simulate(synthetic, "lru", 5859)
    assert lru.hit_ratio == pytest.approx(0.309, abs=0.002)
    for capacity in (1000, 20000):
        assert simulate(synthetic, "priority", capacity).hit_ratio >= simulate(synthetic, "lru", capacity).hit_ratio


def test_second_tier_adds_hits(synthetic: list[TraceRequest]) -> None:
    ram = simulate(synthetic, "lru", 2000)
    tiered = simulate(synthetic, "lru", 2000, disk_capacity_blocks=8000)
    bigger = simulate(synthetic, "lru", 10000)
    assert ram.hit_ratio < tiered.hit_ratio
    assert tiered.hit_blocks_per_tier[0] == ram.hit_blocks  # exclusive tiers: the top tier acts alone
    assert sum(tiered.hit_blocks_per_tier) == tiered.hit_blocks
    assert tiered.hit_blocks <= bigger.hit_blocks + 1
    assert tiered.demoted_blocks > 0


def _req(t: float, *blocks: int) -> TraceRequest:
    return TraceRequest(t, 512 * len(blocks), 0, blocks)


def test_replay_model_on_a_tiny_trace() -> None:
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 4), _req(2, 5, 6), _req(3, 1, 2, 3)]
    # capacity 3: after r1 {1,2,4} (3 evicted, tail first); r2 evicts 4 then 2 (LRU tail); r3 hits only 1.
    result = simulate(trace, "lru", 3)
    assert result.hit_blocks == 2 + 0 + 1
    assert result.num_blocks == 11
    assert simulate(trace, "lru", None).hit_blocks == 2 + 3
    # a second tier of 3 keeps what the first drops: r3 hits 1 in RAM, then 2 and 3 in disk.
    tiered = simulate(trace, "lru", 3, disk_capacity_blocks=3)
    assert tiered.hit_blocks_per_tier == (2 + 1, 2)


def test_token_hit_ratio_caps_the_partial_last_block() -> None:
    trace = [TraceRequest(0, 700, 0, (1, 2)), TraceRequest(1, 700, 0, (1, 2))]
    result = simulate(trace, "lru", None)
    assert result.hit_blocks == 2
    assert result.hit_tokens == 700
    assert result.token_hit_ratio == pytest.approx(0.5)


def test_belady_evicts_the_farthest_next_use() -> None:
    oracle = NextUseOracle([[1, 2], [3], [2], [1]])
    policy = BeladyPolicy(oracle)
    oracle.advance(0)
    policy.insert(1, 1)
    policy.insert(2, 1)
    oracle.advance(1)
    policy.insert(3, 1)  # never used again
    assert policy.victims(1) == [3]
    assert policy.victims(2) == [3, 1]
    policy.pin(3)
    assert policy.victims(1) == [1]
    assert policy.remove(3) == 1 and 3 not in policy
    assert len(policy) == 2 and policy.nbytes == 2


def test_rejects_bad_arguments(synthetic: list[TraceRequest]) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        simulate(synthetic, "fifo", 10)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        simulate(synthetic, "lru", -1)
