"""Index overhead: bytes of RAM per cached block for the store's metadata, measured with 1M blocks.

It counts what the store keeps per block in RAM beside the KV bytes: the key
object, the eviction policy's entry (the store's index) and the memory tier's
record of the block's pages. The page pool itself is allocated before the
measurement starts and is not counted.

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
from kvstore.policy import PriorityLRUPolicy
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.memory import MemoryTier

RESULTS = Path(__file__).parent / "results"
GOAL_BYTES = 300


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
    result = {
        "num_blocks": num_blocks, "key_bytes_per_block": per_key, "policy_bytes_per_block": per_policy,
        "memory_tier_bytes_per_block": per_tier, "total_bytes_per_block": total, "goal_bytes": GOAL_BYTES,
    }
    text = "\n".join([
        "# Index overhead per cached block", "",
        f"Command: `python benchmarks/bench_index.py {num_blocks}` (tracemalloc; the page pool is not counted).", "",
        "| part | bytes per block |", "|---|---|",
        f"| key object (8-byte namespace tag + 16-byte hash) | {per_key:.0f} |",
        f"| eviction policy entry (the store's index) | {per_policy:.0f} |",
        f"| memory tier page record | {per_tier:.0f} |",
        f"| **total** | **{total:.0f}** (goal <= {GOAL_BYTES}: {'met' if total <= GOAL_BYTES else 'MISSED'}) |",
    ]) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_index.md").write_text(text)
    (RESULTS / "bench_index.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
