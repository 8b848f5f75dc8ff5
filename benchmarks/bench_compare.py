"""Before and after: the same measurements from two checkouts, in one run, with their calls interleaved.

A change to the store's core must keep every figure of ``bench_service``, ``bench_tiers``, ``bench_index`` and
``bench_hf_ttft``. On a shared, noisy machine two runs at different times cannot tell a 5% change from the
load, so this script starts one worker process per checkout (``PYTHONPATH`` and working directory set to it,
so each imports its own ``kvstore`` and starts its own ``kvstore serve``), and takes turns between them: each
round runs one call of every op of both workers, in a fresh random order. Each worker times its own calls
(``time.perf_counter`` around the call only), and every figure is the median over rounds.

Suites (``--suite``, several allowed):

* ``service``: ``kvstore serve`` with a memory tier and the synchronous client, as ``bench_service``: Get of one
  block (256 KiB, 2 MiB, 16 MiB) and Lookup of 1, 64 and 1,024 hashes, beside the raw gRPC echo server's Get and
  empty call (one echo server, from this checkout, called by both workers in the same rounds: its median over
  both is the baseline); the goals are ``bench_service``'s (Get >= 0.9x the echo, Lookup(1,024) <= 1.5x an empty
  call), for each checkout.
* ``tiers``: the memory (page pool) and LMDB tiers' put and get of one 64 MiB batch of 2 MiB blocks, as
  ``bench_tiers``, each as a ratio to ``Tensor.copy_`` of the same bytes timed beside it.
* ``index``: ``bench_index``'s bytes of RAM per block, from each checkout's own script (deterministic).
* ``ttft``: ``bench_hf_ttft``'s modes (full prefill, in-process reuse, through the embedded store, through
  ``kvstore serve``), each worker with its own model copy, node and connectors; speedups are full prefill over
  each mode (minimum over rounds, as ``bench_hf_ttft``), and the goal is service >= 0.9x in-process.

Usage::

    python benchmarks/bench_compare.py --before /path/to/old/checkout [--suite service --suite tiers ...]

Writes ``benchmarks/results/bench_compare.{json,md}`` (with the 1-minute load average at the start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve()
REPO_ROOT = HERE.parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
MiB = 1 << 20
MAX_MESSAGE_BYTES = 4 * MiB
SERVICE_SIZES = (256 * 1024, 2 * MiB, 16 * MiB)
LOOKUP_SIZES = (1, 64, 1024)


# ---------------------------------------------------------------------- workers (one per checkout)


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _checkout() -> Path:
    import kvstore

    return Path(kvstore.__file__).resolve().parents[1]


class ServiceWorker:
    """A ``kvstore serve`` node of this checkout, its synchronous client, and a client of the shared echo server."""

    def __init__(self, echo_target: str) -> None:
        import torch

        sys.path.insert(0, str(_checkout()))
        from kvstore.client import KVStoreClient
        from kvstore.blocks.tensors import encode_block
        from kvstore.keys import Namespace
        from kvstore.server.process import tune_malloc
        from tests.support.kvnode import KVNode

        bench_service = _load(_checkout() / "benchmarks" / "bench_service.py", "bench_service_of_checkout")
        tune_malloc()
        self.node = KVNode(memory_capacity="1GiB", metrics=False, extra_args=["--log-level", "WARNING"]).start()
        self.kv = KVStoreClient(self.node.target, max_message_bytes=MAX_MESSAGE_BYTES, timeout_s=120)
        self.echo = bench_service.EchoClient(echo_target, MAX_MESSAGE_BYTES)
        self.ns = Namespace(model="bench-compare", dtype="uint8", layout="mla", block_size=1)
        self.get_hashes = {}
        for size in SERVICE_SIZES:
            block = encode_block(torch.randint(0, 256, (1, 1, 1, size - 64), dtype=torch.uint8), "mla")
            h = size.to_bytes(16, "little")
            self.kv.put(self.ns, [h], [block])
            assert self.kv.get(self.ns, [h]) == [block]
            self.get_hashes[size] = [h]
        small = encode_block(torch.zeros(1, 1, 1, 64, dtype=torch.uint8), "mla")
        self.hashes = [(7 << 32 | i).to_bytes(16, "little") for i in range(1024)]
        for start in range(0, 1024, 256):
            self.kv.put(self.ns, self.hashes[start:start + 256], [small] * 256)
        assert self.kv.lookup(self.ns, self.hashes).num_blocks == 1024
        self.ops: dict[str, Callable[[], object]] = {}
        for size in SERVICE_SIZES:
            self.ops[f"get_{size}"] = lambda size=size: self.kv.get(self.ns, self.get_hashes[size])
            self.ops[f"echo_get_{size}"] = lambda size=size: self.echo.get(size)
        for n in LOOKUP_SIZES:
            self.ops[f"lookup_{n}"] = lambda n=n: self.kv.lookup(self.ns, self.hashes[:n])
        self.ops["empty"] = self.echo.empty

    def run(self, op: str) -> float:
        fn = self.ops[op]
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def close(self) -> None:
        self.kv.close()
        self.echo.close()
        self.node.close()


class TiersWorker:
    """This checkout's memory and LMDB tiers, and one batch of blocks, as ``bench_tiers`` measures them."""

    def __init__(self, block_bytes: int = 2 * MiB, batch_bytes: int = 64 * MiB) -> None:
        import tempfile

        import torch

        sys.path.insert(0, str(_checkout()))
        from kvstore.tiers.base import BlockMeta
        from kvstore.tiers.lmdb import LMDBTier
        from kvstore.tiers.memory import MemoryTier

        bench_tiers = _load(_checkout() / "benchmarks" / "bench_tiers.py", "bench_tiers_of_checkout")
        self.loop = asyncio.new_event_loop()
        num = batch_bytes // block_bytes
        self.nbytes = num * block_bytes
        self.values = bench_tiers.make_values(block_bytes, num)
        self.keys = [i.to_bytes(8, "little") * 3 for i in range(num)]
        self.metas = [BlockMeta()] * num
        self.src = torch.randint(0, 256, (num, block_bytes), dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)
        self.tmp = tempfile.mkdtemp(prefix="bench_compare_")
        self.tiers = {"memory": MemoryTier(self.nbytes + 64 * MiB, page_bytes=64 * 1024),
                      "lmdb": LMDBTier(Path(self.tmp) / "lmdb", 2 * self.nbytes + 64 * MiB)}

    def run(self, op: str) -> float:
        """``copy_`` (the baseline), or ``<tier>_put`` / ``<tier>_get``; a put is undone by its get's delete."""
        if op == "copy":
            start = time.perf_counter()
            for i in range(len(self.keys)):
                self.dst[i].copy_(self.src[i])
            return time.perf_counter() - start
        name, what = op.rsplit("_", 1)
        tier = self.tiers[name]

        async def timed() -> float:
            if what == "put":
                start = time.perf_counter()
                await tier.put(self.keys, self.values, self.metas)
                return time.perf_counter() - start
            await tier.put(self.keys, self.values, self.metas)  # untimed: the get needs the batch
            start = time.perf_counter()
            got = await tier.get(self.keys)
            elapsed = time.perf_counter() - start
            del got
            await tier.delete(self.keys)
            return elapsed

        async def undo() -> None:
            await tier.delete(self.keys)

        elapsed = self.loop.run_until_complete(timed())
        if what == "put":
            self.loop.run_until_complete(undo())
        return elapsed

    def close(self) -> None:
        import shutil

        for tier in self.tiers.values():
            self.loop.run_until_complete(tier.close())  # (a coroutine: called on the loop when awaited)
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TtftWorker:
    """``bench_hf_ttft``'s four modes, with this checkout's connector, embedded store and node."""

    def __init__(self, model: str = "default", prompt_tokens: int = 2048, cached_tokens: int = 1536,
                 block_size: int = 256) -> None:
        import torch

        sys.path.insert(0, str(_checkout()))
        from kvstore.client import KVStoreClient
        from kvstore.config import MemoryTierConfig, StoreConfig
        from kvstore.connectors.hf import HFConnector
        from kvstore.tools.demo.model import build_model, spec_from
        from kvstore.embedded import open_store

        bench = _load(_checkout() / "benchmarks" / "bench_hf_ttft.py", "bench_hf_ttft_of_checkout")
        spec = spec_from(model)
        self.model = build_model(spec)
        self.ids = bench._prompt(prompt_tokens)
        prefix = self.ids[:cached_tokens]
        self.cached_tokens = cached_tokens
        self.embedded = open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=bench.STORE_MEMORY_BYTES)))
        self.local = HFConnector(self.model, self.embedded, block_size=block_size, model_id=spec.model_id)
        _, cache = self.local.prefill(prefix)
        self.prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]
        self.local.save(prefix, cache, background=False).result()
        self.node = bench._Node()
        self.client = KVStoreClient(self.node.target, timeout_s=30.0)
        self.remote = HFConnector(self.model, self.client, block_size=block_size, model_id=spec.model_id,
                                  load_timeout_s=30.0)
        self.remote.save(prefix, cache, background=False).result()
        self.torch = torch

    def run(self, op: str) -> float:
        torch = self.torch
        if op == "full prefill":
            return self.local.generate(self.ids, 1, use_store=False).ttft_s
        if op == "in-process":
            started = time.perf_counter()
            cache = self.local.new_cache()
            with torch.no_grad():
                for layer, (k, v) in enumerate(self.prefix_kv):
                    cache.update(k, v, layer)
            self.local.prefill(self.ids, cache)
            return time.perf_counter() - started
        connector = self.local if op == "embedded" else self.remote
        result = connector.generate(self.ids, 1, save=False)
        assert result.num_cached_tokens == self.cached_tokens, result.num_cached_tokens
        return result.ttft_s

    def close(self) -> None:
        for closing in (self.local.close, self.remote.close, self.embedded.close, self.client.close, self.node.close):
            closing()


WORKERS = {"service": ServiceWorker, "tiers": TiersWorker, "ttft": TtftWorker}


def worker_main(suite: str, setup: dict[str, Any]) -> int:
    """Serve one suite's ops over stdin/stdout: a JSON line per op name in, a JSON line per op out."""
    worker = WORKERS[suite](**setup)
    print(json.dumps({"ready": str(_checkout())}), flush=True)
    try:
        for line in sys.stdin:
            op = json.loads(line)["op"]
            if op == "close":
                break
            print(json.dumps({"seconds": worker.run(op)}), flush=True)
    finally:
        worker.close()
    return 0


class Worker:
    """The coordinator's handle on a worker process of one checkout."""

    def __init__(self, label: str, checkout: Path, suite: str, setup: dict[str, Any]) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"}
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--worker", suite, "--setup", json.dumps(setup)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=checkout, env=env, text=True)
        ready = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        assert Path(ready["ready"]) == checkout.resolve(), (ready, checkout)  # it runs that checkout's kvstore

    def run(self, op: str) -> float:
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return float(json.loads(self.proc.stdout.readline())["seconds"])  # type: ignore[union-attr]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(120)
        except Exception:  # noqa: BLE001 - a worker that died already
            self.proc.kill()


def interleave(workers: list[Worker], ops: list[str], rounds: int, seed: int) -> dict[str, dict[str, list[float]]]:
    """``rounds`` rounds of one call of every op on every worker, each round in a fresh random order."""
    rng = random.Random(seed)
    samples: dict[str, dict[str, list[float]]] = {w.label: {op: [] for op in ops} for w in workers}
    turns = [(w, op) for w in workers for op in ops]
    for warm in turns:  # one untimed call of each first
        warm[0].run(warm[1])
    for _ in range(rounds):
        rng.shuffle(turns)
        for worker, op in turns:
            samples[worker.label][op].append(worker.run(op))
    return samples


# ---------------------------------------------------------------------- suites (the coordinator)


def run_service(before: Path, after: Path, rounds: int, lookups: int) -> dict[str, Any]:
    echo = subprocess.Popen([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_service.py"), "--echo-server"],
                            stdout=subprocess.PIPE, cwd=REPO_ROOT, text=True)
    try:
        target = f"127.0.0.1:{int(echo.stdout.readline())}"  # type: ignore[union-attr]
        workers = [Worker(label, path, "service", {"echo_target": target})
                   for label, path in (("before", before), ("after", after))]
        try:
            get_ops = [f"{kind}_{size}" for size in SERVICE_SIZES for kind in ("get", "echo_get")]
            get = interleave(workers, get_ops, rounds, seed=1)
            lookup = interleave(workers, [*(f"lookup_{n}" for n in LOOKUP_SIZES), "empty"], lookups, seed=2)
        finally:
            for worker in workers:
                worker.close()
    finally:
        echo.kill()
        echo.wait()
    def pooled(samples: dict[str, dict[str, list[float]]], op: str) -> float:
        """The median of the baseline's calls by both workers: one echo server, measured in the same rounds."""
        return statistics.median(samples["before"][op] + samples["after"][op]) * 1e3

    rows = []
    for size in SERVICE_SIZES:
        row: dict[str, Any] = {"op": f"Get {size // 1024} KiB" if size < MiB else f"Get {size // MiB} MiB"}
        echo_ms = pooled(get, f"echo_get_{size}")
        for label in ("before", "after"):
            ms = statistics.median(get[label][f"get_{size}"]) * 1e3
            row[f"{label}_ms"], row[f"{label}_vs_baseline"] = ms, echo_ms / ms
        row["baseline"], row["goal"] = "raw gRPC echo (Get vs echo, higher is better)", ">= 0.9x"
        rows.append(row)
    empty_ms = pooled(lookup, "empty")
    for n in LOOKUP_SIZES:
        row = {"op": f"Lookup {n:,} hashes"}
        for label in ("before", "after"):
            ms = statistics.median(lookup[label][f"lookup_{n}"]) * 1e3
            row[f"{label}_ms"], row[f"{label}_vs_baseline"] = ms, ms / empty_ms
        row["baseline"], row["goal"] = "empty call (Lookup / empty, lower is better)", "<= 1.5x" if n == 1024 else ""
        rows.append(row)
    for row in rows:
        row["after_over_before"] = row["after_ms"] / row["before_ms"]
    return {"rows": rows, "rounds": rounds, "lookups": lookups, "samples_s": {"get": get, "lookup": lookup}}


def run_tiers(before: Path, after: Path, rounds: int) -> dict[str, Any]:
    workers = [Worker(label, path, "tiers", {}) for label, path in (("before", before), ("after", after))]
    ops = ["copy", "memory_put", "memory_get", "lmdb_put", "lmdb_get"]
    try:
        samples = interleave(workers, ops, rounds, seed=3)
    finally:
        for worker in workers:
            worker.close()
    rows = []
    for op in ops[1:]:
        row: dict[str, Any] = {"op": op.replace("_", " ") + " (64 MiB of 2 MiB blocks)"}
        for label in ("before", "after"):
            s = samples[label]
            row[f"{label}_ms"] = statistics.median(s[op]) * 1e3
            row[f"{label}_vs_baseline"] = statistics.median(c / t for c, t in zip(s["copy"], s[op]))
        row["after_over_before"] = row["after_ms"] / row["before_ms"]
        row["baseline"], row["goal"] = "Tensor.copy_ of the same bytes (higher is better)", ""
        rows.append(row)
    return {"rows": rows, "rounds": rounds, "samples_s": samples}


def run_index(before: Path, after: Path, num_blocks: int) -> dict[str, Any]:
    """Each checkout's own ``bench_index`` (tracemalloc: deterministic, so no interleaving is needed)."""
    out: dict[str, Any] = {}
    for label, path in (("before", before), ("after", after)):
        env = {**os.environ, "PYTHONPATH": str(path)}
        subprocess.run([sys.executable, str(path / "benchmarks" / "bench_index.py"), str(num_blocks)], cwd=path,
                       env=env, check=True, capture_output=True)
        out[label] = json.loads((path / "benchmarks" / "results" / "bench_index.json").read_text())
    if before != after:  # the before checkout's recorded result stays as it was
        subprocess.run(["git", "-C", str(before), "checkout", "--", "benchmarks/results/bench_index.json",
                        "benchmarks/results/bench_index.md"], capture_output=True)
    row = {"op": f"index RAM per block ({num_blocks:,} blocks)", "baseline": "", "goal": "<= 300 bytes"}
    for label in ("before", "after"):
        row[f"{label}_bytes"] = out[label]["total_bytes_per_block"]
    row["after_over_before"] = row["after_bytes"] / row["before_bytes"]
    return {"rows": [row], "detail": out}


def run_ttft(before: Path, after: Path, rounds: int, model: str) -> dict[str, Any]:
    workers = [Worker(label, path, "ttft", {"model": model}) for label, path in (("before", before), ("after", after))]
    modes = ["full prefill", "in-process", "embedded", "service"]
    try:
        samples = interleave(workers, modes, rounds, seed=4)
    finally:
        for worker in workers:
            worker.close()
    rows = []
    for mode in modes[1:]:
        row: dict[str, Any] = {"op": f"TTFT, {mode}"}
        for label in ("before", "after"):
            s = samples[label]
            row[f"{label}_ms"] = min(s[mode]) * 1e3
            row[f"{label}_vs_baseline"] = min(s["full prefill"]) / min(s[mode])  # the speedup
        row["after_over_before"] = row["after_ms"] / row["before_ms"]
        row["baseline"], row["goal"] = "full prefill (speedup, higher is better)", ""
        rows.append(row)
    for label in ("before", "after"):
        speedup = {r["op"]: r[f"{label}_vs_baseline"] for r in rows}
        rows[-1][f"{label}_service_over_in_process"] = speedup["TTFT, service"] / speedup["TTFT, in-process"]
    rows[-1]["goal"] = "service speedup >= 0.9x in-process"
    return {"rows": rows, "rounds": rounds, "model": model, "samples_s": samples}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# bench_compare: before and after, in one run, calls interleaved", "",
             f"Command: `{result['command']}`", "",
             f"Before: `{result['before']}` ({result['before_commit']}); after: `{result['after']}` "
             f"({result['after_commit']}). Python {result['python']}, {result['cpus']} CPUs; 1-minute load average "
             f"{result['load_start']:.1f} at the start, {result['load_end']:.1f} at the end (other work shares the "
             "machine: the interleaving gives both checkouts the same load). Each figure is the median over rounds "
             "(TTFT: the minimum, as bench_hf_ttft); a ratio within 5% counts as the same.", "",
             "| measurement | before | after | after / before | vs baseline, before | vs baseline, after "
             "| baseline | goal |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for suite, data in result["suites"].items():
        for row in data["rows"]:
            unit = "bytes" if "before_bytes" in row else "ms"
            before, after = row.get(f"before_{unit}"), row.get(f"after_{unit}")
            vs_before = row.get("before_vs_baseline")
            vs_after = row.get("after_vs_baseline")
            fmt = (lambda v: f"{v:.0f}") if unit == "bytes" else (lambda v: f"{v:.3f} ms")
            lines.append(f"| {row['op']} | {fmt(before)} | {fmt(after)} | {row['after_over_before']:.3f} "
                         f"| {'' if vs_before is None else f'{vs_before:.2f}x'} "
                         f"| {'' if vs_after is None else f'{vs_after:.2f}x'} | {row['baseline']} | {row['goal']} |")
            if "before_service_over_in_process" in row:
                lines.append(f"| TTFT, service speedup / in-process speedup | "
                             f"{row['before_service_over_in_process']:.3f} | {row['after_service_over_in_process']:.3f}"
                             f" | {row['after_service_over_in_process'] / row['before_service_over_in_process']:.3f}"
                             f" | | | | >= 0.9 |")
    return "\n".join(lines) + "\n"


def _commit(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" + uncommitted changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the checkout of the code before the change")
    parser.add_argument("--after", type=Path, default=REPO_ROOT, help="the checkout after it (this one by default)")
    parser.add_argument("--suite", action="append", choices=["service", "tiers", "index", "ttft"],
                        help="what to compare (default: all)")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of the service's Gets and the tiers")
    parser.add_argument("--lookups", type=int, default=300, help="rounds of the Lookups")
    parser.add_argument("--ttft-rounds", type=int, default=7)
    parser.add_argument("--ttft-model", default="default", choices=["default", "small", "tiny"])
    parser.add_argument("--index-blocks", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_compare")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, json.loads(args.setup))
    if args.before is None:
        parser.error("--before is required")
    before, after = args.before.resolve(), args.after.resolve()
    suites = args.suite or ["service", "tiers", "index", "ttft"]
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_compare.py", *sys.argv[1:]]),
        "before": str(before), "after": str(after), "before_commit": _commit(before), "after_commit": _commit(after),
        "python": platform.python_version(), "cpus": os.cpu_count(), "load_start": os.getloadavg()[0], "suites": {},
    }
    for suite in suites:
        started = time.monotonic()
        if suite == "service":
            result["suites"][suite] = run_service(before, after, args.rounds, args.lookups)
        elif suite == "tiers":
            result["suites"][suite] = run_tiers(before, after, args.rounds)
        elif suite == "index":
            result["suites"][suite] = run_index(before, after, args.index_blocks)
        else:
            result["suites"][suite] = run_ttft(before, after, args.ttft_rounds, args.ttft_model)
        result["suites"][suite]["load_at_end"] = os.getloadavg()[0]
        print(f"{suite}: {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        for row in result["suites"][suite]["rows"]:
            print("   ", json.dumps({k: v for k, v in row.items() if not isinstance(v, (dict, list))}), flush=True)
    result["load_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
