"""Sweep the simulator: LRU, the default policy and the bound on every trace at 1 %-50 % of distinct blocks.

Run from the repository root::

    python benchmarks/bench_sim.py                        # the bundled and generated traces
    python benchmarks/bench_sim.py --sessions DIR         # also kv-cache-tester session files (not bundled)
    python benchmarks/bench_sim.py --disk-only            # rerun only the memory plus disk rows

``--disk-only`` keeps the memory-only rows of the recorded ``sim_results.json``
and replays only the memory plus disk rows, for a change to the tier model
(demotion, promotion) that cannot move a memory-only figure. A trace it
cannot rebuild (the session merges without ``--sessions``) keeps its recorded
disk rows, and the page says so.

Traces: the two bundled Mooncake traces, three synthetic agentic workloads
(``kvstore.tools.sim.agentic``, seeded), and with ``--sessions`` real agentic
sessions merged two ways (all at once, and staggered), a seeded sample of them.

Writes ``benchmarks/results/sim_results.{md,json}`` (and ``sim_results.png``).
The goals, each a ratio measured in this run:

* the floor: ``default / lru >= 0.995`` at every capacity from 1 % to 50 % on every trace;
* the moonshot: ``(default - lru) / (bound - lru) >= 0.25`` at 1-10 % on the two Mooncake traces;
* memory plus disk rows, and the slru and adaptive policies beside the default, for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.sim import SimResult, simulate  # noqa: E402
from kvstore.tools.sim.agentic import AgenticConfig, generate_agentic  # noqa: E402
from kvstore.tools.sim.cli import format_table, plot  # noqa: E402
from kvstore.tools.trace import TraceRequest, merge_sessions, read_trace  # noqa: E402

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.25, 0.50)
POLICIES = ("lru", "slru", "default", "belady")
MOONSHOT_FRACTIONS = (0.01, 0.02, 0.05, 0.10)
FLOOR = 0.995
MOONSHOT = 0.25
AGENTIC = {  # name: config; each a different shape (see kvstore.tools.sim.agentic)
    "agentic_steady": AgenticConfig(num_sessions=40, duration_s=1800.0, turns=(5, 80), seed=1),
    "agentic_bursty": AgenticConfig(num_sessions=30, duration_s=300.0, turns=(5, 60), subagent_prob=0.1,
                                    max_subagents=4, seed=2),
    "agentic_one_agent": AgenticConfig(num_sessions=40, duration_s=1800.0, num_agent_types=1, turns=(3, 60),
                                       away_prob=0.2, seed=3),
}
RESULTS = ROOT / "benchmarks" / "results"


def _traces(sessions: Path | None, num_sessions: int) -> dict[str, tuple[list[TraceRequest], int, bool]]:
    """name -> (requests, block tokens, Mooncake?)."""
    out: dict[str, tuple[list[TraceRequest], int, bool]] = {}
    for name in ("mooncake_conversation_trace", "mooncake_synthetic_trace"):
        out[name] = (read_trace(ROOT / "benchmarks" / "traces" / f"{name}.jsonl"), 512, True)
    for name, config in AGENTIC.items():
        out[name] = (generate_agentic(config), config.block_tokens, False)
    if sessions is not None:
        files = sorted(sessions.glob("*.json"))
        picked = random.Random(0).sample(files, min(num_sessions, len(files)))
        out["sessions_concurrent"] = (merge_sessions(picked), 64, False)
        other = random.Random(1).sample(files, min(num_sessions, len(files)))
        out["sessions_staggered"] = (merge_sessions(other, stagger_s=60.0), 64, False)
    return out


def _disk_rows(name: str, requests: list[TraceRequest], block_tokens: int, unique: int,
               out: list[tuple[str, SimResult]]) -> None:
    """Append the memory plus disk rows of one trace: 1 % and 5 % of ``unique`` blocks in memory, 4x that on disk."""
    for fraction in (0.01, 0.05):
        capacity = max(1, int(unique * fraction))
        for policy in ("lru", "default", "belady"):
            out.append((name, simulate(requests, policy, capacity, disk_capacity_blocks=4 * capacity,
                                       block_tokens=block_tokens)))


def _result(entry: dict) -> SimResult:
    """A recorded row of ``sim_results.json`` back as a ``SimResult`` (the derived ratios dropped)."""
    fields = {name: entry[name] for name in SimResult.__dataclass_fields__}
    return SimResult(**{**fields, "hit_blocks_per_tier": tuple(fields["hit_blocks_per_tier"])})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=Path, default=None, help="a directory of kv-cache-tester session files")
    parser.add_argument("--num-sessions", type=int, default=30, help="sessions sampled per merged workload")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--disk-only", action="store_true",
                        help="keep the recorded memory-only rows; replay only the memory plus disk rows")
    args = parser.parse_args()
    started = time.perf_counter()
    load = os.getloadavg()
    rows: list[tuple[str, SimResult]] = []
    disk_rows: list[tuple[str, SimResult]] = []
    traces = _traces(args.sessions, args.num_sessions)
    meta = {}
    recorded = json.loads((args.out / "sim_results.json").read_text()) if args.disk_only else None
    kept_disk: list[str] = []
    if recorded is not None:
        meta = recorded["traces"]
        for entry in recorded["results"]:
            result = _result(entry)
            if result.disk_capacity_blocks == 0:
                rows.append((entry["trace"], result))
            elif entry["trace"] not in traces:
                disk_rows.append((entry["trace"], result))
        kept_disk = [name for name in meta if name not in traces]
    for name, (requests, block_tokens, mooncake) in traces.items():
        if recorded is not None:
            if name not in meta:
                raise SystemExit(f"--disk-only: {name} has no recorded memory rows; run without --disk-only")
            _disk_rows(name, requests, block_tokens, meta[name]["distinct_blocks"], disk_rows)
            print(format_table([r for r in disk_rows if r[0] == name]), flush=True)
            continue
        unique = len({key for r in requests for key in r.block_ids})
        meta[name] = {"requests": len(requests), "blocks": sum(len(r.block_ids) for r in requests),
                      "distinct_blocks": unique, "block_tokens": block_tokens, "mooncake": mooncake}
        print(f"{name}: {meta[name]}", flush=True)
        for fraction in FRACTIONS:
            capacity = max(1, int(unique * fraction))
            for policy in POLICIES:
                rows.append((name, simulate(requests, policy, capacity, block_tokens=block_tokens)))
        rows.append((name, simulate(requests, "lru", None, block_tokens=block_tokens)))
        _disk_rows(name, requests, block_tokens, unique, disk_rows)
        print(format_table([r for r in rows if r[0] == name]), flush=True)

    def hit(name: str, policy: str, capacity: int | None, disk: int = 0) -> float:
        table = disk_rows if disk else rows
        return next(r.hit_ratio for t, r in table if t == name and r.policy == policy
                    and r.capacity_blocks == capacity and r.disk_capacity_blocks == disk)

    summary = []
    for name, info in meta.items():
        for fraction in FRACTIONS:
            capacity = max(1, int(info["distinct_blocks"] * fraction))
            lru, default, bound = (hit(name, p, capacity) for p in ("lru", "adaptive", "belady"))
            closed = (default - lru) / (bound - lru) if bound > lru else 0.0
            summary.append({
                "trace": name, "fraction": fraction, "capacity_blocks": capacity, "lru": lru, "default": default,
                "slru": hit(name, "slru", capacity), "bound": bound, "infinite": hit(name, "infinite", None),
                "default_vs_lru": default / lru if lru else 1.0, "gap_closed": closed,
                "floor_met": default >= FLOOR * lru,
                "moonshot_met": (closed >= MOONSHOT) if info["mooncake"] and fraction in MOONSHOT_FRACTIONS else None,
            })
    floor_ok = all(s["floor_met"] for s in summary)
    moon = [s for s in summary if s["moonshot_met"] is not None]
    elapsed = time.perf_counter() - started
    command = "python benchmarks/bench_sim.py" + (" --sessions DIR" if args.sessions else "")
    provenance = f"Command: `{command}` ({elapsed:.0f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} " \
                 "on 2 cores"
    if recorded is not None:
        first = recorded.get("memory_rows", recorded)
        old = first["load_average"]
        provenance = (f"Memory-only rows: `{first['command']}` ({first['elapsed_s']:.0f} s; load average "
                      f"{old[0]:.1f} {old[1]:.1f} {old[2]:.1f}). Memory plus disk rows rerun after the tier model "
                      f"changed (promoted blocks held on disk while they move): `{command} --disk-only` "
                      f"({elapsed:.0f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on 2 cores")
    stale = (f" The memory plus disk rows of {', '.join(kept_disk)} (marked *) are the earlier tier model's, not "
             f"rerun: their session files were not at hand.") if kept_disk else ""
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / "sim_results.png")
    (args.out / "sim_results.json").write_text(json.dumps({
        "command": command + (" --disk-only" if recorded is not None else ""), "elapsed_s": elapsed,
        "load_average": load, "traces": meta, "summary": summary,
        **({"memory_rows": {k: recorded.get("memory_rows", recorded)[k] for k in ("command", "elapsed_s",
                                                                                  "load_average")},
            "disk_rows_not_rerun": kept_disk} if recorded is not None else {}),
        "floor_met_everywhere": floor_ok, "moonshot_met": sum(bool(s["moonshot_met"]) for s in moon),
        "moonshot_points": len(moon),
        "results": [{"trace": t, **r.to_dict()} for t, r in rows + disk_rows],
    }, indent=2) + "\n")
    lines = ["| trace | capacity | blocks | LRU | default | bound | infinite | default / LRU | gap closed | floor "
             "| moonshot |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in summary:
        moonshot = {None: "-", True: "met", False: "not met"}[s["moonshot_met"]]
        lines.append(f"| {s['trace']} | {s['fraction']:.0%} | {s['capacity_blocks']:,} | {s['lru']:.4f} | "
                     f"{s['default']:.4f} | {s['bound']:.4f} | {s['infinite']:.4f} | {s['default_vs_lru']:.3f} | "
                     f"{s['gap_closed']:+.3f} | {'met' if s['floor_met'] else 'NOT met'} | {moonshot} |")
    disk_lines = ["| trace | memory | disk | LRU | default | bound |", "|---|---:|---:|---:|---:|---:|"]
    for name in meta:
        for t, r in disk_rows:
            if t == name and r.policy == "lru":
                c, d = r.capacity_blocks, r.disk_capacity_blocks
                mark = " *" if name in kept_disk else ""
                default = hit(name, "adaptive", c, d)
                disk_lines.append(f"| {name}{mark} | {c:,} | {d:,} | {r.hit_ratio:.4f} | {default:.4f} "
                                  f"| {hit(name, 'belady', c, d):.4f} |")
    text = (
        f"# Simulator results: LRU, the default policy and the bound\n\n"
        f"{provenance}, so the times are not speed figures: see `sim_speed.md`).{stale}\n\n"
        f"Capacities are fractions of each trace's distinct blocks (memory only). `default` is "
        f"`kvstore simulate --policy default` (the adaptive policy); the bound is Belady's MIN with bypass, "
        f"exact for these traces (they have the chain property, `kvstore.tools.sim.belady`). `gap closed` is "
        f"(default - LRU) / (bound - LRU). The floor: default >= {FLOOR} x LRU; the moonshot: gap closed >= "
        f"{MOONSHOT} at 1-10 % on the Mooncake traces.\n\n"
        f"**Floor met at every point: {'yes' if floor_ok else 'no'}. Moonshot met at "
        f"{sum(bool(s['moonshot_met']) for s in moon)} of {len(moon)} points.**\n\n"
        + "\n".join(lines)
        + "\n\nMemory plus a disk tier four times as large (the bound counts the two as one cache):\n\n"
        + "\n".join(disk_lines)
        + "\n\nTraces:\n\n| trace | requests | block accesses | distinct blocks | block tokens |\n"
        + "|---|---:|---:|---:|---:|\n"
        + "\n".join(f"| {n} | {m['requests']:,} | {m['blocks']:,} | {m['distinct_blocks']:,} | {m['block_tokens']} |"
                    for n, m in meta.items())
        + "\n\nEvery row, slru included:\n\n```\n" + format_table(rows + disk_rows) + "\n```\n\n"
        + "![hit ratio vs capacity](sim_results.png)\n"
    )
    (args.out / "sim_results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
