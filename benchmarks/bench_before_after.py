"""Two checkouts of kvstore, side by side: bench_service, bench_shm and profile_vllm_load, interleaved run by run.

A refactor that promises no behaviour change (issue 45: the house's
boundaries) must also promise no slowdown. This script runs the three
benchmarks of the hot paths from two checkouts, ``--before`` and ``--after``,
in the order A B B A for each round (so drift in the machine's load falls on
both alike), each run a separate process with ``PYTHONPATH`` set to its
checkout, and reports per figure the median of each side, the ratio
after / before, and the noise: the largest ratio between two runs of the same
side. A ratio inside the noise is "within noise".

Usage::

    git worktree add /tmp/kvstore-before <commit>
    python benchmarks/bench_before_after.py --before /tmp/kvstore-before --after . [--rounds 2]

The benchmarks run from this repository's venvs (``.venv``; ``.venv-vllm``
for ``profile_vllm_load``, skipped if it is absent); only the kvstore code
comes from each checkout. Results: ``benchmarks/results/bench_before_after.{md,json}``.
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
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"

Figures = dict[str, float]


def _service(data: dict[str, Any]) -> Figures:
    figures = {}
    for row in data["throughput"]:
        size = row["size_bytes"] // 1024
        figures[f"service Get {size} KiB, GB/s"] = row["service_get_gbps"]
        figures[f"service Put {size} KiB, GB/s"] = row["service_put_gbps"]
    for row in data["lookup"]:
        figures[f"service Lookup {row['num_hashes']} hashes, ms"] = row["lookup_ms"]
    return figures


def _shm(data: dict[str, Any]) -> Figures:
    return {"same-host get_into 16 MiB, ms": data["batch_ms"]["shm_get_into"],
            "same-host get 2 MiB, ms": data["single_ms"]["shm_get"],
            "same-host put 16 MiB, ms": data["put_ms"]["shm_put"],
            "Lookup 1,024 over unix, ms": data["lookup_ms"]["unix_1024"]}


def _vllm(data: dict[str, Any]) -> Figures:
    return {f"{row['step']}, median ms": row["median_ms"] for row in data["rows"]
            if row["step"].startswith(("HIT PATH", "read,", "lookup,"))}


# name → (venv, script, arguments, figures of its JSON); "{out}" is the run's output prefix
BENCHMARKS: dict[str, tuple[str, str, list[str], Callable[[dict[str, Any]], Figures]]] = {
    "bench_service": (".venv", "benchmarks/bench_service.py",
                      ["--sizes", f"{256 * 1024},{2 << 20}", "--run-bytes", str(64 << 20), "--min-rounds", "10",
                       "--lookups", "200", "--out", "{out}"], _service),
    "bench_shm": (".venv", "benchmarks/bench_shm.py", ["--rounds", "30", "--lookups", "200", "--out", "{out}"], _shm),
    "profile_vllm_load": (".venv-vllm", "benchmarks/profile_vllm_load.py", ["--reps", "20", "--out", "{out}"], _vllm),
}
LOWER_IS_BETTER = ("ms",)


def run_one(name: str, checkout: Path, scratch: Path, index: int) -> Figures:
    """Run benchmark ``name`` with ``checkout``'s kvstore; returns its figures.

    Raises:
        subprocess.CalledProcessError: if the benchmark fails.
    """
    venv, script, arguments, figures = BENCHMARKS[name]
    out = scratch / f"{name}-{index}"
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [str(REPO_ROOT / venv / "bin" / "python"), str(checkout / script)]
    command += [a.replace("{out}", str(out)) for a in arguments]
    subprocess.run(command, env=env, check=True, cwd=checkout, stdout=subprocess.DEVNULL)
    return figures(json.loads(Path(f"{out}.json").read_text()))


def main() -> None:
    """Run the rounds and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the commit before")
    parser.add_argument("--after", type=Path, default=REPO_ROOT, help="checkout of the commit after")
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds per benchmark")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmarks to run")
    parser.add_argument("--out", default=str(RESULTS / "bench_before_after"))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n != "profile_vllm_load" or (REPO_ROOT / ".venv-vllm").exists()]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {side: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True,
                                    text=True).stdout.strip() for side, path in sides.items()}
    load_before = os.getloadavg()[0]
    started = time.time()
    runs: dict[str, dict[str, list[Figures]]] = {n: {"before": [], "after": []} for n in names}
    with tempfile.TemporaryDirectory() as scratch:
        index = 0
        for name in names:
            for _ in range(args.rounds):
                for side in ("before", "after", "after", "before"):
                    index += 1
                    print(f"{name}: {side} ({commits[side]})", flush=True)
                    runs[name][side].append(run_one(name, sides[side], Path(scratch), index))
    rows = []
    for name in names:
        for figure in runs[name]["before"][0]:
            values = {side: [r[figure] for r in runs[name][side] if figure in r] for side in sides}
            if not values["before"] or not values["after"]:
                continue
            medians = {side: statistics.median(v) for side, v in values.items()}
            noise = max(max(v) / min(v) for v in values.values() if min(v) > 0)
            ratio = medians["after"] / medians["before"]
            lower = figure.endswith(LOWER_IS_BETTER)
            slower = ratio if lower else 1 / ratio  # > 1: the after side is slower
            rows.append({"benchmark": name, "figure": figure, "before": medians["before"], "after": medians["after"],
                         "after_over_before": ratio, "noise": noise, "within_noise": slower <= noise,
                         "runs": values})
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commits": commits,
            "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0], "cpus": os.cpu_count(),
            "wall_s": round(time.time() - started, 1), "rounds": args.rounds}
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Before and after, interleaved (issue 45: no behaviour change)", "",
             f"Command: `{meta['command']}`. Before: `{commits['before']}`, after: `{commits['after']}`; "
             f"{args.rounds} rounds of A B B A per benchmark, each run a separate process. Load average "
             f"{load_before:.1f} before, {meta['load_avg_1m_after']:.1f} after, on {meta['cpus']} cores; "
             f"{meta['wall_s']:.0f} s in all.", "",
             "Noise: the largest ratio between two runs of the same side. *Within noise*: the after side is "
             "no slower than that.", "",
             "| benchmark | figure | before | after | after / before | noise | within noise |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['benchmark']} | {row['figure']} | {row['before']:.3g} | {row['after']:.3g} | "
                     f"{row['after_over_before']:.2f} | {row['noise']:.2f} | {'yes' if row['within_noise'] else 'NO'} |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
