"""Sweep the eviction simulator over both Mooncake traces and check the policy goals as ratios.

Run from the repository root::

    python benchmarks/bench_sim.py

Writes ``benchmarks/results/sim_mooncake.{md,json,png}``. Goals, each a ratio
measured in this run:

* ``priority`` / ``lru`` >= 1.0 at every capacity on both traces;
* ``priority`` / ``belady`` (how close the online rule gets to the offline optimum);
* RAM 5,859 + disk 50,000 blocks (LRU) / infinite >= 0.95 on the conversation trace.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.sim import SimResult, simulate  # noqa: E402
from kvstore.sim.cli import format_table, plot  # noqa: E402
from kvstore.trace import read_trace  # noqa: E402

TRACES = ("mooncake_conversation_trace", "mooncake_synthetic_trace")
CAPACITIES_BLOCKS = (1000, 2000, 5859, 10000, 20000, 50000)
POLICIES = ("lru", "priority", "belady")
RAM_BLOCKS, DISK_BLOCKS = 5859, 50000
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = "python benchmarks/bench_sim.py"


def main() -> int:
    started = time.perf_counter()
    rows: list[tuple[str, SimResult]] = []
    tier_rows: list[tuple[str, SimResult]] = []
    for name in TRACES:
        requests = read_trace(ROOT / "benchmarks" / "traces" / f"{name}.jsonl")
        for capacity in CAPACITIES_BLOCKS:
            for policy in POLICIES:
                rows.append((name, simulate(requests, policy, capacity)))
        infinite = simulate(requests, "lru", None)
        rows.append((name, SimResult(**{**{f: getattr(infinite, f) for f in infinite.__slots__}, "policy": "infinite"})))
        for policy in ("lru", "priority"):
            tier_rows.append((name, simulate(requests, policy, RAM_BLOCKS, disk_capacity_blocks=DISK_BLOCKS)))

    def hit(name: str, policy: str, capacity: int | None) -> float:
        return next(r.hit_ratio for t, r in rows if t == name and r.policy == policy and r.capacity_blocks == capacity)

    goals: list[tuple[str, float, str]] = []
    for name in TRACES:
        vs_lru = [hit(name, "priority", c) / hit(name, "lru", c) for c in CAPACITIES_BLOCKS]
        vs_belady = [hit(name, "priority", c) / hit(name, "belady", c) for c in CAPACITIES_BLOCKS]
        goals.append((f"{name}: min over capacities of priority / lru", min(vs_lru), ">= 1.0"))
        goals.append((f"{name}: priority / lru at {RAM_BLOCKS}", vs_lru[CAPACITIES_BLOCKS.index(RAM_BLOCKS)], "-"))
        goals.append((f"{name}: priority / belady at {RAM_BLOCKS}",
                      vs_belady[CAPACITIES_BLOCKS.index(RAM_BLOCKS)], "-"))
        goals.append((f"{name}: min over capacities of priority / belady", min(vs_belady), "-"))
        for _, r in (x for x in tier_rows if x[0] == name):
            goals.append((f"{name}: {r.policy} RAM {RAM_BLOCKS} + disk {DISK_BLOCKS} / infinite",
                          r.hit_ratio / hit(name, "infinite", None),
                          ">= 0.95" if name == TRACES[0] and r.policy == "lru" else "-"))

    table = format_table(rows + tier_rows)
    goal_lines = [f"| {what} | {value:.3f} | {target} |" for what, value, target in goals]
    print(table)
    print()
    for what, value, target in goals:
        print(f"{what}: {value:.3f} (goal {target})")

    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(rows, RESULTS / "sim_mooncake.png")
    (RESULTS / "sim_mooncake.json").write_text(json.dumps({
        "command": COMMAND,
        "results": [{"trace": t, **r.to_dict()} for t, r in rows + tier_rows],
        "goals": [{"what": w, "ratio": v, "goal": g} for w, v, g in goals],
    }, indent=2) + "\n")
    (RESULTS / "sim_mooncake.md").write_text(
        f"# Eviction simulator on the Mooncake traces\n\nCommand: `{COMMAND}` "
        f"({time.perf_counter() - started:.0f} s).\n\nHit ratio = prefix-hit blocks / requested blocks; "
        "`tier_hits` splits it by tier (RAM/disk); `vs_lru` is the ratio to LRU at the same capacity.\n\n"
        f"```\n{table}\n```\n\n| goal | ratio | target |\n|---|---|---|\n" + "\n".join(goal_lines)
        + "\n\n![hit ratio vs capacity](sim_mooncake.png)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
