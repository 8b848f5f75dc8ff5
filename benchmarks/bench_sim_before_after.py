"""Simulator speed before and after it ran the store itself: the replay model of an earlier commit against the
current ``SimNode`` (the store over metadata-only tiers), interleaved, in CPU time.

Run from the repository root::

    python benchmarks/bench_sim_before_after.py [--before 73f9e45] [--requests 4000] [--rounds 3]

The ``kvstore`` package of ``--before`` (the last commit with ``kvstore/sim/model.py``) is unpacked with
``git archive`` into a temporary directory, and two worker processes are started, one importing it and one
importing this checkout. Each replays the first ``--requests`` requests of the conversation trace (the trace of
``bench_sim_speed.py``) at 5 % of their distinct blocks, memory only, through ``kvstore.tools.sim.simulate``; the two
take turns, policy by policy, ``--rounds`` times, so that a change in the machine's load falls on both. Figures
are the CPU time of ``simulate`` in the worker (``SimResult.cpu_s``), the median of the rounds; the hit counts of
both are recorded, with the load average, in ``benchmarks/results/sim_before_after.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl"
POLICIES = ("lru", "slru", "default")

_WORKER = r"""
import json, sys
from kvstore.tools.sim import simulate
from kvstore.tools.trace import read_trace
requests = read_trace(sys.argv[1])[:int(sys.argv[2])]
capacity = len({key for r in requests for key in r.block_ids}) // 20
print(json.dumps({"ready": True, "capacity": capacity}), flush=True)
for line in sys.stdin:
    result = simulate(requests, line.strip(), capacity)
    print(json.dumps({"cpu_s": result.cpu_s, "hit_blocks": result.hit_blocks, "num_blocks": result.num_blocks}),
          flush=True)
"""


class _Worker:
    """One process replaying the slice with the ``kvstore`` package under ``path``, on request."""

    def __init__(self, path: Path, requests: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(path))
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, str(TRACE), str(requests)], cwd=path,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self.capacity = int(json.loads(self._stdout.readline())["capacity"])

    def run(self, policy: str) -> dict[str, float]:
        """Simulate ``policy``; the worker's ``SimResult`` figures."""
        self._stdin.write(policy + "\n")
        self._stdin.flush()
        return dict(json.loads(self._stdout.readline()))

    def close(self) -> None:
        self._stdin.close()
        self.process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="73f9e45", help="the commit whose replay model to measure")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    command = (f"python benchmarks/bench_sim_before_after.py --before {args.before} --requests {args.requests} "
               f"--rounds {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.before, "kvstore"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        load_before = os.getloadavg()
        started = time.perf_counter()
        before = _Worker(Path(tmp), args.requests)
        after = _Worker(ROOT, args.requests)
        capacity = before.capacity
        samples: dict[tuple[str, str], list[dict[str, float]]] = {}
        try:
            for _ in range(args.rounds):
                for policy in POLICIES:
                    for name, worker in (("before", before), ("after", after)):
                        samples.setdefault((policy, name), []).append(worker.run(policy))
        finally:
            for worker in (before, after):
                worker.close()
        load_after = os.getloadavg()
        wall_s = time.perf_counter() - started
    rows = []
    lines = ["| policy | before: M accesses/s (CPU) | after | after / before, CPU time | hit blocks before | after |",
             "|---|---:|---:|---:|---:|---:|"]
    for policy in POLICIES:
        row: dict[str, float | str | list[float]] = {"policy": policy}
        cpu: dict[str, float] = {}
        for name in ("before", "after"):
            runs = samples[(policy, name)]
            cpu[name] = statistics.median(r["cpu_s"] for r in runs)
            row[f"{name}_cpu_s"] = cpu[name]
            row[f"{name}_accesses_per_s"] = runs[0]["num_blocks"] / cpu[name]
            row[f"{name}_hit_blocks"] = runs[0]["hit_blocks"]
            row[f"{name}_cpu_s_all"] = [r["cpu_s"] for r in runs]
        row["num_blocks"] = samples[(policy, "after")][0]["num_blocks"]
        row["slowdown"] = cpu["after"] / cpu["before"]
        rows.append(row)
        num_blocks = samples[(policy, "after")][0]["num_blocks"]
        hits = [int(samples[(policy, name)][0]["hit_blocks"]) for name in ("before", "after")]
        lines.append(f"| {policy} | {num_blocks / cpu['before'] / 1e6:.3f} | {num_blocks / cpu['after'] / 1e6:.3f} | "
                     f"{cpu['after'] / cpu['before']:.1f}x | {hits[0]:,} | {hits[1]:,} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_before_after.json").write_text(json.dumps({
        "command": command, "requests": args.requests, "capacity_blocks": capacity, "rounds": args.rounds,
        "load_average_before": load_before, "load_average_after": load_after, "wall_s": wall_s, "rows": rows},
        indent=2) + "\n")
    text = (f"# Simulator speed: the replay model (before) and the store itself (after)\n\n"
            f"Command: `{command}`. The first {args.requests:,} requests of the conversation trace "
            f"({int(samples[(POLICIES[0], 'after')][0]['num_blocks']):,} block accesses) at {capacity:,} blocks "
            f"(5 % of their distinct blocks), "
            f"memory only; the two simulators in two processes taking turns, the median CPU time of "
            f"{args.rounds} rounds each. Load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
            f"(1 min), on 2 cores shared with other work; {wall_s:.0f} s in all.\n\n" + "\n".join(lines) + "\n")
    (RESULTS / "sim_before_after.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
