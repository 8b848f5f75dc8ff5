"""kvstore beside the stores its users would pick instead: Mooncake Store, LMCache, Redis (issues 38 and 40).

One run puts the same bytes through every system, in processes of their own,
interleaved: each round every (system, op, payload) takes its turn in a fresh
random order, and every figure is a median as a multiple of one
``Tensor.copy_`` of the same bytes timed in the same rounds (lower is better).

Payloads: a 24 MiB prefix of 96 blocks of 256 KiB (float16 ``[8, 2, 4, 16,
128]``) and one 2 MiB block. A Get lands in a tensor its caller allocated
before timing; a Put sends a tensor's blocks under new keys. Each worker times
its own calls (``time.perf_counter`` around the call alone) and checks every
answer: a Get's bytes against the payload, a Put's by reading it back (both
untimed, see ``benchmarks/peers/worker.py``).

Systems, same host: ``copy_``; ``kvstore serve`` with its same-host shared
memory (``KVStoreClient(target)``) and over gRPC alone (``shared_memory=False``);
kvstore embedded (``kvstore.open_store``); Mooncake Store's shared-memory mode
(``setup_dummy`` against a ``mooncake_client``), its local segment, and
LMCache's ``LocalCPUBackend`` in process. Across processes over loopback TCP
(issue 40): Redis (pipelined GET / SET with hiredis, plus the copy into the
tensor), LMCache's cache server (``LMCServerConnector``), Mooncake Store over
TCP with the blocks in another process's segment, kvstore over gRPC, and a raw
socket's ``recv_into`` of the same bytes (the floor).

Then: 20 consecutive Gets of the prefix per system (the slowest / their
median); and the node's CPU per GiB of same-host hits (``utime + stime`` of the
``kvstore serve`` process from ``/proc/<pid>/stat`` over 1 and 2 clients'
``get_into`` loops, and over a gRPC client's) against one single-threaded
``copy_`` of a GiB, with the aggregate throughput of 2 clients against 1.

kvstore runs from the project's venv with this checkout on ``PYTHONPATH``,
through its public API only; each peer from a venv of its own, which ``make
bench-peers`` builds (``.venv-peers-mooncake``, ``.venv-peers-lmcache``) and then
runs this in a network namespace of its own where it can (everything on
loopback). Without those venvs this script says so and exits 0.

Usage::

    python benchmarks/bench_peers.py [--rounds 30] [--label TEXT] [--out benchmarks/results/bench_peers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from peers import report  # noqa: E402
from peers.services import Services, Worker  # noqa: E402

GiB = 1 << 30
PREFIX_BYTES = 96 * 256 * 1024
KINDS = ("prefix", "block")
PEER_VENVS = {"mooncake": REPO_ROOT / ".venv-peers-mooncake", "lmcache": REPO_ROOT / ".venv-peers-lmcache"}

# key, label, venv, driver; the settings each gets are filled in by start_systems.
SYSTEMS: list[tuple[str, str, str, str]] = [
    ("copy_", "`copy_` (one `Tensor.copy_` of the same bytes)", "main", "drivers:CopyDriver"),
    ("kvstore-shm", "**kvstore serve, same host (shared memory)**", "main", "kvstore_drivers:ServeDriver"),
    ("kvstore-embedded", "**kvstore embedded**", "main", "kvstore_drivers:EmbeddedDriver"),
    ("mooncake-shm", "Mooncake Store, shared memory (`setup_dummy` + `mooncake_client`)", "mooncake",
     "mooncake_drivers:MooncakeDriver"),
    ("mooncake-local", "Mooncake Store, its own local segment", "mooncake", "mooncake_drivers:MooncakeDriver"),
    ("lmcache-local", "LMCache `LocalCPUBackend` in process", "lmcache", "lmcache_drivers:LocalCPUDriver"),
    ("kvstore-grpc", "**kvstore serve over gRPC alone (`shared_memory=False, bulk=False`)**", "main",
     "kvstore_drivers:ServeDriver"),
    ("kvstore-bulk", "**kvstore serve across hosts: the bulk path (`shared_memory=False`)**", "main",
     "kvstore_drivers:ServeDriver"),
    ("redis", "Redis, pipelined GET / SET (hiredis), plus the copy into the tensor", "main", "drivers:RedisDriver"),
    ("lmcache-server", "LMCache cache server (`LMCServerConnector`)", "lmcache", "lmcache_drivers:ServerDriver"),
    ("mooncake-tcp", "Mooncake Store over TCP, blocks in another process's segment", "mooncake",
     "mooncake_drivers:MooncakeDriver"),
    ("raw-socket", "raw socket, `recv_into` / `sendall` of the same bytes", "main", "drivers:RawSocketDriver"),
]
SAME_HOST = ("copy_", "kvstore-shm", "kvstore-grpc", "kvstore-embedded", "mooncake-shm", "mooncake-local",
             "lmcache-local")
ACROSS = ("copy_", "raw-socket", "redis", "lmcache-server", "mooncake-tcp", "kvstore-bulk", "kvstore-grpc")
LABELS = {key: label for key, label, _, _ in SYSTEMS}
NOTES = [
    "- Every system in a process of its own (`benchmarks/peers/worker.py`), which times each call with "
    "`time.perf_counter` around the call alone; its copies are single-threaded (`torch.set_num_threads(1)`) like the "
    "`copy_` baseline; the system's own threads run as they do.",
    "- kvstore: `get_into(ns, hashes, views)` / `put(ns, hashes, views)` / `delete`, of `KVStoreClient(target)` "
    "(same host), `KVStoreClient(target, shared_memory=False)` (the bulk path: a `BulkGet` / `BulkPut` on gRPC, "
    "then the bytes on the node's bulk listener, docs/scaleout.md), `KVStoreClient(target, shared_memory=False, "
    "bulk=False)` (gRPC alone) and `kvstore.open_store(StoreConfig())` (embedded); `kvstore serve --memory-capacity "
    "1GiB` as a subprocess.",
    "- Mooncake Store 0.3.13.post1: `batch_get_into` / `batch_put_from` of registered buffers, "
    "`batch_remove(force=True)` after each Put's read-back; a `mooncake_master` per mode (RPC and metrics on "
    "127.0.0.1, P2P handshake, TCP protocol); shared memory: `setup_dummy` against a `mooncake_client` owning a "
    "512 MB segment, buffers from `alloc_from_mem_pool`; local: `setup` with a 512 MB segment of its own (its "
    "Transfer Engine copies with memcpy when the segment is local); TCP: `setup` with no segment, the blocks in a "
    "`mooncake_client`'s.",
    "- LMCache 0.5.6: `LocalCPUBackend` (0.5 GB): `batched_allocate`, a copy into each `MemoryObj`, "
    "`batched_submit_put_task`; `get_blocking` and a copy out. Cache server: `python -m lmcache.v1.server 127.0.0.1 "
    "PORT cpu`, `LMCServerConnector.get` (`recv_into` a `MemoryObj`, then a copy out) and `.put` per block; the "
    "server does not acknowledge PUTs, so the timed Put ends with one `exists` of its last key. The server keeps every "
    "block put (no remove in its client, no evictor).",
    "- Redis: one pipeline of GETs (then `np.copyto` of each reply into the tensor) or SETs (from memoryviews of the "
    "tensor), no transaction; the Put's keys are deleted after its read-back.",
    "- Raw socket: one TCP connection to `benchmarks/peers/rawsock.py`; a Get is a 10-byte request, then `recv_into` "
    "the tensor until full; a Put is `sendall` of the tensor and a one-byte acknowledgement.",
]


def write_payload(path: Path, seed: int) -> None:
    """The bytes every system stores: finite float16 values (a normal sample), the prefix then the block."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as out:
        for numel in (PREFIX_BYTES // 2, (2 << 20) // 2):
            out.write(torch.randn(numel, generator=generator).to(torch.float16).numpy().tobytes())


def start_systems(keys: list[str], services: Services, python: dict[str, str], payload: Path, workdir: Path,
                  node_target: str | None, redis_port: int | None, failed: dict[str, str]) -> dict[str, Worker]:
    """Start each system's servers, then its worker; returns the workers that became ready.

    A system that does not start is left out and named in ``failed`` (``copy_`` and kvstore's raise instead).
    """
    workers: dict[str, Worker] = {}
    specs = {key: (venv, spec) for key, _, venv, spec in SYSTEMS}
    for key in keys:
        try:
            settings = system_settings(key, services, payload, node_target, redis_port)
        except RuntimeError as error:
            failed[key] = f"did not start: {error}"
            continue
        venv, spec = specs["kvstore-shm" if key == "kvstore-shm-2" else key]
        workers[key] = Worker(key, python[venv], spec, payload, settings, workdir, with_checkout=venv == "main")
    for key, worker in list(workers.items()):
        try:
            worker.wait_ready()
        except RuntimeError as error:
            if key == "copy_" or key.startswith("kvstore"):
                raise
            failed[key] = f"did not start: {error}"
            del workers[key]
            worker.close()
            continue
        print(f"bench_peers: {key} ready: {json.dumps(worker.ready)}", file=sys.stderr, flush=True)
    for key, reason in failed.items():
        print(f"bench_peers: {key} left out: {reason}", file=sys.stderr, flush=True)
    return workers


def system_settings(key: str, services: Services, payload: Path, node_target: str | None,
                    redis_port: int | None) -> dict[str, Any]:
    """A system's driver settings, once the servers it needs are up."""
    if key in ("kvstore-shm", "kvstore-grpc", "kvstore-shm-2", "kvstore-bulk"):
        return {"target": node_target, "shared_memory": key not in ("kvstore-grpc", "kvstore-bulk"),
                "bulk": key == "kvstore-bulk", "client": 2 if key == "kvstore-shm-2" else 1}
    if key == "redis":
        return {"port": redis_port}
    if key == "raw-socket":
        return {"port": services.start_rawsock(payload)}
    if key == "lmcache-server":
        return {"port": services.start_lmcache_server()}
    if key.startswith("mooncake-"):
        mode = key.split("-", 1)[1]
        settings = {"mode": mode, "master": services.start_mooncake_master(f"mooncake-master-{mode}")}
        if mode in ("shm", "tcp"):  # a real client owning the segment: the shm mode's server, the TCP mode's far end
            settings["client"] = services.start_mooncake_client(f"mooncake-client-{mode}", settings["master"])
        return settings
    return {}


def run_rounds(workers: dict[str, Worker], rounds: int, rng: random.Random,
               samples: dict[str, dict[str, list[float]]] | None, failed: dict[str, str]) -> None:
    """``rounds`` rounds of every (system, op, kind) in a fresh random order; ms into ``samples`` (``None``: warm-up).

    A system whose worker fails (a wrong answer, an error, an exit) is dropped with its samples and named in
    ``failed``; the others go on.
    """
    keys = [key for key in workers if key != "kvstore-shm-2"]
    items = [(key, op, kind) for key in keys for op in ("get", "put") for kind in KINDS
             if not (key == "copy_" and op == "put")]
    for number in range(rounds):
        rng.shuffle(items)
        for key, op, kind in items:
            if key in failed:
                continue
            try:
                ms = workers[key].call({"cmd": "op", "op": op, "kind": kind})["ms"]
            except RuntimeError as error:
                if key == "copy_":
                    raise
                failed[key] = f"failed in round {number + 1} ({op} {kind}): {error}"
                print(f"bench_peers: {key} dropped: {failed[key]}", file=sys.stderr, flush=True)
                if samples is not None:
                    samples.pop(key, None)
                continue
            if samples is not None:
                samples.setdefault(key, {}).setdefault(f"{op}-{kind}", []).append(ms)
        print(f"bench_peers: round {number + 1}/{rounds}{' (warm-up)' if samples is None else ''}, "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)


def node_cpu_s(pid: int) -> float:
    """``utime + stime`` of process ``pid``, all its threads, seconds (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_phase(workers: dict[str, Worker], node_pid: int, reps: int, gib_per_client: float,
              rng: random.Random) -> dict[str, Any]:
    """The node's CPU per GiB of Gets (same host: 1 and 2 clients; gRPC: 1 client) against ``copy_``'s per GiB.

    Each client runs ``count`` back-to-back ``get_into`` of the prefix (plus a checked one before and after,
    counted in the GiB the node served); runs of each kind take turns in a random order, ``reps`` times.
    """
    count = max(1, round(gib_per_client * GiB / PREFIX_BYTES))
    runs: dict[str, list[dict[str, float]]] = {"one": [], "two": [], "grpc": [], "copy": []}
    if "kvstore-bulk" in workers:
        runs["bulk"] = []
    loop = {"cmd": "loop", "kind": "prefix", "count": count}
    for _ in range(reps):
        kinds = list(runs)
        rng.shuffle(kinds)
        for kind in kinds:
            if kind == "copy":
                runs["copy"].append(workers["copy_"].call({"cmd": "copy_gib"}))
                continue
            clients = {"one": ["kvstore-shm"], "two": ["kvstore-shm", "kvstore-shm-2"], "grpc": ["kvstore-grpc"],
                       "bulk": ["kvstore-bulk"]}[kind]
            before = node_cpu_s(node_pid)
            for key in clients:
                workers[key].send(loop)
            answers = [workers[key].receive() for key in clients]
            cpu_s = node_cpu_s(node_pid) - before
            wall_s = max(a["end"] for a in answers) - min(a["start"] for a in answers)
            runs[kind].append({"cpu_s_per_gib": cpu_s / (len(clients) * (count + 2) * PREFIX_BYTES / GiB),
                               "gib_per_s": len(clients) * count * PREFIX_BYTES / GiB / wall_s})
        print(f"bench_peers: node CPU phase, {len(runs['copy'])}/{reps}", file=sys.stderr, flush=True)
    def median(kind: str, field: str) -> float:
        return statistics.median(run[field] for run in runs[kind])

    copy_cpu = median("copy", "cpu_s_per_gib")
    kinds = [kind for kind in ("one", "two", "grpc", "bulk") if kind in runs]
    figures = {
        "runs": runs, "gets_per_client": count, "copy_cpu_s_per_gib": copy_cpu,
        "node_cpu_s_per_gib": {kind: median(kind, "cpu_s_per_gib") for kind in kinds},
        "node_cpu_x_copy": median("two", "cpu_s_per_gib") / copy_cpu,
        "node_cpu_x_copy_one": median("one", "cpu_s_per_gib") / copy_cpu,
        "node_cpu_x_copy_grpc": median("grpc", "cpu_s_per_gib") / copy_cpu,
        "gib_per_s": {kind: median(kind, "gib_per_s") for kind in kinds},
        "two_vs_one": median("two", "gib_per_s") / median("one", "gib_per_s"),
    }
    if "bulk" in runs:
        figures["node_cpu_x_copy_bulk"] = median("bulk", "cpu_s_per_gib") / copy_cpu
        figures["bulk_x_grpc"] = median("bulk", "cpu_s_per_gib") / median("grpc", "cpu_s_per_gib")
    return figures


def network_note() -> str:
    """Whether this run had a network namespace of its own (only ``lo``), as ``make bench-peers`` arranges."""
    import socket

    if [name for _, name in socket.if_nameindex()] == ["lo"]:  # this process's namespace (sysfs may show the host's)
        return ("a network namespace of its own with loopback only (`unshare --net`): no listener was reachable "
                "from outside")
    return ("the host's network namespace: every listener on 127.0.0.1 except Mooncake's Transfer Engine and P2P "
            "handshake listeners, which bind every interface (0.3.13.post1 has no setting); all traffic on loopback")


def kvstore_commit() -> dict[str, str]:
    """The checkout's HEAD, the last commit that changed ``kvstore/``, and whether ``kvstore/`` has local changes."""
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
            return done.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {"head": git("rev-parse", "--short", "HEAD"),
            "kvstore_last_change": git("log", "-1", "--format=%h", "--", "kvstore"),
            "kvstore_dirty": "yes" if git("status", "--porcelain", "--", "kvstore") else "no"}


def main() -> int:
    """Run the benchmark; write ``<out>.json`` and ``<out>.md``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (20-40 gives stable medians here)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--series", type=int, default=20, help="consecutive Gets of the prefix per system")
    parser.add_argument("--cpu-reps", type=int, default=3, help="repetitions of the node-CPU phase")
    parser.add_argument("--cpu-gib", type=float, default=1.0, help="GiB each client reads per node-CPU run")
    parser.add_argument("--systems", default=",".join(key for key, *_ in SYSTEMS),
                        help="comma-separated subset of: " + ", ".join(key for key, *_ in SYSTEMS))
    parser.add_argument("--serve-args", default="", help="more `kvstore serve` arguments (one string, shell-split)")
    for name, venv in PEER_VENVS.items():
        parser.add_argument(f"--{name}-venv", default=str(venv), help=f"the venv of {name} (make setup-peers)")
    parser.add_argument("--label", default="", help="what this run measures, e.g. 'before: main at 98c8434'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_peers"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()

    keys = [key for key, *_ in SYSTEMS if key in args.systems.split(",")]
    venvs = {name: Path(getattr(args, f"{name}_venv")) for name in PEER_VENVS}
    python = {"main": sys.executable, **{name: str(venv / "bin" / "python") for name, venv in venvs.items()}}
    missing = sorted({venv for key, _, venv, _ in SYSTEMS if key in keys and not Path(python[venv]).exists()})
    if missing:
        print(f"bench_peers: skipped: no {', '.join(str(venvs[m]) for m in missing)}. `make bench-peers` builds the "
              "peers' venvs and runs this benchmark (or pass --systems without them).", file=sys.stderr)
        return 0
    if "copy_" not in keys:
        parser.error("--systems must include copy_, the unit of every figure")

    from tests.support.kvnode import KVNode
    from tests.support.redis import RedisProcess

    rng = random.Random(args.seed)
    load_start = os.getloadavg()
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    payload = workdir / "payload.bin"
    write_payload(payload, args.seed)
    services = Services(workdir, python)
    node = KVNode(memory_capacity="1GiB", metrics=False,
                  extra_args=["--log-level", "WARNING", *shlex.split(args.serve_args)])
    redis_server = RedisProcess(maxmemory_bytes=1 << 30)
    workers: dict[str, Worker] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    series: dict[str, list[float]] = {}
    cpu: dict[str, Any] = {}
    final_info: dict[str, Any] = {}
    failed: dict[str, str] = {}
    try:
        node_target = node.start().target if {"kvstore-shm", "kvstore-grpc", "kvstore-bulk"} & set(keys) else None
        redis_port = redis_server.start().port if "redis" in keys else None
        cpu_phase_on = args.cpu_reps > 0 and {"kvstore-shm", "kvstore-grpc"} <= set(keys)
        workers = start_systems(keys + (["kvstore-shm-2"] if cpu_phase_on else []), services, python, payload,
                                workdir, node_target, redis_port, failed)
        run_rounds(workers, args.warmup, rng, None, failed)
        run_rounds(workers, args.rounds, rng, samples, failed)
        for key in rng.sample(keys, len(keys)):
            if key in workers and key not in failed:
                series[key] = workers[key].call({"cmd": "series", "op": "get", "kind": "prefix",
                                                 "count": args.series})["ms"]
        if cpu_phase_on and not {"kvstore-shm", "kvstore-grpc", "kvstore-shm-2"} & failed.keys():
            cpu = cpu_phase(workers, node.pid, args.cpu_reps, args.cpu_gib, rng)
    finally:
        for key, worker in workers.items():
            final_info[key] = worker.close()
        services.close()
        node.close()
        redis_server.close()
    print(f"bench_peers: logs in {workdir}", file=sys.stderr)

    summary = report.summarize(samples)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_peers.py", *sys.argv[1:]])
    meta = {
        "command": command, "label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "duration_s": round(time.time() - started), "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "rounds": args.rounds, "warmup": args.warmup,
        "kvstore": kvstore_commit(), "network": network_note(), "serve_args": args.serve_args, "failed": failed,
        "versions": {key: w.ready.get("versions", {}) for key, w in workers.items() if w.ready},
        "info": {key: {"ready": w.ready.get("info", {}) if w.ready else {}, "end": final_info.get(key, {})}
                 for key, w in workers.items()},
    }
    result = {"meta": meta, "samples": samples, "summary": summary, "series_ms": series, "cpu": cpu,
              "goals": report.goals(summary, series, cpu)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return 1 if failed else 0


def markdown(result: dict[str, Any]) -> str:
    """The results page: how it ran, the two tables of multiples of ``copy_``, ms, spreads, node CPU, goals."""
    meta, summary, cpu = result["meta"], result["summary"], result["cpu"]
    load = ", ".join(f"{x:.2f}" for x in meta["load_avg_start"])
    load_end = ", ".join(f"{x:.2f}" for x in meta["load_avg_end"])
    commit = meta["kvstore"]
    versions = sorted({f"{name} {version}" for v in meta["versions"].values() for name, version in v.items()})
    same = [(key, LABELS[key]) for key in SAME_HOST]
    across = [(key, LABELS[key]) for key in ACROSS]
    lines = [
        "# bench_peers: kvstore beside Mooncake Store, LMCache and Redis (issues 38 and 40)", "",
        *([f"**{meta['label']}**", ""] if meta["label"] else []),
        f"Command: `{meta['command']}` ({meta['duration_s']} s)", "",
        f"{meta['date']}; {meta['cpus']} CPUs shared with other work (a shared 2-core machine: every figure is a "
        f"ratio to `copy_` timed in the same rounds); load average (1, 5, 15 min) {load} at the start, {load_end} at "
        f"the end. kvstore: checkout {commit['head']}, `kvstore/` last changed in {commit['kvstore_last_change']} "
        f"(local changes: {commit['kvstore_dirty']}); `kvstore serve` arguments: "
        f"`--memory-capacity 1GiB {meta['serve_args']}`. Network: {meta['network']}.", "",
        f"Versions: {', '.join(versions)}; Python {meta['python']}.", "",
        f"{meta['rounds']} rounds after {meta['warmup']} of warm-up; in each, every system's Get and Put of each "
        "payload take turns in a fresh random order, each system in a process of its own that times its calls. "
        "Payloads: a 24 MiB prefix of 96 blocks of 256 KiB (float16 `[8, 2, 4, 16, 128]`) and one 2 MiB block; "
        "Gets land in a tensor the caller allocated before timing (Mooncake's shared-memory mode: from "
        "`alloc_from_mem_pool`; Mooncake's others: registered), every answer is checked (a Get's bytes, a Put read "
        "back). Figures: median time as a multiple of the median `copy_` of the same bytes (lower is better).", "",
        "## Same host", "", *report.ratio_table(summary, same), "",
        "## Across processes, loopback TCP (issue 40)", "", *report.ratio_table(summary, across), "",
        "## Median ms (minimum)", "", *report.ms_table(summary, [(key, LABELS[key]) for key, *_ in SYSTEMS]), "",
    ]
    if result["series_ms"]:
        lines += ["## Consecutive Gets of the 24 MiB prefix", "",
                  "| system | median ms | slowest ms | slowest / median |", "|---|---:|---:|---:|"]
        for key, values in result["series_ms"].items():
            median = statistics.median(values)
            lines.append(f"| {LABELS[key]} | {median:.2f} | {max(values):.2f} | {max(values) / median:.2f} |")
        lines.append("")
    if cpu:
        per = cpu["node_cpu_s_per_gib"]
        lines += [
            "## The node's CPU per GiB of hits", "",
            f"`kvstore serve`'s `utime + stime` over {cpu['gets_per_client']} back-to-back `get_into` of the prefix "
            f"per client, against one single-threaded `copy_` of a GiB ({cpu['copy_cpu_s_per_gib'] * 1e3:.1f} ms of "
            "CPU), medians of the runs:", "",
            "| clients | node CPU s per GiB | × `copy_` per GiB | aggregate GiB/s |", "|---|---:|---:|---:|",
            f"| 1, same host | {per['one']:.3f} | {cpu['node_cpu_x_copy_one']:.2f} | {cpu['gib_per_s']['one']:.2f} |",
            f"| 2, same host | {per['two']:.3f} | {cpu['node_cpu_x_copy']:.2f} | {cpu['gib_per_s']['two']:.2f} |",
            f"| 1, gRPC | {per['grpc']:.3f} | {cpu['node_cpu_x_copy_grpc']:.2f} | {cpu['gib_per_s']['grpc']:.2f} |",
            *([f"| 1, bulk path | {per['bulk']:.3f} | {cpu['node_cpu_x_copy_bulk']:.2f} | "
               f"{cpu['gib_per_s']['bulk']:.2f} |"] if "bulk" in per else []),
            "", f"2 clients / 1: {cpu['two_vs_one']:.2f}× the aggregate throughput (two clients and the node share "
            f"{meta['cpus']} cores here).", ""]
    lines += ["## Goals (issues 38 and 40)", "", *report.goal_lines(result["goals"]), ""]
    if meta["failed"]:
        lines += ["## Left out", "", *[f"- {LABELS.get(key, key)}: {reason.splitlines()[0]}"
                                      for key, reason in meta["failed"].items()], ""]
    shm = meta["info"].get("kvstore-shm", {})
    lines += ["## How each system is called", "", *NOTES,
              f"- kvstore's same-host client reported its shared memory as {shm.get('ready', {}).get('shared_memory')} "
              f"after its set-up and {shm.get('end', {}).get('shared_memory')} at the end.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
