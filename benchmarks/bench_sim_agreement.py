"""``kvstore loadtest`` against one real node agrees with ``kvstore simulate``: both Mooncake traces, memory and
memory plus disk, at 1 %, 5 % and 25 % of distinct blocks.

Run from the repository root::

    python benchmarks/bench_sim_agreement.py                    # the whole of both traces (long)
    python benchmarks/bench_sim_agreement.py --requests 3000    # the first 3,000 requests of each
    python benchmarks/bench_sim_agreement.py --requests 4000 --disk-only   # rerun only the disk rows

For each trace and capacity it starts ``kvstore serve`` with the default policy,
a memory tier of exactly ``capacity`` blocks (capacity x the memory tier's
footprint of one 1 KiB-payload block) and, for the disk rows, an LMDB tier of
4 x capacity blocks (its ``--disk-capacity`` the file bound that leaves that many
LMDB footprints to blocks, ``default_map_size_bytes``; docs/disk.md), replays the trace with one
closed-loop worker, and simulates the same requests with ``--sim-capacity`` and
``--sim-disk-capacity``. Goal: ``|loadtest - simulate| <= 0.001`` (absolute hit
ratio) at every point. ``--disk-only`` keeps the recorded memory-only rows (for a
change to demotion or promotion, which cannot move them). Writes ``benchmarks/results/sim_agreement.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.loadtest import LoadTestConfig, compare_with_simulator, replay_loadtest  # noqa: E402
from kvstore.tools.loadtest.blocks import PayloadFactory, loadtest_namespace  # noqa: E402
from kvstore.shm.node.pool import footprint  # noqa: E402
from kvstore.tiers.lmdb import RECORD_OVERHEAD_BYTES, default_map_size_bytes  # noqa: E402
from kvstore.tools.trace import read_trace  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

TRACES = ("mooncake_conversation_trace", "mooncake_synthetic_trace")
FRACTIONS = (0.01, 0.05, 0.25)
DISK_FACTOR = 4
PAYLOAD_BYTES = 1024
MAX_DIFF = 0.001
RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N requests of each trace")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--disk-only", action="store_true",
                        help="keep the recorded memory-only rows; rerun only the memory plus disk rows")
    args = parser.parse_args()
    recorded = json.loads((args.out / "sim_agreement.json").read_text()) if args.disk_only else None
    if recorded is not None and recorded["rows"][0]["requests"] != (args.requests or recorded["rows"][0]["requests"]):
        raise SystemExit("--disk-only: --requests differs from the recorded rows'")
    encoded = PayloadFactory(loadtest_namespace(), PAYLOAD_BYTES).encoded_bytes
    memory_footprint = footprint(encoded)  # the node's memory tier: its shared pool
    disk_footprint = -(-(encoded + 16) // 4096) * 4096 + RECORD_OVERHEAD_BYTES  # LMDBTier.footprint
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for name in TRACES:
        requests = read_trace(ROOT / "benchmarks" / "traces" / f"{name}.jsonl")[: args.requests]
        unique = len({key for r in requests for key in r.block_ids})
        for fraction in FRACTIONS:
            capacity = int(unique * fraction)
            for disk in (0, DISK_FACTOR * capacity):
                if recorded is not None and disk == 0:
                    rows.append(next(r for r in recorded["rows"] if r["trace"] == name and r["fraction"] == fraction
                                     and r["disk_blocks"] == 0))
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    extra = {"disk_path": Path(tmp) / "lmdb",
                             "disk_capacity": str(default_map_size_bytes(disk * disk_footprint))} if disk else {}
                    with KVNode(memory_capacity=str(capacity * memory_footprint), metrics=False,
                                **extra) as node:  # type: ignore[arg-type]
                        began = time.perf_counter()
                        result = replay_loadtest(requests, LoadTestConfig(targets=(node.target,),
                                                                          payload_bytes=PAYLOAD_BYTES))
                        wall = time.perf_counter() - began
                comparison = compare_with_simulator(requests, result, capacity, policy="default",
                                                    disk_capacity_blocks=disk)
                row = {"trace": name, "fraction": fraction, "capacity_blocks": capacity, "disk_blocks": disk,
                       "requests": len(requests), **comparison, "ok": result.ok, "short_gets": result.short_gets,
                       "loadtest_s": wall, "met": abs(comparison["hit_ratio_diff"]) <= MAX_DIFF and result.ok}
                rows.append(row)
                print(json.dumps(row), flush=True)
    elapsed = time.perf_counter() - started
    command = "python benchmarks/bench_sim_agreement.py" + (f" --requests {args.requests}" if args.requests else "")
    provenance = f"Command: `{command}` ({elapsed:.0f} s; load average {load_before[0]:.1f} at the start, " \
                 "on 2 shared cores)"
    if recorded is not None:
        first = recorded.get("memory_rows", recorded)
        provenance = (f"Memory-only rows: `{first['command']}` ({first['elapsed_s']:.0f} s; load average "
                      f"{first['load_average_before'][0]:.1f} at the start). Memory plus disk rows rerun after the "
                      f"tier model changed (promoted blocks held on disk while they move): `{command} --disk-only` "
                      f"({elapsed:.0f} s; load average {load_before[0]:.1f} at the start, on 2 shared cores)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_agreement.json").write_text(json.dumps({
        "command": command + (" --disk-only" if recorded is not None else ""), "elapsed_s": elapsed,
        "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows,
        **({"memory_rows": {k: recorded.get("memory_rows", recorded)[k]
                            for k in ("command", "elapsed_s", "load_average_before")}} if recorded else {}),
    }, indent=2) + "\n")
    lines = ["| trace | capacity | memory blocks | disk blocks | simulate | loadtest | loadtest - simulate "
             "| hit blocks (sim / node) | within 0.001 |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['fraction']:.0%} | {r['capacity_blocks']:,} | {r['disk_blocks']:,} | "
                     f"{r['sim_hit_ratio']:.5f} | {r['loadtest_hit_ratio']:.5f} | {r['hit_ratio_diff']:+.5f} | "
                     f"{r['sim_hit_blocks']:,} / {r['loadtest_hit_blocks']:,} | {'yes' if r['met'] else 'NO'} |")
    text = (f"# Simulator against a real node\n\n{provenance}. One `kvstore serve` per row (default policy), "
            f"one closed-loop worker, 1 KiB payloads; the disk rows add an LMDB tier of {DISK_FACTOR} x the memory "
            f"blocks, and the simulation the same (`--sim-disk-capacity`).\n\n"
            f"**Within 0.001 at every point: {'yes' if all(r['met'] for r in rows) else 'no'}.**\n\n"
            + "\n".join(lines) + "\n")
    (args.out / "sim_agreement.md").write_text(text)
    print(text)
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
