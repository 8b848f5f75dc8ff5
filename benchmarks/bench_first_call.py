"""A client's first same-host call against its second: nothing is imported or built on the hot path (issue 32, item 4).

Each trial is a fresh Python process that imports ``kvstore.client`` (and torch,
for the tensor case, as the caller's own code does), opens a ``KVStoreClient``
to a ``kvstore serve`` node on this host, and times its first Put, its second
Put, its first Get and its second Get of 8 blocks of 256 KiB, each over the
same-host data plane. Imports before the first call are timed apart. The first
call includes the session's attach (``Capabilities``, ``Attach``, the handoff):
that is the one cost a first call may add.

    .venv/bin/python benchmarks/bench_first_call.py            # ~30 s
    .venv/bin/python benchmarks/bench_first_call.py --trials 10

Writes ``benchmarks/results/first_call.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.kvnode import KVNode  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

CHILD = r"""
import json, sys, time
started = time.perf_counter()
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks
tensors = sys.argv[2] == "tensors"
if tensors:
    import torch
imported = time.perf_counter() - started
namespace = Namespace(model="bench/first_call/" + sys.argv[3], dtype="float16", block_size=16)
shape = (8, 2, 8, 16, 64)  # 256 KiB of float16
blocks_a = [(torch.full(shape, i, dtype=torch.float16) if tensors else None) for i in range(8)]
if not tensors:
    from kvstore.blocks.tensors import encode_header
    payload = bytes(2 * 8 * 2 * 8 * 16 * 64)
    blocks_a = [encode_header("float16", "kv", shape, payload) + payload for _ in range(8)]
hashes_a = hash_blocks(namespace, list(range(8 * 16)))
hashes_b = hash_blocks(namespace, list(range(1000, 1000 + 8 * 16)))
modules_before = set(sys.modules)
client = KVStoreClient(sys.argv[1], timeout_s=30)
times = {}
for name, call in (("put 1", lambda: client.put(namespace, hashes_a, blocks_a)),
                   ("put 2", lambda: client.put(namespace, hashes_b, blocks_a)),
                   ("get 1", lambda: client.get(namespace, hashes_a)),
                   ("get 2", lambda: client.get(namespace, hashes_b))):
    t = time.perf_counter()
    call()
    times[name] = time.perf_counter() - t
print(json.dumps({"imported_s": imported, "times_s": times, "path": client.shared_memory()[0],
                  "imported_in_calls": sorted(m for m in set(sys.modules) - modules_before if "." not in m)}))
client.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "first_call"))
    args = parser.parse_args()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results: dict[str, list[dict]] = {"bytes": [], "tensors": []}
    with KVNode(memory_capacity="256MiB", metrics=False) as node:
        node.start()
        for trial in range(args.trials):
            for kind in results:
                out = subprocess.run([sys.executable, "-c", CHILD, node.target, kind, f"{kind}-{trial}"], env=env,
                                     capture_output=True, text=True, timeout=120, check=True)
                results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    for kind, trials in results.items():
        assert all(t["path"] == "attached" for t in trials), [t["path"] for t in trials]
        median = {name: 1e3 * statistics.median(t["times_s"][name] for t in trials) for name in trials[0]["times_s"]}
        rows.append({"blocks": kind, "import_ms": 1e3 * statistics.median(t["imported_s"] for t in trials),
                     **{f"{name}_ms": v for name, v in median.items()},
                     "put_first_over_second": median["put 1"] / median["put 2"],
                     "get_first_over_second": median["get 1"] / median["get 2"],
                     "imported_in_calls": sorted({m for t in trials for m in t["imported_in_calls"]})})
    command = "python benchmarks/bench_first_call.py" + (f" --trials {args.trials}" if args.trials != 5 else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "command": command, "host": platform.platform(), "cpus": os.cpu_count(), "trials": args.trials,
        "load_average_before": load_before, "load_average_after": load_after, "rows": rows}, indent=2) + "\n")
    lines = [
        "# bench_first_call: a client's first same-host call against its second",
        "",
        f"Command (repo root, from `.venv`, under `flock /tmp/heavy.lock`): `{command}`",
        "",
        f"8 blocks of 256 KiB per call, a fresh process per trial, medians of {args.trials} trials. Host: "
        f"{platform.platform()}, {os.cpu_count()} CPUs, shared: load average (1/5/15 min) {load_before} before, "
        f"{load_after} after. The first Put includes the session's attach.",
        "",
        "| blocks | imports (ms) | put 1 (ms) | put 2 (ms) | put 1 / put 2 | get 1 (ms) | get 2 (ms) | get 1 / get 2 "
        "| top-level modules first imported during the calls |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [f"| {r['blocks']} | {r['import_ms']:.0f} | {r['put 1_ms']:.2f} | {r['put 2_ms']:.2f} | "
              f"{r['put_first_over_second']:.2f}x | {r['get 1_ms']:.2f} | {r['get 2_ms']:.2f} | "
              f"{r['get_first_over_second']:.2f}x | {', '.join(r['imported_in_calls']) or 'none'} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
