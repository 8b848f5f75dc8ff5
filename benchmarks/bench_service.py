"""The gRPC service's Get/Put throughput and Lookup latency, as ratios to a raw gRPC echo and to redis-py.

Three servers run as separate processes on loopback, each measured from this
process with a synchronous client, one call at a time:

* the service: a real ``kvstore serve`` node (memory tier) through :class:`KVStoreClient`;
* a raw gRPC echo: a minimal ``grpc.aio`` server with bytes in and out (no
  protobuf), the same ``max_message_bytes`` and the same chunking: Get streams
  a stored ``bytes`` object in chunks, Put streams chunks in and joins them,
  Empty answers an empty message; it tunes malloc as ``kvstore serve`` does
  (``kvstore.server.process.tune_malloc``), so both servers allocate alike. The
  goal is against its plain Get, a streaming handler whose status is a batch
  of its own; ``GetLast`` sends the last chunk with the status, as the node's
  Get does (``KVStoreServicer.add_to_server``). A second pass of the same six
  ops, with ``GetLast`` in place of the echo's Get, gives ``get_vs_echo_last``,
  so the two ways of sending can be told apart (a seventh op in the first pass
  would change what the others are measured against: each server's code is
  warmer the more of the calls it serves);
* Redis: a local ``redis-server`` through redis-py with hiredis (GET and SET).

This process, the client of all three, tunes malloc the same way: without it,
every 2 MiB reply is a fresh ``mmap`` whose page faults depend on the
allocation history of the process, and the echo's own Get swung between 0.3
and 0.55 GB/s from run to run.

Throughput is GB/s (1e9 bytes per second) of encoded block bytes, one block
per call: the ops of one block size (service Get, echo Get, Redis GET,
service Put, echo Put, Redis SET) take turns in bursts of ``--burst``
consecutive calls (1 by default: strict turns), so each sees the same
background load, each round in a fresh random order (see
:func:`interleaved_ms`), and the figure comes from the median burst of ``max(--min-rounds, --run-bytes /
size)`` calls in all. Lookup latency is measured the same way over
``--lookups`` calls naming 1, 64 or 1,024 cached hashes, beside empty calls to
the echo server. A separate pass then runs each op back to back (a quarter as
many calls; as many for Lookup) and reports the CPU time per call of its server
process and of this one, which usually varies less than wall time on a busy host.

Goals: Get >= 0.9x the raw gRPC echo; Lookup(1,024) <= 1.5x an empty call.

Usage::

    python benchmarks/bench_service.py [--sizes 262144,2097152,16777216] [--run-bytes 268435456] [--lookups 500]
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
MAX_MESSAGE_BYTES = 4 * MiB
ECHO_SERVICE = "bench.Echo"



# ---------------------------------------------------------------------- the raw echo server


def run_echo_server(max_message_bytes: int) -> None:
    """Serve ``bench.Echo`` (Get, Put, Empty) on a free loopback port; prints the port, runs until killed."""
    import grpc

    from kvstore.server.process import tune_malloc
    from kvstore.wire import channel_options, chunk_bytes_for

    tune_malloc()  # as `kvstore serve` does, so that both servers allocate alike
    chunk_bytes = chunk_bytes_for(max_message_bytes)
    stored: dict[int, bytes] = {}

    def payload(size: int) -> bytes:
        if size not in stored:
            stored[size] = os.urandom(size)
        return stored[size]

    async def get(request: bytes, context: grpc.aio.ServicerContext) -> None:
        block = payload(int.from_bytes(request, "little"))
        total = len(block)
        if total <= chunk_bytes:
            await context.write(block)
            return
        for offset in range(0, total, chunk_bytes):
            await context.write(block[offset: offset + chunk_bytes])

    async def get_last(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Get, with its last chunk sent with the status in one batch (a unary handler), as the node's Get does."""
        block = payload(int.from_bytes(request, "little"))
        total = len(block)
        if total <= chunk_bytes:
            return block
        offsets = range(0, total, chunk_bytes)
        for offset in offsets[:-1]:
            await context.write(block[offset: offset + chunk_bytes])
        return block[offsets[-1]:]

    async def put(request_iterator, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[no-untyped-def]
        parts = [chunk async for chunk in request_iterator]
        block = parts[0] if len(parts) == 1 else b"".join(parts)
        return len(block).to_bytes(8, "little")

    async def empty(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b""

    async def main() -> None:
        server = grpc.aio.server(options=channel_options(max_message_bytes))
        handlers = {
            "Get": grpc.unary_stream_rpc_method_handler(get),
            "GetLast": grpc.unary_unary_rpc_method_handler(get_last),
            "Put": grpc.stream_unary_rpc_method_handler(put),
            "Empty": grpc.unary_unary_rpc_method_handler(empty),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO_SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


class EchoClient:
    """The raw gRPC client of :func:`run_echo_server`, chunking and joining like :class:`KVStoreClient`."""

    def __init__(self, target: str, max_message_bytes: int) -> None:
        import grpc

        from kvstore.wire import chunk_bytes_for, sync_client_channel_options

        # the same channel options as KVStoreClient's, so that the two clients differ only in kvstore's own work
        self._channel = grpc.insecure_channel(target, options=sync_client_channel_options(max_message_bytes))
        self._get = self._channel.unary_stream(f"/{ECHO_SERVICE}/Get")
        self._get_last = self._channel.unary_stream(f"/{ECHO_SERVICE}/GetLast")  # a stream to the client, too
        self._put = self._channel.stream_unary(f"/{ECHO_SERVICE}/Put")
        self._empty = self._channel.unary_unary(f"/{ECHO_SERVICE}/Empty")
        self._chunk_bytes = chunk_bytes_for(max_message_bytes)

    def get(self, size: int) -> bytes:
        parts = list(self._get(size.to_bytes(8, "little"), timeout=60))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def get_last(self, size: int) -> bytes:
        parts = list(self._get_last(size.to_bytes(8, "little"), timeout=60))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def put(self, block: bytes) -> int:
        chunk = self._chunk_bytes
        chunks = [block] if len(block) <= chunk else [block[o: o + chunk] for o in range(0, len(block), chunk)]
        return int.from_bytes(self._put(iter(chunks), timeout=60), "little")

    def empty(self) -> None:
        self._empty(b"", timeout=60)

    def close(self) -> None:
        self._channel.close()


# ---------------------------------------------------------------------- measuring


def process_cpu_s(pid: int) -> float | None:
    """CPU time the live threads of process ``pid`` have used so far, seconds; ``None`` without Linux's ``/proc``.

    Sums each thread's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU,
    ``Documentation/scheduler/sched-stats.rst``) rather than ``/proc/<pid>/stat``,
    whose 10 ms ticks are coarser than a call. A thread that exits takes its time
    with it; the servers' threads (gRPC pollers, executors) live as long as they do.
    """
    total_ns = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total_ns += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total_ns / 1e9


def interleaved_ms(ops: dict[str, Callable[[], object]], num_calls: int, burst: int,
                   seed: int = 0) -> dict[str, float]:
    """Milliseconds per call of each op: the median over bursts of ``burst`` back-to-back calls, ops taking turns.

    Every op runs ``max(1, num_calls // burst)`` bursts. Taking turns makes every
    op see the same background load, so ratios stay meaningful on a busy machine.
    Each round takes the ops in a fresh random order (seeded): with a fixed
    order, the op that follows another server's call pays for that server's
    clean-up on the shared CPUs, and the service's 256 KiB Get read 0.76x the
    echo when it followed a Redis SET but 0.85x when it followed the echo.
    """
    for op in ops.values():  # warm up
        op()
    samples: dict[str, list[float]] = {name: [] for name in ops}
    order = list(ops.items())
    rng = random.Random(seed)
    for _ in range(max(1, num_calls // burst)):
        rng.shuffle(order)
        for name, op in order:
            start = time.perf_counter()
            for _ in range(burst):
                op()
            samples[name].append((time.perf_counter() - start) / burst)
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def cpu_ms(ops: dict[str, Callable[[], object]], num_calls: int,
           server_pids: dict[str, int]) -> dict[str, tuple[float | None, float]]:
    """CPU milliseconds per call of each op, ``(server, client)``, over ``num_calls`` back-to-back calls.

    A separate pass from :func:`interleaved_ms`, so that reading ``/proc`` never
    lands between timed calls. CPU time is steadier than wall time on a busy
    host: what a server spends per call is what it adds to every call.

    Args:
        ops: name -> one call.
        num_calls: calls of each op.
        server_pids: name -> pid of the process that serves that op.

    Returns:
        name -> (the server's CPU ms per call, or ``None`` without ``/proc``; this process's CPU ms per call).
    """
    result: dict[str, tuple[float | None, float]] = {}
    for name, op in ops.items():
        op()
        server_start = process_cpu_s(server_pids[name])
        client_start = time.process_time()
        for _ in range(num_calls):
            op()
        client_s = time.process_time() - client_start
        server_end = process_cpu_s(server_pids[name])
        server_s = None if server_start is None or server_end is None else server_end - server_start
        result[name] = (None if server_s is None else server_s * 1e3 / num_calls, client_s * 1e3 / num_calls)
    return result


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=f"{256 * 1024},{2 * MiB},{16 * MiB}", help="block sizes, bytes")
    parser.add_argument("--run-bytes", type=int, default=256 * MiB, help="bytes each op moves per block size")
    parser.add_argument("--min-rounds", type=int, default=30, help="fewest calls of each op per block size")
    parser.add_argument("--lookups", type=int, default=500, help="calls per latency cell")
    parser.add_argument("--burst", type=int, default=1, help="back-to-back calls of one op before the next op's turn")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_service"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()
    if args.echo_server:
        run_echo_server(MAX_MESSAGE_BYTES)
        return 0

    import redis
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.blocks.tensors import encode_block
    from kvstore.keys import Namespace
    from tests.support.kvnode import KVNode
    from tests.support.redis import RedisProcess

    from kvstore.server.process import tune_malloc

    tune_malloc()  # the clients' process allocates like the servers (see the module docstring)
    sizes = [int(s) for s in args.sizes.split(",")]
    ns = Namespace(model="bench", dtype="uint8", layout="mla", block_size=1)

    def block_of(size: int) -> bytes:  # an encoded block of exactly `size` bytes (64-byte header)
        return encode_block(torch.randint(0, 256, (1, 1, 1, size - 64), dtype=torch.uint8), "mla")

    def key(size: int, i: int) -> bytes:
        return (size * 1_000_003 + i).to_bytes(16, "little")

    echo_proc = subprocess.Popen([sys.executable, __file__, "--echo-server"], stdout=subprocess.PIPE, cwd=REPO_ROOT)
    node = KVNode(memory_capacity="1GiB", metrics=False, extra_args=["--log-level", "WARNING"])
    redis_server = RedisProcess(maxmemory_bytes=1 << 30)
    rows: list[dict[str, object]] = []
    try:
        echo_port = int(echo_proc.stdout.readline())  # type: ignore[union-attr]
        node.start()
        redis_server.start()
        echo = EchoClient(f"127.0.0.1:{echo_port}", MAX_MESSAGE_BYTES)
        kv = KVStoreClient(node.target, max_message_bytes=MAX_MESSAGE_BYTES, timeout_s=120,
                           shared_memory=False)  # the gRPC path: bench_shm measures the same-host one
        rds = redis.Redis(host=redis_server.host, port=redis_server.port, socket_timeout=60)
        assert redis.utils.HIREDIS_AVAILABLE, "hiredis is not installed"

        server_pids = {f"{server}_{op}": pid for op in ("get", "put")
                       for server, pid in (("service", node.pid), ("echo", echo_proc.pid), ("redis", redis_server.pid))}
        counter = iter(range(1 << 40))
        for size in sizes:
            block = block_of(size)
            assert len(block) == size
            kv.put(ns, [key(size, -2)], [block])
            rds.set(b"get-%d" % size, block)
            assert kv.get(ns, [key(size, -2)]) == [block] and rds.get(b"get-%d" % size) == block
            ops: dict[str, Callable[[], object]] = {
                "service_get": lambda: kv.get(ns, [key(size, -2)]),
                "echo_get": lambda: echo.get(size),
                "redis_get": lambda: rds.get(b"get-%d" % size),
                "service_put": lambda: kv.put(ns, [key(size, next(counter))], [block]),  # a new key each time
                "echo_put": lambda: echo.put(block),
                "redis_put": lambda: rds.set(b"put-%d" % size, block),
            }
            num_calls = max(args.min_rounds, args.run_bytes // size)
            ms = interleaved_ms(ops, num_calls, args.burst)
            cpu = cpu_ms(ops, max(1, num_calls // 4), server_pids)
            # a second pass of the same six ops, with the echo's Get sending its last chunk with the status
            kv.clear(ns)
            kv.put(ns, [key(size, -2)], [block])
            last_ops = {("echo_get_last" if name == "echo_get" else name): op for name, op in ops.items()}
            last_ops["echo_get_last"] = lambda: echo.get_last(size)
            ms_last = interleaved_ms(last_ops, num_calls, args.burst, seed=1)
            cell: dict[str, object] = {"size_bytes": size, "num_calls": num_calls}
            for name, value in ms.items():
                cell[f"{name}_gbps"] = size / (value / 1e3) / 1e9
                cell[f"{name}_server_cpu_ms"], cell[f"{name}_client_cpu_ms"] = cpu[name]
            cell["get_vs_echo_last"] = ms_last["echo_get_last"] / ms_last["service_get"]
            for op in ("get", "put"):
                cell[f"{op}_vs_echo"] = ms[f"echo_{op}"] / ms[f"service_{op}"]
                cell[f"{op}_vs_redis"] = ms[f"redis_{op}"] / ms[f"service_{op}"]
            rows.append(cell)
            print(json.dumps(cell), flush=True)
            kv.clear(ns)

        small = encode_block(torch.zeros(1, 1, 1, 64, dtype=torch.uint8), "mla")
        hashes = [key(0, i) for i in range(1024)]
        for start in range(0, 1024, 256):
            kv.put(ns, hashes[start: start + 256], [small] * 256)
        for n in (1, 64, 1024):
            assert kv.lookup(ns, hashes[:n]).num_blocks == n
        lookup_ops: dict[str, Callable[[], object]] = {
            "empty": echo.empty,
            **{f"lookup_{n}": (lambda n=n: kv.lookup(ns, hashes[:n])) for n in (1, 64, 1024)},
        }
        ms = interleaved_ms(lookup_ops, args.lookups, args.burst)
        cpu = cpu_ms(lookup_ops, args.lookups, {"empty": echo_proc.pid,
                                                **{f"lookup_{n}": node.pid for n in (1, 64, 1024)}})
        lookups = [{"num_hashes": n, "lookup_ms": ms[f"lookup_{n}"], "empty_call_ms": ms["empty"],
                    "vs_empty": ms[f"lookup_{n}"] / ms["empty"],
                    "lookup_server_cpu_ms": cpu[f"lookup_{n}"][0], "empty_server_cpu_ms": cpu["empty"][0],
                    "lookup_client_cpu_ms": cpu[f"lookup_{n}"][1], "empty_client_cpu_ms": cpu["empty"][1]}
                   for n in (1, 64, 1024)]
        for row in lookups:
            print(json.dumps(row), flush=True)
        kv.close()
        echo.close()
        rds.close()
    finally:
        node.close()
        redis_server.close()
        echo_proc.kill()
        echo_proc.wait()

    goals = {
        "get_vs_echo_min": min(float(r["get_vs_echo"]) for r in rows),  # type: ignore[arg-type]
        "get_goal": 0.9,
        "lookup_1024_vs_empty": lookups[-1]["vs_empty"],
        "lookup_goal": 1.5,
    }
    goals["get_met"] = goals["get_vs_echo_min"] >= 0.9
    goals["lookup_met"] = goals["lookup_1024_vs_empty"] <= 1.5
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_service.py", *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "max_message_bytes": MAX_MESSAGE_BYTES,
            "run_bytes": args.run_bytes, "min_rounds": args.min_rounds, "lookups": args.lookups,
            "burst": args.burst}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "throughput": rows, "lookup": lookups,
                                                    "goals": goals}, indent=2) + "\n")
    lines = [
        "# bench_service: the gRPC service against a raw gRPC echo and redis-py", "",
        f"Command: `{command}`", "",
        f"Python {meta['python']}, {meta['cpus']} CPUs, 1-minute load average {meta['load_avg_1m']:.1f} at the end; "
        f"client, server, echo and redis-server share the machine (and other work: see the load). "
        f"GB/s = 1e9 bytes/s of one block per call; the six ops take turns in bursts of "
        f"{args.burst} call(s), max({args.min_rounds}, {args.run_bytes // MiB} MiB / block) calls each, and each "
        f"figure is from the median burst, so all see the same load. "
        f"Ratios are service / baseline (above 1: the service is faster).", "",
        "| block | service Get | echo Get | redis GET | Get vs echo | Get vs redis | Get vs echo, last with status "
        "| service Put | echo Put | redis SET | Put vs echo | Put vs redis |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = int(r["size_bytes"])  # type: ignore[arg-type]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"
        lines.append(
            f"| {label} | {r['service_get_gbps']:.2f} | {r['echo_get_gbps']:.2f} "
            f"| {r['redis_get_gbps']:.2f} | **{r['get_vs_echo']:.2f}x** "
            f"| {r['get_vs_redis']:.2f}x | {r['get_vs_echo_last']:.2f}x | {r['service_put_gbps']:.2f} "
            f"| {r['echo_put_gbps']:.2f} | {r['redis_put_gbps']:.2f} | {r['put_vs_echo']:.2f}x "
            f"| {r['put_vs_redis']:.2f}x |"
        )
    lines += [
        "", "Get vs echo, last with status: from a second pass of the same six ops, in which the echo's Get sends its "
        "last chunk with the status in one batch, as the node's Get does (the goal is against the plain echo).",
    ]
    lines += [
        "", "CPU milliseconds per call, from a separate pass of back-to-back calls (server: the serving process, "
        "client: this one):", "",
        ("| block | service Get server | echo Get server | service Get client | echo Get client "
         "| service Put server | echo Put server | service Put client | echo Put client |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = int(r["size_bytes"])  # type: ignore[arg-type]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"
        cpu = [r[f"{server}_{op}_{side}_cpu_ms"] for op in ("get", "put") for side in ("server", "client")
               for server in ("service", "echo")]
        lines.append(f"| {label} | " + " | ".join(_ms(value) for value in cpu) + " |")  # type: ignore[arg-type]
    lines += ["", "| hashes | Lookup ms | empty call ms | ratio | Lookup server CPU ms | empty call server CPU ms |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in lookups:
        lines.append(f"| {row['num_hashes']} | {row['lookup_ms']:.3f} | {row['empty_call_ms']:.3f} "
                     f"| **{row['vs_empty']:.2f}x** | {_ms(row['lookup_server_cpu_ms'])} "  # type: ignore[arg-type]
                     f"| {_ms(row['empty_server_cpu_ms'])} |")  # type: ignore[arg-type]
    lines += [
        "",
        f"Goals: Get >= 0.9x echo: worst {goals['get_vs_echo_min']:.2f}x "
        f"({'met' if goals['get_met'] else 'MISSED'}); Lookup(1,024) <= 1.5x empty call: "
        f"{goals['lookup_1024_vs_empty']:.2f}x ({'met' if goals['lookup_met'] else 'MISSED'}).",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
