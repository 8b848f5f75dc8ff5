"""Simulator speed: block accesses replayed per second for every policy, and linearity in the trace's length.

Run from the repository root::

    python benchmarks/bench_sim_speed.py

The conversation trace is replayed 1x, 2x and 4x over (each copy with its own
block ids, so every copy does the same work) at 5 % of the distinct blocks of
one copy. The goal: at least 1M block accesses per second for every online
policy, and a time per access that does not grow with the length (the ratio of
the 4x rate to the 1x rate stays near 1). Figures are CPU time of this process
(``time.process_time``), which a loaded machine inflates less than wall time;
both are recorded, with the load average, in ``benchmarks/results/sim_speed.{md,json}``.
A calibration loop (``sum(range(10**7))``) is timed too, to compare machines.

``--agentic`` measures instead the goal of ``docs/agentic.md``: the ``session``
policy beside LRU and the default, at 5 %, on the bundled traces (the Mooncake
conversation trace and the bundled generator's steady agentic workload, with its
sessions), into ``benchmarks/results/sim_speed_agentic.{md,json}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.tools.sim import simulate  # noqa: E402
from kvstore.tools.sim.agentic import AgenticConfig, generate_agentic  # noqa: E402
from kvstore.tools.trace import TraceRequest, read_trace  # noqa: E402

POLICIES = ("lru", "slru", "adaptive", "belady")
COPIES = (1, 2, 4)
GOAL_PER_S = 1_000_000
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = "python benchmarks/bench_sim_speed.py"


def _copies(requests: list[TraceRequest], count: int) -> list[TraceRequest]:
    top = 1 + max(key for r in requests for key in r.block_ids)
    out = []
    for copy in range(count):
        offset = copy * top
        out += [TraceRequest(r.timestamp_s, r.input_tokens, r.output_tokens,
                             tuple(key + offset for key in r.block_ids)) for r in requests]
    return out


AGENTIC_GOAL_PER_S = 500_000


def agentic() -> int:
    """The session policy's speed on the bundled traces (``--agentic``)."""
    traces = {"mooncake_conversation_trace": read_trace(ROOT / "benchmarks" / "traces"
                                                        / "mooncake_conversation_trace.jsonl"),
              "agentic_steady": generate_agentic(AgenticConfig(num_sessions=40, duration_s=1800.0, turns=(5, 80),
                                                               seed=1))}
    load_before = os.getloadavg()
    calibration = time.process_time()
    sum(range(10**7))
    calibration = time.process_time() - calibration
    rows = []
    for name, trace in traces.items():
        capacity = len({key for r in trace for key in r.block_ids}) // 20
        accesses = sum(len(r.block_ids) for r in trace)
        for policy in ("lru", "default", "session"):
            cpu = time.process_time()
            result = simulate(trace, policy, capacity)
            cpu = time.process_time() - cpu
            rows.append({"trace": name, "policy": policy, "block_accesses": accesses, "cpu_s": cpu,
                         "cpu_accesses_per_s": accesses / cpu, "hit_ratio": result.hit_ratio})
            print(f"{name} {policy}: {accesses / cpu / 1e6:.2f} M accesses/s (CPU)", flush=True)
    load_after = os.getloadavg()
    lines = ["| trace | policy | M accesses/s (CPU) | goal >= 0.5 M/s |", "|---|---|---:|---|"]
    lines += [f"| {r['trace']} | {r['policy']} | {r['cpu_accesses_per_s'] / 1e6:.2f} | "
              + ("met" if r["cpu_accesses_per_s"] >= AGENTIC_GOAL_PER_S else "NOT met") + " |" for r in rows]
    command = COMMAND + " --agentic"
    (RESULTS / "sim_speed_agentic.json").write_text(json.dumps({
        "command": command, "load_average_before": load_before, "load_average_after": load_after,
        "calibration_sum_1e7_cpu_s": calibration, "rows": rows}, indent=2) + "\n")
    text = (f"# Simulator speed with the session policy\n\nCommand: `{command}`. Each trace at 5 % of its distinct "
            f"blocks, CPU time of the process (a replay, with its history of removals and its miss causes). Load "
            f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on 2 cores shared with other work; "
            f"calibration `sum(range(10**7))` took {calibration:.3f} s of CPU.\n\n" + "\n".join(lines) + "\n")
    (RESULTS / "sim_speed_agentic.md").write_text(text)
    print(text)
    return 0


def main() -> int:
    if "--agentic" in sys.argv[1:]:
        return agentic()
    requests = read_trace(ROOT / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl")
    capacity = len({key for r in requests for key in r.block_ids}) // 20
    load_before = os.getloadavg()
    calibration = time.process_time()
    sum(range(10**7))
    calibration = time.process_time() - calibration
    rows = []
    for copies in COPIES:
        trace = _copies(requests, copies)
        accesses = sum(len(r.block_ids) for r in trace)
        for policy in POLICIES:
            cpu = time.process_time()
            wall = time.perf_counter()
            result = simulate(trace, policy, capacity)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            rows.append({"policy": policy, "copies": copies, "block_accesses": accesses,
                         "cpu_s": cpu, "wall_s": wall, "replay_s": result.elapsed_s,
                         "cpu_accesses_per_s": accesses / cpu, "wall_accesses_per_s": accesses / wall,
                         "hit_ratio": result.hit_ratio})
            print(f"{policy:9s} x{copies}: {accesses / cpu / 1e6:.2f} M accesses/s (CPU), "
                  f"{accesses / wall / 1e6:.2f} M/s (wall)", flush=True)
    load_after = os.getloadavg()
    lines = ["| policy | M accesses/s (CPU), 1x | 2x | 4x | 4x / 1x | goal >= 1 M/s |", "|---|---:|---:|---:|---:|---|"]
    summary = {}
    for policy in POLICIES:
        rates = [next(r["cpu_accesses_per_s"] for r in rows if r["policy"] == policy and r["copies"] == c)
                 for c in COPIES]
        met = min(rates) >= GOAL_PER_S
        summary[policy] = {"rates": rates, "linearity": rates[-1] / rates[0], "goal_met": met}
        online = policy != "belady"
        lines.append(f"| {policy} | " + " | ".join(f"{r / 1e6:.2f}" for r in rates)
                     + f" | {rates[-1] / rates[0]:.2f} | {('met' if met else 'NOT met') if online else '(offline)'} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_speed.json").write_text(json.dumps({
        "command": COMMAND, "capacity_blocks": capacity, "load_average_before": load_before,
        "load_average_after": load_after, "calibration_sum_1e7_cpu_s": calibration, "rows": rows,
        "summary": summary}, indent=2) + "\n")
    text = (f"# Simulator speed\n\nCommand: `{COMMAND}`. Conversation trace replayed 1x, 2x and 4x over at "
            f"{capacity:,} blocks (5 %), CPU time of the process. Load average {load_before[0]:.1f} before, "
            f"{load_after[0]:.1f} after, on 2 cores shared with other work; calibration `sum(range(10**7))` took "
            f"{calibration:.3f} s of CPU.\n\n"
            + "\n".join(lines) + "\n")
    (RESULTS / "sim_speed.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
