"""``kvstore loadtest`` against one real node on loopback, checked against ``kvstore simulate``.

Run from the repository root::

    python benchmarks/bench_loadtest.py                 # about 5 minutes on 2 cores
    python benchmarks/bench_loadtest.py --requests 2000 # a quick look

Starts ``kvstore serve`` with a memory tier of exactly 5,859 blocks (5,859 x the
memory tier's footprint of one encoded block, 64,704 bytes) and no disk tier,
replays the Mooncake conversation trace with one closed-loop worker (file
order), and runs ``kvstore.tools.sim`` with the LRU policy at 5,859 blocks on the same
requests. The payload is the default 63 KiB (64,640-byte encoded blocks), and
every got block is checked byte for byte.

Goal (a ratio measured in this run): loadtest hit ratio / simulator hit ratio
with ``|loadtest - simulator| <= 0.01`` and zero byte mismatches and errors.
Writes ``benchmarks/results/loadtest_bench.{md,json}`` and the plots
``benchmarks/results/loadtest_<run>_{hit_ratio,latency_cdf}.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.loadtest import LoadTestConfig, compare_with_simulator, replay_loadtest  # noqa: E402
from kvstore.tools.loadtest.blocks import PayloadFactory, loadtest_namespace  # noqa: E402
from kvstore.tools.loadtest.plot import plot_hit_ratio, plot_latency_cdf  # noqa: E402
from kvstore.shm.node.pool import footprint  # noqa: E402
from kvstore.tools.trace import read_trace  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITY_BLOCKS = 5859
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = "python benchmarks/bench_loadtest.py"
MAX_DIFF = 0.01
RUNS = (  # (name, payload bytes, requests or None for all)
    ("conversation", 63 * 1024, None),
)


def footprint_bytes(encoded_bytes: int) -> int:
    """Capacity one encoded block takes in the memory tier of ``kvstore serve`` (its shared pool)."""
    return footprint(encoded_bytes)


def run_one(name: str, payload_bytes: int, num_requests: int | None, requests: list[Any]) -> dict[str, Any]:
    requests = requests[:num_requests] if num_requests is not None else requests
    encoded = PayloadFactory(loadtest_namespace(), payload_bytes).encoded_bytes
    footprint = footprint_bytes(encoded)
    memory_bytes = CAPACITY_BLOCKS * footprint
    with KVNode(memory_capacity=str(memory_bytes), metrics=False) as node:
        config = LoadTestConfig(targets=(node.target,), concurrency=1, payload_bytes=payload_bytes, window_s=10.0)
        result = replay_loadtest(requests, config, progress=None)
    comparison = compare_with_simulator(requests, result, CAPACITY_BLOCKS, policy="lru")
    plot_hit_ratio(result, RESULTS / f"loadtest_{name}_hit_ratio.png", sim_hit_ratio=comparison["sim_hit_ratio"])
    plot_latency_cdf(result, RESULTS / f"loadtest_{name}_latency_cdf.png")
    return {
        "run": name,
        "payload_bytes": payload_bytes,
        "encoded_block_bytes": encoded,
        "footprint_bytes": footprint,
        "memory_capacity_bytes": memory_bytes,
        "comparison": comparison,
        "passed": abs(comparison["hit_ratio_diff"]) <= MAX_DIFF and result.ok,
        "result": result.to_dict(),
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = ("run", "requests", "block_B", "sim_hit", "loadtest_hit", "diff", "ratio", "token_hit", "mismatch",
              "errors", "req/s", "GB/s", "lookup_p50/p99_ms", "get_p50/p99_ms", "put_p50/p99_ms", "time_s")
    lines = [header]
    for row in rows:
        r, c = row["result"], row["comparison"]
        lat = r["latency_ms"]
        lines.append((
            row["run"], str(r["num_requests"]), str(row["encoded_block_bytes"]), f"{c['sim_hit_ratio']:.4f}",
            f"{c['loadtest_hit_ratio']:.4f}", f"{c['hit_ratio_diff']:+.5f}", f"{c['hit_ratio_ratio']:.4f}",
            f"{r['token_hit_ratio']:.4f}", str(r["byte_mismatches"]), str(r["num_errors"]),
            f"{r['requests_per_s']:.1f}", f"{r['gb_per_s']:.3f}",
            *(f"{lat[op]['p50_ms']:.2f}/{lat[op]['p99_ms']:.2f}" for op in ("lookup", "get", "put")),
            f"{r['elapsed_s']:.0f}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="cap every run at this many requests")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    requests = read_trace(TRACE)
    rows = []
    for name, payload_bytes, num_requests in RUNS:
        if args.requests is not None:
            num_requests = min(args.requests, num_requests or args.requests)
        rows.append(run_one(name, payload_bytes, num_requests, requests))
        print(f"{name}: done", file=sys.stderr)
    text = table(rows)
    goal = (f"goal: |loadtest - simulator| <= {MAX_DIFF} with zero mismatches and errors: "
            + ", ".join(f"{r['run']} ratio {r['comparison']['hit_ratio_ratio']:.4f} "
                        f"{'PASS' if r['passed'] else 'FAIL'}" for r in rows))
    print(text)
    print(goal)
    elapsed = time.perf_counter() - started
    command = COMMAND + (f" --requests {args.requests}" if args.requests is not None else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loadtest_bench.json").write_text(json.dumps(
        {"command": command, "trace": str(TRACE.relative_to(ROOT)), "capacity_blocks": CAPACITY_BLOCKS,
         "elapsed_s": elapsed, "runs": rows}, indent=2) + "\n")
    (RESULTS / "loadtest_bench.md").write_text(
        "# kvstore loadtest vs. kvstore simulate (conversation trace, one node on loopback)\n\n"
        f"Command: `{command}` ({elapsed:.0f} s, 2 CPU cores, client and server on one host).\n\n"
        f"Node: `kvstore serve --memory-capacity {CAPACITY_BLOCKS} x footprint` (so "
        f"{CAPACITY_BLOCKS} blocks), no disk tier. Load test: one closed-loop worker (file order). "
        f"Simulator: `lru` at {CAPACITY_BLOCKS} blocks on the same requests. `ratio` = loadtest / simulator "
        "hit ratio; `diff` = loadtest - simulator.\n\n"
        f"```\n{text}\n```\n\n{goal}\n\n"
        "Plots: `loadtest_<run>_hit_ratio.png` (per 10 s window and cumulative, simulator dashed) and "
        "`loadtest_<run>_latency_cdf.png`.\n"
    )
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
