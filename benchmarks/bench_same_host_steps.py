"""Where a same-host Get and Put through ``kvstore serve`` spend their time, step by step (issue 38's gaps).

One ``kvstore serve`` node (shared memory on, a 256 MiB memory tier, which the timed Puts fill and then evict from, as in service) runs as a
subprocess; this process is its client. In each round, in a fresh random
order, it times each step a same-host call is made of, against one
``Tensor.copy_`` of the same bytes in the same round:

* ``lookup 1``: a Lookup of one hash: one control-channel round trip (a frame
  each way over the Unix socket, the node's asyncio loop in between), the floor
  under every same-host call;
* ``read+release``: ``client.read`` of the prefix and its release: the GetShared
  round trip, the node's read and lease in place (no byte copied), the client's
  view of each block in the node's slabs;
* ``get_into``: the same plus the one copy into the caller's tensor (what
  ``bench_peers`` times as a Get);
* ``checksum``: xxh3-64 of the bytes (``kvstore.blocks.tensors``), what the node runs
  over every Put's blocks before storing them;
* ``put``: ``client.put`` of new keys (staged in the pool by the client: one
  copy, then the node checks and indexes them).

The node's CPU (``utime + stime`` from ``/proc``) over the timed Gets and Puts of
each payload, per call, says how much of a call's time the node's Python spends.

Usage::

    python benchmarks/bench_same_host_steps.py [--rounds 30] [--out benchmarks/results/same_host_steps]

Writes ``OUT.md`` and ``OUT.json``: medians in milliseconds and as multiples of
``copy_``, the command and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402

from kvstore import KVStoreClient, Namespace, hash_blocks  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

BLOCK_SHAPE = (8, 2, 4, 16, 128)  # 256 KiB of float16, as bench_peers.py's prefix blocks
PAYLOADS = {"24 MiB": (96, BLOCK_SHAPE), "2 MiB": (1, (8, 2, 4, 128, 128))}
STEPS = ("copy_", "lookup 1", "read+release", "get_into", "checksum", "put")


def _cpu_s(pid: int) -> float:
    """``utime + stime`` of process ``pid``, seconds (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "same_host_steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    started = time.perf_counter()
    with KVNode(memory_capacity="256MiB", metrics=False) as node:  # puts evict: pages are reused, as in service
        results = _run(node.target, node.pid, args.rounds, args.warmup)
    load_end = os.getloadavg()
    command = f"python benchmarks/bench_same_host_steps.py --rounds {args.rounds}"
    doc = {"command": command, "elapsed_s": time.perf_counter() - started, "load_start": load_start,
           "load_end": load_end, "rounds": args.rounds, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    text = _report(doc)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _run(target: str, node_pid: int, rounds: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with KVStoreClient(target, timeout_s=60) as client:
        setups = {}
        for name, (num_blocks, shape) in PAYLOADS.items():
            ns = Namespace(model="bench-steps", dtype="float16", block_size=shape[3], revision=name.replace(" ", ""))
            blocks = [torch.randn(shape, dtype=torch.float32).to(torch.float16) for _ in range(num_blocks)]
            hashes = hash_blocks(ns, list(range(num_blocks * shape[3])))
            assert client.put(ns, hashes, blocks) == num_blocks
            dest = [torch.empty(shape, dtype=torch.float16) for _ in range(num_blocks)]
            src, dst = torch.cat([b.flatten() for b in blocks]), torch.empty(sum(b.numel() for b in blocks),
                                                                             dtype=torch.float16)
            raw = src.numpy().tobytes()
            setups[name] = (ns, blocks, hashes, dest, src, dst, raw)
        assert client.shared_memory()[0] == "attached", client.shared_memory()
        samples: dict[str, dict[str, list[float]]] = {name: {s: [] for s in STEPS} for name in PAYLOADS}
        node_cpu: dict[str, dict[str, float]] = {name: {"get_into": 0.0, "put": 0.0} for name in PAYLOADS}
        counter = [0]

        def put_new(name: str) -> None:
            ns, blocks, _, _, _, _, _ = setups[name]
            counter[0] += 1
            fresh = hash_blocks(ns, [counter[0]] + list(range(len(blocks) * ns.block_size - 1)))
            client.put(ns, fresh, blocks)

        def read_release(name: str) -> None:
            ns, _, hashes, _, _, _, _ = setups[name]
            lease = client.read(ns, hashes)
            assert len(lease.blocks) == len(hashes)
            lease.release()

        for round_no in range(warmup + rounds):
            plan = [(name, step) for name in PAYLOADS for step in STEPS]
            random.shuffle(plan)
            for name, step in plan:
                ns, blocks, hashes, dest, src, dst, raw = setups[name]
                fn: Callable[[], Any] = {
                    "copy_": lambda: dst.copy_(src),
                    "lookup 1": lambda: client.lookup(ns, hashes[:1]),
                    "read+release": lambda: read_release(name),
                    "get_into": lambda: client.get_into(ns, hashes, dest),
                    "checksum": lambda: xxhash.xxh3_64_intdigest(raw),
                    "put": lambda: put_new(name),
                }[step]
                before = _cpu_s(node_pid) if step in ("get_into", "put") else 0.0
                elapsed = _timed(fn)
                if round_no >= warmup:
                    samples[name][step].append(elapsed)
                    if step in ("get_into", "put"):
                        node_cpu[name][step] += _cpu_s(node_pid) - before
        for name in PAYLOADS:
            medians = {s: statistics.median(v) for s, v in samples[name].items()}
            out[name] = {"median_ms": {s: m * 1e3 for s, m in medians.items()},
                         "x_copy": {s: m / medians["copy_"] for s, m in medians.items()},
                         "node_cpu_ms_per_call": {s: c * 1e3 / rounds for s, c in node_cpu[name].items()}}
    return out


def _report(doc: dict[str, Any]) -> str:
    lines = ["# Same-host steps: where a Get and a Put through `kvstore serve` spend their time", "",
             f"Command: `{doc['command']}` ({doc['elapsed_s']:.0f} s); load average (1, 5, 15 min) "
             f"{', '.join(f'{x:.2f}' for x in doc['load_start'])} at the start, "
             f"{', '.join(f'{x:.2f}' for x in doc['load_end'])} at the end, on a shared 2-core machine "
             f"(every figure is a median over {doc['rounds']} rounds, each step in a fresh random order per round).",
             "", "| step | " + " | ".join(f"{n} ms | {n} × copy_" for n in PAYLOADS) + " |",
             "|---|" + "---:|---:|" * len(PAYLOADS)]
    for step in STEPS:
        cells = []
        for name in PAYLOADS:
            r = doc["results"][name]
            cells += [f"{r['median_ms'][step]:.3f}", f"{r['x_copy'][step]:.2f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "The node's CPU (`utime + stime`) per timed call, ms:", "",
              "| call | " + " | ".join(PAYLOADS) + " |", "|---|" + "---:|" * len(PAYLOADS)]
    for call in ("get_into", "put"):
        lines.append(f"| {call} | " + " | ".join(f"{doc['results'][n]['node_cpu_ms_per_call'][call]:.3f}"
                                                  for n in PAYLOADS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
