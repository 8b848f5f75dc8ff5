"""Corruption fuzzers at scale: the disk tier (LMDB) and the shared tier (Redis), many seeds, counts recorded.

The CI test (``tests/security/test_corruption_fuzz.py``) runs a seed of each kind of damage; this runs
hundreds. Each LMDB trial puts 24 prefixes of 4 blocks (8 to 64 KiB each) into a disk-only store, stops it,
damages ``data.mdb`` (one mode per trial, in turn: random flips from 1 to 1,000, flips aimed at leaf, branch,
meta, free-list and overflow pages, value sizes off the map, a truncation, a zeroed region), starts it, reads
everything back against digests the fuzzer kept, takes new blocks, restarts and reads again
(``tests/support/disk_fuzz.py``). Most trials run the store in a child process (an embedded store, the same
store and disk tier as a node, without gRPC); ``--serve-seeds`` trials run a real ``kvstore serve``. Each Redis
trial damages stored values with a plain client (``tests/support/redis_fuzz.py``).

The counts that must be 0: wrong blocks served, failed starts, blocks the damage did not reach that were lost.

Usage::

    python benchmarks/bench_corruption.py [--seeds 450] [--serve-seeds 18] [--redis-seeds 600]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def _summary(counts) -> dict:  # type: ignore[no-untyped-def]
    data = counts.as_dict()
    data["failures"] = data["failures"][:20]
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=450, help="LMDB trials in a store process")
    parser.add_argument("--serve-seeds", type=int, default=18, help="LMDB trials through a real kvstore serve")
    parser.add_argument("--redis-seeds", type=int, default=600, help="Redis trials")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_corruption"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()

    from tests.support import disk_fuzz, redis_fuzz
    from tests.support.redis import RedisProcess

    load_before = os.getloadavg()
    started = time.monotonic()
    first = args.first_seed
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-corruption-") as tmp:  # removed, trials' files too
        workdir = Path(tmp)
        lmdb_counts = disk_fuzz.Counts()
        for seed in range(first, first + args.seeds):
            lmdb_counts.add(disk_fuzz.run_trial(seed, disk_fuzz.MODES[seed % len(disk_fuzz.MODES)], workdir=workdir))
            if (seed - first + 1) % 50 == 0:
                print(f"LMDB {seed - first + 1} trials: {lmdb_counts.wrong_blocks} wrong, {lmdb_counts.failed_starts} "
                      f"failed starts, {lmdb_counts.lost_blocks} lost", flush=True)
        serve_counts = disk_fuzz.Counts()
        for seed in range(first + 100_000, first + 100_000 + args.serve_seeds):
            serve_counts.add(disk_fuzz.run_trial(seed, disk_fuzz.MODES[seed % len(disk_fuzz.MODES)], node_kind="serve",
                                                 workdir=workdir))
        with RedisProcess() as server:
            redis_counts = redis_fuzz.trials(server.url, range(first, first + args.redis_seeds))
    elapsed_s = time.monotonic() - started

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(elapsed_s)}
    results = {"meta": meta, "lmdb_store_process": _summary(lmdb_counts), "lmdb_kvstore_serve": _summary(serve_counts),
               "redis": _summary(redis_counts)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))

    def lmdb_row(name: str, c) -> str:  # type: ignore[no-untyped-def]
        return (f"| {name} | {c.trials} | {c.flips} | {c.truncations} | {c.zeroed_regions} | {c.blocks_checked} | "
                f"{c.blocks_served} | {c.repaired_starts} | **{c.wrong_blocks}** | **{c.failed_starts}** | "
                f"**{c.lost_blocks}** |")

    lines = [
        "# Corruption fuzzers: the disk tier (LMDB) and the shared tier (Redis)",
        "",
        f"Command: `{command}` ({meta['cpus']} CPUs, Python {meta['python']}, load average "
        f"{meta['load_average_before'][0]} before, {meta['load_average_after'][0]} after, {meta['seconds']} s).",
        "See the script's docstring for what one trial does. Bold counts must be 0.",
        "",
        "| LMDB | seeds | bytes flipped | truncations | zeroed regions | blocks checked | blocks served | "
        "starts that repaired the file | wrong blocks served | failed starts | blocks not hit, lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        lmdb_row("store process", lmdb_counts),
        lmdb_row("kvstore serve", serve_counts),
        "",
        "Trials per mode (store process): " + ", ".join(f"{m} {n}" for m, n in sorted(lmdb_counts.per_mode.items())),
        "",
        "| Redis | seeds | bytes flipped | values damaged | blocks checked | blocks served | corrupt records deleted "
        "| wrong blocks served | untouched blocks lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| values | {redis_counts.trials} | {redis_counts.flips} | {redis_counts.values_damaged} | "
        f"{redis_counts.blocks_checked} | {redis_counts.blocks_served} | {redis_counts.corrupt_records} | "
        f"**{redis_counts.wrong_blocks}** | **{redis_counts.lost_blocks}** |",
        "",
    ]
    failures = lmdb_counts.failures + serve_counts.failures + redis_counts.failures
    if failures:
        lines += ["Failures:", "", *[f"* {f}" for f in failures[:20]], ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    if lmdb_counts.wrong_blocks or lmdb_counts.failed_starts or lmdb_counts.lost_blocks or serve_counts.wrong_blocks \
            or serve_counts.failed_starts or serve_counts.lost_blocks or redis_counts.wrong_blocks \
            or redis_counts.lost_blocks:
        sys.exit(1)


if __name__ == "__main__":
    main()
