"""A bounded soak: several nodes over one Redis, honest and hostile clients, and faults on a schedule.

What a day in production does to a node, compressed into ``--minutes`` (default 10) on this machine, over
loopback only:

* ``--nodes`` ``kvstore serve`` nodes (default 3), each with a memory tier, an LMDB disk tier and the shared
  Redis tier, a tenant quota, and the same-host data plane;
* ``--workers`` honest clients (default 4), half over shared memory and half over gRPC, each a tenant of its
  own, replaying the bundled Mooncake conversation trace (``kvstore/data/traces``) as a connector would: look
  up the request's prefix, get what is cached, put the rest; block sizes of 16 KiB, 256 KiB and 1 MiB mixed.
  Every block's bytes follow from its hash, so every byte returned is checked against what was put;
* one hostile client: stalled Gets on one connection, Lookups with 4 MB namespaces, malformed messages, a
  greedy tenant that puts until its quota refuses it, and the attackers of issue 39: a control-channel slowloris
  (half-frames on 32 channels), a flood of idle handoff connections, a replay hog (event-replay peers that
  ask again and again and never read; each node publishes its KV events) and a poisoned-scale writer (int8_v2
  blocks whose scales are NaN, Inf, huge or negative, checksums valid, over gRPC and shared memory; then a
  read of what it put, which must find nothing and decode no non-finite value);
* faults at fixed fractions of the run: Redis killed (SIGKILL) and restarted, one node stopped (SIGTERM) and
  restarted, another killed (SIGKILL) and restarted, then the same node on a full disk (writes past its data
  file's size fail with EFBIG, ``RLIMIT_FSIZE``) and with a corrupted LMDB leaf page. Node 0 is never
  touched: its RSS, open files and shared-memory segments are the flatness measure.

Reported (``benchmarks/results/soak.{json,md,png}``): wrong bytes (goal 0); honest clients' errors by code
and the hostile client's; refused puts that had room (an honest put refused RESOURCE_EXHAUSTED outside the
full-disk window, goal 0); RSS, open files and segments over time, and node 0's last fifth against its level
after warm-up (goal: within 5%); p50 and p99 latency per operation and data path.

Usage::

    python benchmarks/soak.py [--minutes 10] [--nodes 3] [--workers 4]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
SHAPES = {  # [num_layers, 2, num_kv_heads, block_size, head_dim] of float16: 16 KiB, 256 KiB, 1 MiB a block
    "small": (2, 2, 2, 16, 64), "medium": (8, 2, 8, 16, 64), "large": (8, 2, 8, 16, 256)}
MAX_BLOCKS_PER_REQUEST = {"small": 32, "medium": 12, "large": 4}
FAULTS = [  # (fraction of the run, what)
    (0.12, "redis SIGKILL"), (0.18, "redis restart"),
    (0.28, "node 1 SIGTERM"), (0.32, "node 1 restart"),
    (0.42, "node 2 SIGKILL"), (0.46, "node 2 restart"),
    (0.56, "node 2 full disk"), (0.66, "node 2 disk freed"),
    (0.76, "node 2 corrupt page"),
]


def block_tensor(block_hash: bytes, shape: tuple[int, ...]) -> Any:
    """The block a hash stands for: its bytes repeat the hash, so any reader can check them."""
    import torch

    nbytes = int(np.prod(shape)) * 2
    raw = np.frombuffer((block_hash * (nbytes // len(block_hash) + 1))[:nbytes], dtype=np.float16)
    return torch.from_numpy(raw.copy()).reshape(shape)


@dataclass
class Tally:
    """Everything the clients saw, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    hostile: collections.Counter[str] = field(default_factory=collections.Counter)
    wrong_blocks: int = 0
    checked_blocks: int = 0
    checked_bytes: int = 0
    refused_with_room: int = 0
    refused_disk_full: int = 0
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)  # "op: reason" -> calls
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    messages: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))

    def op(self, name: str, seconds: float) -> None:
        with self.lock:
            self.latencies_ms[name].append(seconds * 1e3)
            self.ops[name] += 1

    def error(self, name: str, exc: BaseException) -> str:
        from kvstore.error_codes import status_of

        code = status_of(exc)[0].name if isinstance(exc, Exception) else type(exc).__name__
        with self.lock:
            self.errors[f"{name} {code}"] += 1
            if len(self.messages[f"{name} {code}"]) < 3:  # a few of each, to tell the causes apart
                self.messages[f"{name} {code}"].append(str(exc)[:300])
        return code


class Worker(threading.Thread):
    """An honest client: one tenant, one block size, one data path, replaying its slice of the trace."""

    def __init__(self, index: int, targets: list[str], trace: list[list[int]], tally: Tally, stop: threading.Event,
                 disk_full: threading.Event) -> None:
        super().__init__(name=f"soak-worker-{index}", daemon=True)
        from kvstore.keys import Namespace

        self.size = ("small", "medium", "large")[index % 3]
        self.shape = SHAPES[self.size]
        self.shared_memory = index % 2 == 0
        self.path = "shm" if self.shared_memory else "grpc"
        self.namespace = Namespace(model=f"soak-{self.size}", cache_salt=f"tenant-{index}", block_size=16)
        self.targets, self.trace, self.tally, self.stop, self.disk_full = targets, trace, tally, stop, disk_full
        self.rng = random.Random(index)

    def run(self) -> None:
        from kvstore.client import KVStoreClient
        from kvstore.blocks.tensors import encode_block
        from kvstore.errors import ResourceExhaustedError
        from kvstore.keys import hash_blocks

        tally, ns = self.tally, self.namespace
        with KVStoreClient(targets=self.targets, timeout_s=20, retries=3, backoff_s=0.1,
                           shared_memory=self.shared_memory) as client:
            while not self.stop.is_set():
                ids = self.rng.choice(self.trace)[:MAX_BLOCKS_PER_REQUEST[self.size]]
                hashes = hash_blocks(ns, [t for i in ids for t in range(i * 16, i * 16 + 16)])
                op = "lookup"
                try:
                    started = time.perf_counter()
                    found = client.lookup(ns, hashes).num_blocks
                    tally.op(f"lookup/{self.path}", time.perf_counter() - started)
                    got: list[Any] = []
                    if found:
                        op = "get"
                        started = time.perf_counter()
                        got = list(client.get(ns, hashes[:found]))
                        tally.op(f"get/{self.path}", time.perf_counter() - started)
                        for block_hash, block in zip(hashes, got):  # a shorter prefix is allowed, a wrong byte not
                            expected = encode_block(block_tensor(block_hash, self.shape))
                            with tally.lock:
                                tally.checked_blocks += 1
                                tally.checked_bytes += len(expected)
                                tally.wrong_blocks += bytes(block) != expected
                    missing = hashes[len(got):]
                    if missing:
                        op = "put"
                        started = time.perf_counter()
                        client.put(ns, missing, [block_tensor(h, self.shape) for h in missing])
                        tally.op(f"put/{self.path}", time.perf_counter() - started)
                except ResourceExhaustedError as exc:
                    tally.error(f"{op}/{self.path}", exc)
                    with tally.lock:
                        tally.refusals[f"{op}: {refusal_reason(exc)}"] += 1
                        if op != "put":
                            pass  # not a refused put (e.g. a Get past a limit): counted by code only
                        elif self.disk_full.is_set():
                            tally.refused_disk_full += 1
                        else:
                            tally.refused_with_room += 1
                except Exception as exc:  # noqa: BLE001 - counted by code; the soak goes on
                    tally.error(f"{op}/{self.path}", exc)
                    self.stop.wait(0.2)


class Hostile(threading.Thread):
    """Stalled readers, 4 MB namespaces, malformed messages and a greedy tenant, in turn, against random nodes."""

    def __init__(self, nodes: list[Any], tally: Tally, stop: threading.Event) -> None:
        super().__init__(name="soak-hostile", daemon=True)
        self.nodes, self.tally, self.stop = nodes, tally, stop
        self.rng = random.Random(99)

    def run(self) -> None:
        import grpc

        from kvstore.client import KVStoreClient
        from kvstore.keys import Namespace, hash_blocks
        from tests.support.hostile import Attacks

        reader_ns = Namespace(model="soak-hostile-reader", cache_salt="hostile")
        greedy_ns = Namespace(model="soak-greedy", cache_salt="greedy")
        shape = SHAPES["large"]
        reader_hashes = hash_blocks(reader_ns, list(range(8 * 16)))
        round_index = 0
        while not self.stop.wait(2.0):
            node = self.rng.choice([n for n in self.nodes if n.is_running] or self.nodes)
            try:
                kind = round_index % 8
                round_index += 1
                if kind == 0:
                    with KVStoreClient(node.target, timeout_s=20, retries=0, shared_memory=False) as kv:
                        kv.put(reader_ns, reader_hashes, [block_tensor(h, shape) for h in reader_hashes])
                    figures = Attacks(node.target, node.pid).stalled_readers(reader_ns, reader_hashes, 64, hold_s=1.0)
                    self._count("stalled Get", figures.codes)
                elif kind == 1:
                    self._count("4 MB namespace Lookup", Attacks(node.target, node.pid, threads=2)
                                .oversized_namespaces(8).codes)
                elif kind == 2:
                    channel = grpc.insecure_channel(node.target)
                    for method in ("Get", "Lookup", "Put"):
                        garbage = self.rng.randbytes(self.rng.randrange(1, 4096))
                        try:
                            if method == "Put":
                                channel.stream_unary(f"/kvstore.v1.KVStore/{method}")(iter([garbage]), timeout=10)
                            else:
                                channel.unary_unary(f"/kvstore.v1.KVStore/{method}")(garbage, timeout=10)
                            self._count("malformed message", {"OK": 1})
                        except grpc.RpcError as exc:
                            self._count("malformed message", {exc.code().name: 1})
                    channel.close()
                elif kind == 4:
                    from tests.support.plane_attacks import control_slowloris

                    self._count("control-channel half-frames", control_slowloris(node.target))
                elif kind == 5:
                    from tests.support.plane_attacks import HandoffFlood

                    with HandoffFlood(node.target) as flood:
                        self.stop.wait(3.0)  # honest same-host clients attach while it holds its connections
                    self._count("idle handoff connections", {"opened": flood.opened})
                elif kind == 6:
                    from tests.support.replay_hog import ReplayHog

                    replay = node.env["KVSTORE_EVENTS__REPLAY_ENDPOINT"]
                    self._count("replay hog", ReplayHog(replay, peers=4, requests_per_peer=50)
                                .attack_for(node.pid, 2.0).codes)
                elif kind == 7:
                    self._poisoned_scales(node)
                else:
                    with KVStoreClient(node.target, timeout_s=20, retries=0, shared_memory=False) as kv:
                        for _ in range(200):  # fresh blocks until the quota refuses one (it holds at most its quota)
                            hashes = hash_blocks(greedy_ns, [self.rng.randrange(1 << 30) for _ in range(16)])
                            try:
                                kv.put(greedy_ns, hashes, [block_tensor(hashes[0], shape)])
                                self._count("greedy tenant Put", {"OK": 1})
                            except Exception as exc:  # noqa: BLE001
                                self._count("greedy tenant Put", {self.tally.error("hostile", exc).split()[-1]: 1})
                                break
            except Exception as exc:  # noqa: BLE001 - a node down under a fault: next round
                self._count("attack failed to start", {type(exc).__name__: 1})

    def _poisoned_scales(self, node: Any) -> None:
        """Put int8_v2 blocks with poisoned scales (valid checksums) both ways; read them back: nothing, or finite."""
        import torch

        from kvstore.client import KVStoreClient
        from kvstore.blocks.encoding import Encoding
        from kvstore.keys import Namespace, hash_blocks
        from tests.support.poison import POISONS, poisoned, random_blocks

        ns = Namespace(model="soak-poison", dtype="bfloat16", block_size=16, kv_encoding="int8_v2",
                       cache_salt="poison")
        for shared in (False, True):
            with KVStoreClient(node.target, timeout_s=20, retries=0, shared_memory=shared) as kv:
                for name, value in POISONS.items():
                    hashes = hash_blocks(ns, [self.rng.randrange(1 << 30) for _ in range(16)])
                    block = bytes(poisoned(Encoding.INT8_V2, value, random_blocks(1, seed=len(name))[0]))
                    try:
                        kv.put(ns, hashes, [block])
                        self._count("poisoned scales Put", {"OK": 1})
                    except Exception as exc:  # noqa: BLE001
                        self._count("poisoned scales Put", {self.tally.error("hostile", exc).split()[-1]: 1})
                    for tensor in kv.get_tensors(ns, hashes):
                        finite = bool(torch.isfinite(tensor.float()).all())
                        self._count("poisoned scales read back", {"finite" if finite else "NON-FINITE": 1})
                        if not finite:
                            with self.tally.lock:
                                self.tally.wrong_blocks += 1

    def _count(self, what: str, codes: dict[str, int]) -> None:
        with self.tally.lock:
            for code, num in codes.items():
                self.tally.hostile[f"{what}: {code}"] += num


def refusal_reason(exc: BaseException) -> str:
    """A RESOURCE_EXHAUSTED message with its numbers taken out, so refusals of one cause count together."""
    import re

    return re.sub(r"\d[\d.,]*", "N", str(exc).split(";")[0])[:120]


def process_figures(pid: int | None) -> tuple[float, float, int, int]:
    """RSS and its anonymous part (heap, not LMDB's mapped file or shared memory), MiB, open descriptors, and
    same-host segments of a process (0s when it is down)."""
    if pid is None:
        return 0.0, 0.0, 0, 0
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = {line.split(":")[0]: line.split()[1] for line in status if line.startswith(("VmRSS:", "RssAnon:"))}
        rss, anon = int(fields["VmRSS"]) / 1024, int(fields["RssAnon"]) / 1024
        fds = os.listdir(f"/proc/{pid}/fd")
        segments = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("/memfd:kvstore-"):
                segments.add(link.split()[0])
        return rss, anon, len(fds), len(segments)
    except (OSError, KeyError):
        return 0.0, 0.0, 0, 0


def corrupt_a_leaf(data_file: Path, rng: random.Random) -> str:
    """Overwrite the middle of one leaf page of the blocks tree with random bytes; what was done."""
    from tests.support.lmdb_pages import page_map

    pages = page_map(data_file)
    leaves = pages.leaf_pages(b"blocks")
    page = rng.choice(leaves)
    with open(data_file, "r+b") as f:
        f.seek(page * pages.page_bytes + pages.page_bytes // 4)
        f.write(rng.randbytes(pages.page_bytes // 2))
    return f"page {page} of {len(leaves)} leaves"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=2.0, help="seconds between samples of the nodes")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "soak"))
    args = parser.parse_args()
    if args.nodes < 3:
        parser.error("--nodes must be >= 3 (node 0 is the control, nodes 1 and 2 take the faults)")

    from kvstore.data import bundled_trace
    from tests.support.kvnode import KVNode
    from tests.support.redis import RedisProcess

    trace = [json.loads(line)["hash_ids"] for line in bundled_trace().read_text().splitlines()[:4000]]
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    redis = RedisProcess(maxmemory_bytes=256 * MiB).start()
    env = {"KVSTORE_LIMITS__TENANT_QUOTA_BYTES": "160MiB", "KVSTORE_STORE__MAX_BLOCK_BYTES": "4MiB"}
    from tests.support.process import free_port

    def events_env() -> dict[str, str]:  # each node publishes its KV events, with a replay socket (the replay hog's)
        return {"KVSTORE_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
                "KVSTORE_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"}

    nodes = [KVNode(memory_capacity="32MiB", disk_path=workdir / f"node{i}", disk_capacity="192MiB",
                    redis_url=redis.url, env={**env, **events_env()}, workdir=workdir / f"run{i}")
             for i in range(args.nodes)]
    for node in nodes:
        (workdir / f"run{nodes.index(node)}").mkdir(exist_ok=True)
        node.start()
    targets = [node.target for node in nodes]
    tally, stop, disk_full = Tally(), threading.Event(), threading.Event()
    workers = [Worker(i, targets, trace, tally, stop, disk_full) for i in range(args.workers)]
    hostile = Hostile(nodes, tally, stop)
    samples: list[dict[str, Any]] = []
    faults_done: list[dict[str, Any]] = []
    duration_s = args.minutes * 60
    started = time.monotonic()
    rng = random.Random(7)

    def fault(what: str) -> str:
        node2 = nodes[2]
        if what == "redis SIGKILL":
            redis.kill()
        elif what == "redis restart":
            redis.start()
        elif what == "node 1 SIGTERM":
            nodes[1].stop()
        elif what == "node 1 restart":
            nodes[1].start()
        elif what == "node 2 SIGKILL":
            node2.kill()
        elif what == "node 2 restart":
            node2.start()
        elif what == "node 2 full disk":
            node2.stop()
            size = (workdir / "node2" / "data.mdb").stat().st_size
            node2.file_size_limit_bytes = size  # the file cannot grow: the disk is full
            node2.start()
            disk_full.set()
            return f"data.mdb held at {size / MiB:.1f} MiB"
        elif what == "node 2 disk freed":
            node2.stop()
            node2.file_size_limit_bytes = None
            node2.start()
            disk_full.clear()
        elif what == "node 2 corrupt page":
            node2.stop()
            done = corrupt_a_leaf(workdir / "node2" / "data.mdb", rng)
            node2.start()
            return done
        return ""

    try:
        for thread in [*workers, hostile]:
            thread.start()
        pending = list(FAULTS)
        next_sample = 0.0
        while (elapsed := time.monotonic() - started) < duration_s:
            if elapsed >= next_sample:
                row: dict[str, Any] = {"t_s": round(elapsed, 1)}
                for i, node in enumerate(nodes):
                    rss, anon, fds, segments = process_figures(node.pid if node.is_running else None)
                    row[f"node{i}"] = {"rss_mib": round(rss, 1), "rss_anon_mib": round(anon, 1), "open_files": fds,
                                       "segments": segments}
                with tally.lock:
                    row["ops"] = sum(tally.ops.values())
                samples.append(row)
                next_sample += args.sample_s
            if pending and elapsed >= pending[0][0] * duration_s:
                _, what = pending.pop(0)
                t0 = time.monotonic()
                try:
                    detail = fault(what)
                except Exception as exc:  # noqa: BLE001 - recorded; the soak goes on
                    detail = f"FAILED: {exc!r}"[:300]
                faults_done.append({"t_s": round(elapsed, 1), "fault": what, "took_s": round(time.monotonic() - t0, 1),
                                    "detail": detail})
                print(json.dumps(faults_done[-1]), flush=True)
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in [*workers, hostile]:
            thread.join(60)
        for node in nodes:
            node.close()
        redis.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, tally, samples, faults_done, load_before, duration_s)


def flatness(samples: list[dict[str, Any]], metric: str, node: str = "node0") -> dict[str, float]:
    """Node 0's ``metric``: mean over 25-40% of the run (after warm-up) and over the last fifth, and their ratio."""
    n = len(samples)
    warm = [s[node][metric] for s in samples[n * 25 // 100:n * 40 // 100]]
    last = [s[node][metric] for s in samples[n * 80 // 100:]]
    warm_mean, last_mean = float(np.mean(warm)) if warm else 0.0, float(np.mean(last)) if last else 0.0
    return {"after_warmup": round(warm_mean, 1), "last_fifth": round(last_mean, 1),
            "ratio": round(last_mean / warm_mean, 4) if warm_mean else float("nan")}


def report(args: argparse.Namespace, tally: Tally, samples: list[dict[str, Any]], faults: list[dict[str, Any]],
           load_before: tuple[float, float, float], duration_s: float) -> None:
    """Write ``soak.json``, ``soak.md`` and ``soak.png``."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    latency = {op: {"n": len(v), "p50_ms": round(percentile(v, 50), 2), "p99_ms": round(percentile(v, 99), 2)}
               for op, v in sorted(tally.latencies_ms.items())}
    flat = {metric: flatness(samples, metric) for metric in ("rss_mib", "rss_anon_mib", "open_files", "segments")}
    meta = {"command": command, "minutes": args.minutes, "nodes": args.nodes, "workers": args.workers,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    result = {"meta": meta, "wrong_blocks": tally.wrong_blocks, "checked_blocks": tally.checked_blocks,
              "checked_bytes": tally.checked_bytes, "refused_with_room": tally.refused_with_room,
              "refused_disk_full": tally.refused_disk_full, "errors": dict(tally.errors),
              "hostile": dict(tally.hostile), "ops": dict(tally.ops), "latency": latency, "faults": faults,
              "error_messages": dict(tally.messages), "refusals": dict(tally.refusals),
              "node0_flatness": flat, "samples": samples}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    goal = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    lines = [
        "# Soak: nodes over one Redis, honest and hostile clients, faults on a schedule",
        "",
        f"Command: `{command}` ({meta['cpus']} CPUs shared with other jobs, Python "
        f"{meta['python']}, load average {meta['load_average_before'][0]} before, {meta['load_average_after'][0]} "
        f"after). {args.nodes} nodes (32 MiB memory, 192 MiB LMDB, one Redis of 256 MiB maxmemory, a 160 MiB "
        f"tenant quota), {args.workers} honest clients (even ones over shared memory, odd over gRPC), one hostile; "
        f"{duration_s / 60:g} minutes.",
        "",
        "| goal | measured | |",
        "|---|---|---|",
        f"| wrong bytes: 0 | {tally.wrong_blocks} wrong blocks of {tally.checked_blocks} checked "
        f"({tally.checked_bytes / MiB:.0f} MiB) | {goal(tally.wrong_blocks == 0)} |",
        f"| refused puts that had room: 0 | {tally.refused_with_room} (and {tally.refused_disk_full} while node 2's "
        f"disk was full) | {goal(tally.refused_with_room == 0)} |",
        *[f"| node 0 {metric} flat after warm-up, within 5% | {v['after_warmup']} → {v['last_fifth']} "
          f"({v['ratio']}x) | {goal(abs(v['ratio'] - 1) <= 0.05)} |" for metric, v in flat.items()],
        "",
        "Honest clients' RESOURCE_EXHAUSTED by operation and reason (numbers taken out):",
        "",
        "| operation: reason | calls |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(tally.refusals.items())],
        "",
        "Honest clients' errors by code (retries are the client's own; each counts once, after them):",
        "",
        "| operation/path, code | calls |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(tally.errors.items()) if not k.startswith("hostile")],
        "",
        "The hostile client's calls by code:",
        "",
        "| attack: code | calls |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(tally.hostile.items())],
        "",
        "Latency per operation and data path (every call, faults included):",
        "",
        "| operation | calls | p50 (ms) | p99 (ms) |",
        "|---|---:|---:|---:|",
        *[f"| {op} | {v['n']} | {v['p50_ms']} | {v['p99_ms']} |" for op, v in latency.items()],
        "",
        "Faults:",
        "",
        "| at (s) | fault | took (s) | detail |",
        "|---:|---|---:|---|",
        *[f"| {f['t_s']} | {f['fault']} | {f['took_s']} | {f['detail']} |" for f in faults],
        "",
        f"RSS, open files and same-host segments of every node over time: `{out.name}.png`.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(samples, faults, args.nodes, out.with_suffix(".png"))


def plot(samples: list[dict[str, Any]], faults: list[dict[str, Any]], num_nodes: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    times = [s["t_s"] for s in samples]
    for ax, (metric, label) in zip(axes, [("rss_mib", "RSS (MiB)"), ("open_files", "open files"),
                                          ("segments", "shm segments")]):
        for i in range(num_nodes):
            ax.plot(times, [s[f"node{i}"][metric] for s in samples], label=f"node {i}", linewidth=1)
        for f in faults:
            ax.axvline(f["t_s"], color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylabel(label)
    axes[0].legend(loc="upper left")
    axes[0].set_title("soak: nodes over time (dotted: faults; node 0 never faulted)")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
