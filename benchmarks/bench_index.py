"""Index overhead: bytes of RAM per cached block for the store's metadata, measured with 1M blocks.

It counts what the store keeps per block in RAM beside the KV bytes: the key
object, the eviction policy's entry (the store's index) and the memory tier's
record of the block's pages. The page pool itself is allocated before the
measurement starts and is not counted.

A second row has the agentic features on (``docs/agentic.md``): the ``session``
policy, a TTL on a tenth of the blocks, the session tracker holding the last
chain of a session per thousand blocks (every block in one), and the history of
removals full at ``store.miss_history_blocks`` (its default, 65,536 removed
blocks, whose keys it keeps alive), all divided by the blocks cached. Its policy
is the one the first row measures, a tier's LRU order (the memory tier above a
disk tier: the session policy adapts only a last tier, as the default does); a
last tier's adaptive shadow (keys and sizes again) is measured apart.

Run: python benchmarks/bench_index.py [num_blocks]
Writes benchmarks/results/bench_index.{md,json}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tracemalloc
from pathlib import Path

from kvstore.keys import Namespace, block_key, hash_blocks
from kvstore.config import DEFAULT_HISTORY_BLOCKS
from kvstore.store.misses import EVICTED, MissHistory
from kvstore.policy import PriorityLRUPolicy, make_policy
from kvstore.policy.sessions import SessionTracker
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.memory import MemoryTier

RESULTS = Path(__file__).parent / "results"
GOAL_BYTES = 300
PINNED_SHARE = 0.1  # blocks with a TTL in the agentic measurement


def main() -> int:
    num_blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    ns = Namespace(model="bench", block_size=1)
    hashes = hash_blocks(ns, range(num_blocks))  # 16-byte xxh3-128 hashes
    page = 64
    tier = MemoryTier(num_blocks * page, page_bytes=page)
    value = bytes(page)
    meta = BlockMeta()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keys = [block_key(ns, h) for h in hashes]
    after_keys = tracemalloc.get_traced_memory()[0]
    policy = PriorityLRUPolicy()
    for key in reversed(keys):
        policy.insert(key, page)
    after_policy = tracemalloc.get_traced_memory()[0]

    async def fill() -> None:
        for start in range(0, num_blocks, 4096):
            batch = keys[start:start + 4096]
            await tier.put(batch, [value] * len(batch), [meta] * len(batch))

    asyncio.run(fill())
    del hashes
    after_tier = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_key = (after_keys - base) / num_blocks
    per_policy = (after_policy - after_keys) / num_blocks
    per_tier = (after_tier - after_policy) / num_blocks
    total = per_key + per_policy + per_tier
    del policy
    agentic = agentic_bytes(ns, keys, page)
    agentic_total = per_key + agentic["policy"] + agentic["sessions"] + agentic["history"] + per_tier
    unpinned_total = agentic_total - agentic["policy"] + agentic["unpinned_policy"]
    max_share = max(0.0, (GOAL_BYTES - unpinned_total) / agentic["per_pinned"])
    half_total = unpinned_total + 0.5 * agentic["per_pinned"]
    result = {
        "num_blocks": num_blocks, "key_bytes_per_block": per_key, "policy_bytes_per_block": per_policy,
        "memory_tier_bytes_per_block": per_tier, "total_bytes_per_block": total, "goal_bytes": GOAL_BYTES,
        "agentic": {"session_policy_bytes_per_block": agentic["policy"],
                    "session_tracker_bytes_per_block": agentic["sessions"],
                    "miss_history_bytes_per_block": agentic["history"], "total_bytes_per_block": agentic_total,
                    "adaptive_policy_bytes_per_block": agentic["adaptive"],
                    "pinned_share": PINNED_SHARE, "bytes_per_pinned_block": agentic["per_pinned"],
                    "unpinned_total_bytes_per_block": unpinned_total, "max_pinned_share_within_goal": max_share,
                    "half_pinned_total_bytes_per_block": half_total},
    }
    text = "\n".join([
        "# Index overhead per cached block", "",
        f"Command: `python benchmarks/bench_index.py {num_blocks}` (tracemalloc; the page pool is not counted).", "",
        "| part | bytes per block |", "|---|---|",
        f"| key object (8-byte namespace tag + 16-byte hash) | {per_key:.0f} |",
        f"| eviction policy entry (the store's index) | {per_policy:.0f} |",
        f"| memory tier page record | {per_tier:.0f} |",
        f"| **total** | **{total:.0f}** (goal <= {GOAL_BYTES}: {'met' if total <= GOAL_BYTES else 'MISSED'}) |",
        "",
        f"With sessions, TTLs and the cause history on (the `session` policy, a TTL on {PINNED_SHARE:.0%} of the "
        "blocks, one tracked session per thousand blocks, the history of removals full at its default of "
        f"{DEFAULT_HISTORY_BLOCKS:,}):",
        "",
        "| part | bytes per block |", "|---|---|",
        f"| key object | {per_key:.0f} |",
        f"| eviction policy entry (session policy, TTLs) | {agentic['policy']:.0f} |",
        f"| session tracker (last chains) | {agentic['sessions']:.0f} |",
        f"| history of removals (miss causes) | {agentic['history']:.0f} |",
        f"| memory tier page record | {per_tier:.0f} |",
        f"| **total** | **{agentic_total:.0f}** (goal <= {GOAL_BYTES}: "
        f"{'met' if agentic_total <= GOAL_BYTES else 'MISSED'}) |",
        "",
        f"Each pinned block costs {agentic['per_pinned']:.0f} bytes more than an unpinned one (its priority "
        f"entry, its TTL and end, its item in the expiry heap): without pins the total is {unpinned_total:.0f}, "
        f"and it stays within {GOAL_BYTES} while at most {max_share:.0%} of the blocks are pinned; at "
        f"`store.pins.max_tier_fraction`'s default of half a tier pinned it is {half_total:.0f}.",
        "",
        f"A last tier that adapts (the default's and the session policy's, on a memory-only node) keeps a shadow "
        f"of the other order: its policy entry is {agentic['adaptive']:.0f} bytes per block, not "
        f"{per_policy:.0f}, with or without sessions.",
    ]) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_index.md").write_text(text)
    (RESULTS / "bench_index.json").write_text(json.dumps(result, indent=2))
    return 0


def agentic_bytes(ns: Namespace, keys: list[bytes], page: int) -> dict[str, float]:
    """Bytes per block of the session policy with TTLs on a tenth of the blocks, of the session tracker, and of
    a full history of removals (its keys are other blocks', kept alive by it), each measured alone."""
    num_blocks = len(keys)
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    policy = make_policy("session", capacity_bytes=num_blocks * page, clock=lambda: 0.0, demotes=True)
    for i, key in enumerate(reversed(keys)):
        policy.insert(key, page, ttl_s=300.0 if i % round(1 / PINNED_SHARE) == 0 else 0.0)
    after_policy = tracemalloc.get_traced_memory()[0]
    tracker: SessionTracker[bytes] = SessionTracker(num_blocks * page, lambda chain: None)
    chain = 1000
    for n in range(0, num_blocks, chain):
        tracker.request(f"session-{n}", keys[n:n + chain], n)
    after_tracker = tracemalloc.get_traced_memory()[0]
    removed = [block_key(ns, h) for h in hash_blocks(ns, range(num_blocks, num_blocks + DEFAULT_HISTORY_BLOCKS))]
    history: MissHistory[bytes] = MissHistory(DEFAULT_HISTORY_BLOCKS)
    for start_at in range(0, len(removed), 4096):
        history.record_many(removed[start_at:start_at + 4096], EVICTED, 1.7e9, 0, [35] * 4096)
    del removed  # the history keeps its keys alive: counted
    after_history = tracemalloc.get_traced_memory()[0]
    del policy, tracker, history
    adaptive_start = tracemalloc.get_traced_memory()[0]
    adaptive = make_policy("session", capacity_bytes=num_blocks * page)
    for start_at in range(0, num_blocks, 4096):
        adaptive.insert_many(keys[start_at:start_at + 4096], page)
    after_adaptive = tracemalloc.get_traced_memory()[0]
    del adaptive
    unpinned_start = tracemalloc.get_traced_memory()[0]
    unpinned = make_policy("session", capacity_bytes=num_blocks * page, clock=lambda: 0.0, demotes=True)
    for key in reversed(keys):
        unpinned.insert(key, page)
    after_unpinned = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    policy_bytes = (after_policy - start) / num_blocks
    unpinned_bytes = (after_unpinned - unpinned_start) / num_blocks
    return {"policy": policy_bytes, "sessions": (after_tracker - after_policy) / num_blocks,
            "history": (after_history - after_tracker) / num_blocks,
            "adaptive": (after_adaptive - adaptive_start) / num_blocks,
            "unpinned_policy": unpinned_bytes, "per_pinned": (policy_bytes - unpinned_bytes) / PINNED_SHARE}


if __name__ == "__main__":
    sys.exit(main())
