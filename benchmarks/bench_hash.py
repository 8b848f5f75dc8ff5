"""Hashing throughput of the chained block hash, in tokens per second, against a raw xxh3 pass.

Run: python benchmarks/bench_hash.py
Writes benchmarks/results/bench_hash.{md,json}.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvstore.keys import HashAlgorithm, Namespace, hash_blocks

RESULTS = Path(__file__).parent / "results"
NUM_TOKENS = 1 << 20
GOAL_TOKENS_PER_S = 5e6


def best_of(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    tokens = np.random.default_rng(0).integers(0, 128_000, NUM_TOKENS, dtype=np.int64)
    data = tokens.astype("<u4").tobytes()
    rows = []
    for algorithm in HashAlgorithm:
        for block_size in (16, 256):
            ns = Namespace(model="bench", block_size=block_size, hash_algorithm=algorithm)
            seconds = best_of(lambda: hash_blocks(ns, tokens))
            raw = best_of(lambda: algorithm.digest(data))
            rows.append({
                "algorithm": algorithm.value, "block_size": block_size,
                "tokens_per_s": NUM_TOKENS / seconds, "raw_hash_tokens_per_s": NUM_TOKENS / raw,
                "ratio_to_raw": raw / seconds,
            })
    lines = [
        "# Block hashing throughput", "",
        f"Command: `python benchmarks/bench_hash.py` ({NUM_TOKENS} tokens; median of 5).",
        "Raw = one call of the hash over all token bytes, the ceiling for the chain.", "",
        "| algorithm | block size | Mtokens/s | raw Mtokens/s | ratio to raw | goal (xxh3-128 >= 5M/s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = ("met" if r["tokens_per_s"] >= GOAL_TOKENS_PER_S else "MISSED") if r["algorithm"] == "xxh3_128" else "-"
        lines.append(f"| {r['algorithm']} | {r['block_size']} | {r['tokens_per_s'] / 1e6:.1f} | "
                     f"{r['raw_hash_tokens_per_s'] / 1e6:.0f} | {r['ratio_to_raw']:.3f} | {goal} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_hash.md").write_text(text)
    (RESULTS / "bench_hash.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
