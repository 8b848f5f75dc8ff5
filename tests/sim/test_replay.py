"""The replay against the reference figures of benchmarks/traces/README.md, the replay model on hand-counted
traces, the bound (exact against brute force), and determinism across processes."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.tools.sim import SimNode, belady_bound, check_chains, simulate
from kvstore.tools.trace import TraceRequest, read_trace

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "benchmarks" / "traces"


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
    bound = simulate(conversation, "belady", 5859)
    assert bound.bound_exact is True
    default = simulate(conversation, "default", 5859)
    assert lru.hit_ratio <= default.hit_ratio <= bound.hit_ratio <= infinite.hit_ratio
    assert lru.hit_tokens <= lru.input_tokens


def test_synthetic_reference_figures(synthetic: list[TraceRequest]) -> None:
    assert simulate(synthetic, "lru", None).hit_ratio == pytest.approx(0.6396, abs=0.002)
    assert simulate(synthetic, "lru", 5859).hit_ratio == pytest.approx(0.309, abs=0.002)
    # 1 %, 5 %, 25 % of the distinct blocks: the floor holds, within 0.5 % of LRU; at 1 % within 1 %: the node
    # counts 4,609 hit blocks for the default and 4,644 for LRU there, as the simulator does (the replay model the
    # simulator replaced counted more for the default, and passed 0.5 %)
    for capacity, floor in ((439, 0.99), (2196, 0.995), (10981, 0.995)):
        lru = simulate(synthetic, "lru", capacity).hit_ratio
        assert simulate(synthetic, "default", capacity).hit_ratio >= lru * floor
        assert simulate(synthetic, "belady", capacity).hit_ratio >= lru


def test_a_disk_tier_adds_hits(synthetic: list[TraceRequest]) -> None:
    ram = simulate(synthetic, "lru", 2000)
    tiered = simulate(synthetic, "lru", 2000, disk_capacity_blocks=8000)
    bigger = simulate(synthetic, "lru", 10000)
    assert ram.hit_ratio < tiered.hit_ratio <= bigger.hit_ratio + 0.01
    assert sum(tiered.hit_blocks_per_tier) == tiered.hit_blocks
    assert tiered.demoted_blocks > 0
    assert simulate(synthetic, "belady", 2000, disk_capacity_blocks=8000).hit_blocks == \
        simulate(synthetic, "belady", 10000).hit_blocks  # the bound counts the tiers' sum


def _req(t: float, *blocks: int) -> TraceRequest:
    return TraceRequest(t, 512 * len(blocks), 0, blocks)


def test_replay_model_on_a_tiny_trace() -> None:
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 4), _req(2, 5, 6), _req(3, 1, 2, 3)]
    # capacity 3, LRU. r0: miss all; order (least recent first) 3 2 1.
    # r1: hits 1 2; its put of 4 pins 1 2 and evicts 3, then touches 2 1 again: 4 2 1.
    # r2: evicts 4 and 2 (the tail of the chain before its head): 1 6 5. r3: hits 1 only.
    result = simulate(trace, "lru", 3)
    assert result.hit_blocks == 2 + 0 + 1
    assert result.num_blocks == 11
    assert simulate(trace, "lru", None).hit_blocks == 2 + 3
    # a disk tier of 3 keeps what memory drops: r3 hits 1 in memory, then 2 and 3 on disk.
    tiered = simulate(trace, "lru", 3, disk_capacity_blocks=3)
    assert tiered.hit_blocks_per_tier == (2 + 1, 2)


def test_a_put_cannot_push_out_its_own_prefix() -> None:
    # a chain longer than the cache: the node's order once evicted the request's own head for its tail
    chain = tuple(range(10))
    trace = [_req(0, *chain), _req(1, *chain, 10, 11, 12, 13), _req(2, *chain, 10, 11, 12, 13, 14)]
    result = simulate(trace, "lru", 6)
    assert result.hit_blocks == 6 + 6  # the first six blocks stay, request after request


def test_token_hit_ratio_caps_the_partial_last_block() -> None:
    trace = [TraceRequest(0, 700, 0, (1, 2)), TraceRequest(1, 700, 0, (1, 2))]
    result = simulate(trace, "lru", None)
    assert result.hit_blocks == 2
    assert result.hit_tokens == 700
    assert result.token_hit_ratio == pytest.approx(0.5)


def test_the_bound_bypasses_blocks_not_needed_soon() -> None:
    # capacity 2: after r0 keep 1 and 2 (needed at r2, r3); 3 is never needed again: bypassed
    chains = [[1, 2], [3], [1], [2]]
    assert belady_bound(chains, 2).hit_blocks == 2
    # MIN without bypass would have had to admit 3 and evict 1 or 2
    assert belady_bound(chains, 1).hit_blocks == 1


def _brute_force(chains: list[list[int]], capacity: int) -> int:
    """The optimum of the bound's model by search over every choice of what to keep after each request."""
    best = 0
    states = {frozenset(): 0}
    for chain in chains:
        following: dict[frozenset[int], int] = {}
        for state, hits in states.items():
            prefix = 0
            for key in chain:
                if key not in state:
                    break
                prefix += 1
            pool = sorted(state | set(chain))
            for size in range(min(capacity, len(pool)) + 1):
                for kept in itertools.combinations(pool, size):
                    kept_set = frozenset(kept)
                    following[kept_set] = max(following.get(kept_set, -1), hits + prefix)
        states = following
    best = max(states.values())
    return best


def _random_chains(rng: random.Random, num_requests: int) -> list[list[int]]:
    """Requests that walk a random prefix tree: chained ids, so the chain property holds."""
    children: dict[int, list[int]] = {}
    next_id = [1]
    chains = []
    for _ in range(num_requests):
        chain, node = [], 0
        for _ in range(rng.randint(1, 4)):
            options = children.setdefault(node, [])
            if options and rng.random() < 0.7:
                node = rng.choice(options)
            else:
                node = next_id[0]
                next_id[0] += 1
                options.append(node)
            chain.append(node)
        chains.append(chain)
    return chains


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_the_optimum_on_prefix_chains(seed: int) -> None:
    rng = random.Random(seed)
    chains = _random_chains(rng, 7)
    assert check_chains(chains)
    for capacity in (1, 2, 3):
        bound = belady_bound(chains, capacity)
        assert bound.exact
        assert bound.hit_blocks == bound.block_hits  # the cache stays closed under prefixes
        assert bound.hit_blocks == _brute_force(chains, capacity)
        requests = [_req(i, *c) for i, c in enumerate(chains)]
        for policy in ("lru", "slru", "adaptive"):
            assert simulate(requests, policy, capacity).hit_blocks <= bound.hit_blocks


def test_the_bound_is_an_upper_bound_without_the_chain_property() -> None:
    chains = [[1, 2], [2, 1], [1, 3], [3, 2], [2, 1]]  # ids at several positions
    assert not check_chains(chains)
    bound = belady_bound(chains, 2)
    assert not bound.exact
    assert bound.hit_blocks <= _brute_force(chains, 2) <= bound.block_hits


def test_the_simulated_node_counts_tiers_per_request() -> None:
    with SimNode("lru", 2, disk_capacity_blocks=2) as node:
        assert (node.request((1, 2)).memory, node.request((1, 2)).memory) == (0, 2)
        node.request((3, 4))  # 1 and 2 go to disk
        hits = node.request((1, 2))
        assert (hits.memory, hits.disk) == (0, 2)
        # the promotion of 1 and 2 demotes 3 and 4 into the full disk tier, which holds 1 and 2 while they move:
        # the store's mover finds no room there and drops 3 and 4, and 1 and 2 end in memory
        assert node.tier_of(1) == node.tier_of(2) == 0 and node.tier_of(3) is None and node.tier_of(4) is None


_COUNTS = """
import json, sys
from kvstore.tools.sim import simulate
from kvstore.tools.trace import read_trace
requests = read_trace(sys.argv[1])[:1500]
print(json.dumps([simulate(requests, p, c).hit_blocks for p in ("lru", "slru", "adaptive", "belady")
                  for c in (50, 300)]))
"""


def test_counts_are_the_same_in_every_process() -> None:
    """The policies break every tie by order, never by memory address or a salted hash (PYTHONHASHSEED)."""
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _COUNTS, str(TRACES / "mooncake_synthetic_trace.jsonl")],
                             capture_output=True, text=True, check=True, env=env, cwd=REPO).stdout
        outputs.add(tuple(json.loads(out)))
    assert len(outputs) == 1


def test_rejects_bad_arguments(synthetic: list[TraceRequest]) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        simulate(synthetic, "fifo", 10)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        simulate(synthetic, "lru", -1)
    with pytest.raises(InvalidArgumentError, match="block_tokens"):
        simulate(synthetic, "lru", 10, block_tokens=0)
