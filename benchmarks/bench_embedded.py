"""The embedded store's Put and Get against LMCache's in-process store and one ``Tensor.copy_``, interleaved.

Issue 38, item 4: the embedded store (``kvstore.open_store``) should put and get
at least as fast as LMCache 0.5.6's ``LocalCPUBackend`` on the same payloads.
Each round runs, in a fresh random order, ``Tensor.copy_`` of the payload's bytes
(the baseline), kvstore's embedded store and LMCache's backend (in a worker
process of its own venv, ``benchmarks/lmcache_local_cpu.py``, driven one step at
a time over a pipe and timed there). Every system puts the payload under new
keys, then gets it into a preallocated tensor it owns; every Get is checked
against the bytes put (outside the timing), and the round's keys are deleted
before the next round (untimed), so the stores stay at one payload.

Payloads (float16, kvstore's ``kv`` layout ``[num_layers, 2, num_kv_heads, block_size, head_dim]``):

* ``24 MiB``: 96 blocks of 256 KiB, ``[8, 2, 4, 16, 128]`` (LMCache: 96 chunks of 16 tokens);
* ``2 MiB``: one block of ``[8, 2, 4, 128, 128]`` (LMCache: one chunk of 128 tokens).

Figures are medians and minima over the rounds, and time over one ``copy_`` of
the same bytes in the same run (lower is better): the ratio of the medians, of
the minima, and the median of each round's own ratio (load that comes and goes
on a shared machine hits a round's steps alike). LMCache's time over kvstore's
is the goal's figure (>= 1.0), taken the same three ways. LMCache's worker also times its own
``copy_`` of the payload, a check that the two processes copy alike.

    .venv/bin/python benchmarks/bench_embedded.py --lmcache-python /tmp/venv-lmcache/bin/python
    .venv/bin/python benchmarks/bench_embedded.py --no-lmcache        # kvstore and copy_ only

LMCache's venv (never one of the project's): ``python3 -m venv /tmp/venv-lmcache``, then
``pip install torch==2.13.0`` (CPU) and ``pip install lmcache==0.5.6``. Writes
``benchmarks/results/bench_embedded.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvstore.config import MemoryTierConfig, StoreConfig  # noqa: E402
from kvstore.embedded import EmbeddedStore  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 128
PAYLOADS = {"24 MiB": (96, 16), "2 MiB": (1, 128)}
"""Payload name -> (blocks, tokens per block)."""
SEED = 20261203


class LMCacheWorker:
    """``benchmarks/lmcache_local_cpu.py`` in LMCache's venv, one JSON request and reply a line."""

    def __init__(self, python: str, num_blocks: int, tokens: int, threads: int) -> None:
        self.proc = subprocess.Popen([python, str(REPO / "benchmarks" / "lmcache_local_cpu.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env={**os.environ, "PYTHONPATH": ""})
        self.setup = self.ask({"op": "setup", "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                               "tokens": tokens, "num_blocks": num_blocks, "seed": SEED, "dtype": "float16",
                               "threads": threads})

    def ask(self, request: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the LMCache worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.ask({"op": "exit"}) if self.proc.poll() is None else None
        except (BrokenPipeError, RuntimeError):
            pass
        self.proc.wait(timeout=60)


def run_payload(name: str, args: argparse.Namespace) -> dict:
    num_blocks, tokens = PAYLOADS[name]
    torch.manual_seed(SEED)
    source = torch.randn(num_blocks, LAYERS, 2, KV_HEADS, tokens, HEAD_DIM).to(torch.float16)
    blocks = list(source.unbind(0))
    destination = torch.empty_like(source)
    destinations = list(destination.unbind(0))
    flat_source = source.view(-1).view(torch.uint8).clone()
    flat_destination = torch.empty_like(flat_source)
    namespace = Namespace("bench/embedded", dtype="float16", block_size=tokens)
    store = EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=args.capacity)))
    peer = LMCacheWorker(args.lmcache_python, num_blocks, tokens, args.threads) if args.lmcache_python else None
    times: dict[str, list[float]] = {k: [] for k in ("copy_", "kvstore put", "kvstore get", "lmcache put",
                                                     "lmcache get", "lmcache copy_")}
    rng = random.Random(SEED)
    spare = (torch.ones(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8))

    def wake() -> None:
        """An untimed 1 MiB copy_ before each step: torch's threads awake, as LMCache's worker does for its own."""
        spare[1].copy_(spare[0])

    def copy() -> None:
        wake()
        started = time.perf_counter()
        flat_destination.copy_(flat_source)
        times["copy_"].append(time.perf_counter() - started)

    def kvstore(round_: int) -> None:
        hashes = hash_blocks(namespace, list(range(round_ * 1_000_000, round_ * 1_000_000 + tokens * num_blocks)))
        wake()
        started = time.perf_counter()
        store.put(namespace, hashes, blocks)
        times["kvstore put"].append(time.perf_counter() - started)
        destination.zero_()
        wake()
        started = time.perf_counter()
        copied = store.get_into(namespace, hashes, destinations)
        times["kvstore get"].append(time.perf_counter() - started)
        assert copied == num_blocks and torch.equal(destination, source), "kvstore: the Get is not what was put"
        store.delete(namespace, hashes)

    def lmcache(round_: int) -> None:
        assert peer is not None
        times["lmcache put"].append(peer.ask({"op": "put", "round": round_})["s"])
        got = peer.ask({"op": "get", "round": round_})
        assert got["ok"], "LMCache: the Get is not what was put"
        times["lmcache get"].append(got["s"])
        times["lmcache copy_"].append(peer.ask({"op": "copy"})["s"])
        peer.ask({"op": "remove", "round": round_})

    try:
        systems = [copy, kvstore] + ([lmcache] if peer is not None else [])
        for round_ in range(args.warmup + args.rounds):
            if round_ == args.warmup:
                for values in times.values():
                    values.clear()
            order = systems[:]
            rng.shuffle(order)
            for system in order:
                system() if system is copy else system(round_)  # type: ignore[call-arg]
    finally:
        store.close()
        if peer is not None:
            peer.close()
    nbytes = flat_source.numel()
    stats = {k: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v)} for k, v in times.items() if v}
    copy_median, copy_min = stats["copy_"]["median_ms"], stats["copy_"]["min_ms"]
    for row in stats.values():
        row["x_copy_median"] = row["median_ms"] / copy_median
        row["x_copy_min"] = row["min_ms"] / copy_min
    for step, values in times.items():  # each round over the same round's copy_: load that comes and goes hits both
        if values and step != "copy_":
            stats[step]["x_copy_paired"] = statistics.median(v / c for v, c in zip(values, times["copy_"]))
    versus = {}
    if peer is not None:
        for op in ("put", "get"):
            versus[op] = {"median": stats[f"lmcache {op}"]["median_ms"] / stats[f"kvstore {op}"]["median_ms"],
                          "min": stats[f"lmcache {op}"]["min_ms"] / stats[f"kvstore {op}"]["min_ms"],
                          "paired": statistics.median(
                              lm / kv for lm, kv in zip(times[f"lmcache {op}"], times[f"kvstore {op}"]))}
    return {"payload": name, "blocks": num_blocks, "block_shape": [LAYERS, 2, KV_HEADS, tokens, HEAD_DIM],
            "bytes": nbytes, "rounds": args.rounds, "stats": stats, "lmcache_over_kvstore": versus,
            "lmcache": peer.setup if peer is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--capacity", type=int, default=1 << 30, help="the embedded store's memory tier, bytes")
    parser.add_argument("--lmcache-python", default=os.environ.get("KVSTORE_LMCACHE_PYTHON",
                                                                   "/tmp/venv-lmcache/bin/python"),
                        help="python of a venv with lmcache==0.5.6")
    parser.add_argument("--no-lmcache", action="store_true")
    parser.add_argument("--payload", choices=sorted(PAYLOADS), action="append")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's threads in both processes (0: torch's default). On a shared machine under "
                             "load, 1 spares each copy the wait for a second thread the scheduler has not run yet")
    parser.add_argument("--out", default=str(RESULTS / "bench_embedded"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_lmcache:
        args.lmcache_python = ""
    elif not Path(args.lmcache_python).exists():
        parser.error(f"{args.lmcache_python} does not exist: make LMCache's venv (see the docstring) or --no-lmcache")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = [run_payload(name, args) for name in (args.payload or list(PAYLOADS))]
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = "python benchmarks/bench_embedded.py" + (" --no-lmcache" if args.no_lmcache else "") + (
        f" --rounds {args.rounds}" if args.rounds != 30 else "") + (f" --threads {args.threads}" if args.threads else "")
    report(command, runs, load_before, load_after)


def report(command: str, runs: list[dict], load_before: str, load_after: str) -> None:
    out = Path(parse_out())
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "host": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_before": load_before, "load_average_after": load_after}
    out.with_suffix(".json").write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")
    lines = ["# bench_embedded: the embedded store against LMCache's in-process store and `Tensor.copy_`", "",
             f"Command (repo root, `.venv`): `{command}`", "",
             f"Host: {meta['host']}, {meta['cpus']} CPUs (torch {meta['torch']}, {meta['torch_threads']} threads), "
             f"shared with other work: load average (1/5/15 min) {load_before} before, {load_after} after. "
             "Each round in a fresh random order; LMCache in its own process and venv, timed there. No GPU.", ""]
    for run in runs:
        lines += [f"## {run['payload']}: {run['blocks']} block(s) of {run['block_shape']} float16, "
                  f"{run['rounds']} rounds", "",
                  "| step | median (ms) | min (ms) | x copy_ (medians) | x copy_ (minima) | x copy_ (round by round) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, row in run["stats"].items():
            paired = f"{row['x_copy_paired']:.2f}" if "x_copy_paired" in row else "1.00"
            lines.append(f"| {name} | {row['median_ms']:.3f} | {row['min_ms']:.3f} | {row['x_copy_median']:.2f} | "
                         f"{row['x_copy_min']:.2f} | {paired} |")
        if run["lmcache_over_kvstore"]:
            lines += ["", "LMCache's time over kvstore's (goal >= 1.0): " + "; ".join(
                f"{op} {v['median']:.2f} (medians), {v['min']:.2f} (minima), {v['paired']:.2f} (round by round)"
                for op, v in run["lmcache_over_kvstore"].items())]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def parse_out() -> str:
    for i, arg in enumerate(sys.argv):
        if arg == "--out" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return str(RESULTS / "bench_embedded")


if __name__ == "__main__":
    main()
