"""The same-host data plane (shared memory) against the memory-copy limit, the gRPC path, Redis and loopback TCP.

One ``kvstore serve`` node (memory tier, the same-host path on, also listening
on a Unix socket) and one ``redis-server`` run as separate processes; this
process is the client of both. Every figure is a ratio against a baseline
timed in the same run, the ops of each group taking turns call by call in a
fresh random order every round (``bench_service.interleaved_ms``), so that all
see the same background load; each figure is the median call.

Groups and goals (issue 21):

* **Batched Get** of a 64-block prefix of 256 KiB blocks (16 MiB) into one
  caller tensor (``get_into``, 64 views of it): >= 0.3x one ``Tensor.copy_`` of
  16 MiB between two CPU tensors (one thread, the same destination each call),
  and >= 3x the gRPC Get of the same blocks (``get``, encoded ``bytes``, a
  client with ``shared_memory=False``). The gRPC ``get_into`` is shown too.
* **Single-block Get** of 2 MiB: the same-host ``get`` (``bytes``, as
  redis-py returns) >= 1.5x Redis ``GET`` through redis-py with hiredis; the
  same-host ``get_into`` and the gRPC ``get`` are shown beside it.
* **Put** of the 64-block batch from tensors: >= 1.5x Redis ``SET`` of the 64
  encoded blocks in one pipeline (one round trip, no transaction). Every Put
  names new keys, so the store stores each time (and evicts its oldest when
  the memory tier is full, as in service); Redis overwrites its 64 keys.
* **Lookup** of 1, 64 and 1,024 cached hashes over the Unix socket: no slower
  than over loopback TCP (both clients gRPC-only: Lookup carries no bulk bytes).

Before timing, every path is checked to return the bytes put (byte-identical
to gRPC's) and the same-host client is checked to be attached.

Usage::

    python benchmarks/bench_shm.py [--rounds 60] [--lookups 400] [--out benchmarks/results/bench_shm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

KiB = 1 << 10
MiB = 1 << 20
NUM_BLOCKS = 64
# [num_layers, 2, num_kv_heads, block_size, head_dim] of float16: 8 * 2 * 4 * 16 * 128 * 2 bytes = 256 KiB of payload
BATCH_SHAPE = (8, 2, 4, 16, 128)
# one 2 MiB block: 32 * 2 * 8 * 16 * 128 * 2 bytes (a 16-token block of a 32-layer model with 8 KV heads)
SINGLE_SHAPE = (32, 2, 8, 16, 128)
GOALS = {"batch_vs_copy": 0.3, "batch_vs_grpc": 3.0, "single_vs_redis": 1.5, "put_vs_redis": 1.5,
         "lookup_unix_vs_tcp": 1.0}


def _bench_service() -> Any:
    """``benchmarks/bench_service.py`` as a module (its interleaved timing), without making ``benchmarks`` a package."""
    spec = importlib.util.spec_from_file_location("bench_service", REPO_ROOT / "benchmarks" / "bench_service.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms / 1e3) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="calls of each op in the Get and Put groups")
    parser.add_argument("--lookups", type=int, default=400, help="calls of each op in the Lookup group")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_shm"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()

    import redis
    import torch

    from kvstore.blocks.copying import encode_batch_into, encode_into
    from kvstore.client import KVStoreClient
    from kvstore.shm.client.control import CHANNELS_ENV
    from kvstore.blocks.tensors import encode_block, verify_block
    from kvstore.keys import Namespace, hash_blocks
    from kvstore.server.process import tune_malloc
    from kvstore.validation import BlockChecker
    from tests.support.kvnode import KVNode
    from tests.support.redis import RedisProcess

    interleaved_ms = _bench_service().interleaved_ms
    tune_malloc()  # as bench_service: this process allocates like the servers
    torch.set_num_threads(1)  # one Tensor.copy_ thread, as the baseline; the client copies on one too
    load_start = os.getloadavg()
    batch_ns = Namespace(model="bench-shm-batch", dtype="float16", block_size=BATCH_SHAPE[3])
    single_ns = Namespace(model="bench-shm-single", dtype="float16", block_size=SINGLE_SHAPE[3])
    generator = torch.Generator().manual_seed(0)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(torch.float16)

    tokens = list(range(NUM_BLOCKS * BATCH_SHAPE[3]))
    batch_hashes = hash_blocks(batch_ns, tokens)
    batch = [tensor(BATCH_SHAPE) for _ in range(NUM_BLOCKS)]
    encoded = [encode_block(t) for t in batch]
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)  # payload bytes: what lands in the caller's tensor
    assert batch_bytes == 16 * MiB
    single = tensor(SINGLE_SHAPE)
    single_hash = hash_blocks(single_ns, list(range(SINGLE_SHAPE[3])))
    single_block = encode_block(single)
    single_bytes = single.numel() * single.element_size()
    assert single_bytes == 2 * MiB

    workdir = Path(tempfile.mkdtemp(prefix="bench-shm-"))
    unix_socket = workdir / "kvstore.sock"
    node = KVNode(memory_capacity="1GiB", metrics=False,
                  extra_args=["--log-level", "WARNING", "--unix-socket", str(unix_socket)])
    redis_server = RedisProcess(maxmemory_bytes=1 << 30)
    try:
        node.start()
        redis_server.start()
        shm = KVStoreClient(node.target, timeout_s=120)  # the same-host path (on by default)
        grpc_only = KVStoreClient(node.target, timeout_s=120, shared_memory=False)
        over_unix = KVStoreClient(f"unix://{unix_socket}", timeout_s=120, shared_memory=False)
        os.environ[CHANNELS_ENV] = "0"  # a same-host client whose control calls go over gRPC (the baseline)
        try:
            shm_grpc_control = KVStoreClient(node.target, timeout_s=120)
            shm_grpc_control.lookup(single_ns, single_hash)  # attaches (a Lookup may go over the session), no channel
        finally:
            del os.environ[CHANNELS_ENV]
        rds = redis.Redis(host=redis_server.host, port=redis_server.port, socket_timeout=60)
        assert redis.utils.HIREDIS_AVAILABLE, "hiredis is not installed"

        # -- correctness first: every path returns the bytes put
        assert shm.put(batch_ns, batch_hashes, batch) == NUM_BLOCKS
        assert shm.put(single_ns, single_hash, [single]) == 1
        assert shm.shared_memory() == ("attached",), shm.shared_memory()
        dest = torch.empty((NUM_BLOCKS, *BATCH_SHAPE), dtype=torch.float16)
        views = list(dest.unbind(0))
        assert shm.get_into(batch_ns, batch_hashes, views) == NUM_BLOCKS
        assert torch.equal(dest, torch.stack(batch))
        assert [bytes(b) for b in shm.get(batch_ns, batch_hashes)] == encoded
        assert [bytes(b) for b in grpc_only.get(batch_ns, batch_hashes)] == encoded
        assert [bytes(b) for b in shm.get(single_ns, single_hash)] == [single_block]
        single_dest = torch.empty(SINGLE_SHAPE, dtype=torch.float16)
        assert shm.get_into(single_ns, single_hash, [single_dest]) == 1 and torch.equal(single_dest, single)
        redis_keys = [b"batch-%d" % i for i in range(NUM_BLOCKS)]
        rds.set(b"single", single_block)
        assert rds.get(b"single") == single_block
        copy_src = torch.stack(batch)
        copy_dst = torch.empty_like(copy_src)

        def redis_put_batch() -> object:
            pipe = rds.pipeline(transaction=False)
            for k, block in zip(redis_keys, encoded):
                pipe.set(k, block)
            return pipe.execute()

        put_counter = iter(range(1 << 40))
        put_ns = Namespace(model="bench-shm-put", dtype="float16", block_size=BATCH_SHAPE[3])

        def put_with(client: KVStoreClient) -> Callable[[], object]:
            def put() -> object:
                hashes = [next(put_counter).to_bytes(8, "little") * 2 for _ in range(NUM_BLOCKS)]
                return client.put(put_ns, hashes, batch)
            return put

        batch_ops: dict[str, Callable[[], object]] = {
            "shm_get_into": lambda: shm.get_into(batch_ns, batch_hashes, views),
            "copy_": lambda: copy_dst.copy_(copy_src),
            "grpc_get": lambda: grpc_only.get(batch_ns, batch_hashes),
            "grpc_get_into": lambda: grpc_only.get_into(batch_ns, batch_hashes, views),
            "shm_get": lambda: shm.get(batch_ns, batch_hashes),
        }
        single_ops: dict[str, Callable[[], object]] = {
            "shm_get": lambda: shm.get(single_ns, single_hash),
            "shm_get_into": lambda: shm.get_into(single_ns, single_hash, [single_dest]),
            "redis_get": lambda: rds.get(b"single"),
            "grpc_get": lambda: grpc_only.get(single_ns, single_hash),
            "control_call": lambda: shm.lookup(single_ns, single_hash),  # one control round trip, no bulk bytes
            "shm_get_grpc_control": lambda: shm_grpc_control.get(single_ns, single_hash),
            "control_call_grpc": lambda: shm_grpc_control.lookup(single_ns, single_hash),
        }
        # the parts of a same-host Put, done here on a scratch segment (this process tunes malloc as the node
        # does): the client's staging (payload copy + header checksum), the node's copy out of the segment
        # and its validation of each copy (header + xxh3-64 checksum)
        scratch = mmap.mmap(-1, NUM_BLOCKS * len(encoded[0]))
        scratch_view, scratch_raw = memoryview(scratch), torch.frombuffer(scratch, dtype=torch.uint8)
        block_nbytes = len(encoded[0])

        scratch_offsets = [i * block_nbytes for i in range(NUM_BLOCKS)]  # block_nbytes is a multiple of 64

        def part_stage() -> None:  # what SharedSession.stage does with like tensors
            assert encode_batch_into(batch, "kv", scratch_view, scratch_raw, scratch_offsets)

        def part_stage_per_block() -> None:  # the staging before issue 33's batching: encode_into per block
            for i, block in enumerate(batch):
                start = i * block_nbytes
                encode_into(block, "kv", scratch_view[start:start + block_nbytes],
                            scratch_raw[start:start + block_nbytes])

        def part_copy_out() -> list[bytes]:
            return [bytes(scratch_view[i * block_nbytes:(i + 1) * block_nbytes]) for i in range(NUM_BLOCKS)]

        def part_verify() -> None:  # the node's checks before: verify_block per block, after all were copied
            for block in encoded:
                verify_block(block)

        def part_copy_check() -> list[Any]:  # what PutShared does now: each block copied out, then checked in cache
            checker = BlockChecker(put_ns, 1 << 30)
            copies = []
            for i in range(NUM_BLOCKS):
                copy = bytes(scratch_view[i * block_nbytes:(i + 1) * block_nbytes])
                checker.check(i, copy)
                copies.append(copy)
            return copies

        put_ops: dict[str, Callable[[], object]] = {
            "shm_put": put_with(shm),
            "redis_set_pipelined": redis_put_batch,
            "grpc_put": put_with(grpc_only),
            "shm_put_grpc_control": put_with(shm_grpc_control),
            "part_client_stage": part_stage,
            "part_client_stage_per_block": part_stage_per_block,
            "part_node_copy_out": part_copy_out,
            "part_node_verify": part_verify,
            "part_node_copy_check": part_copy_check,
        }
        lookup_hashes = hash_blocks(Namespace(model="bench-shm-lookup", dtype="float16", block_size=1),
                                    list(range(1024)))
        lookup_ns = Namespace(model="bench-shm-lookup", dtype="float16", block_size=1)
        tiny = torch.zeros((1, 2, 1, 1, 8), dtype=torch.float16)
        for start in range(0, 1024, 256):
            grpc_only.put(lookup_ns, lookup_hashes[start: start + 256], [tiny] * 256)
        for n in (1, 64, 1024):
            assert grpc_only.lookup(lookup_ns, lookup_hashes[:n]).num_blocks == n
            assert over_unix.lookup(lookup_ns, lookup_hashes[:n]).num_blocks == n
        lookup_ops: dict[str, Callable[[], object]] = {}
        for n in (1, 64, 1024):
            lookup_ops[f"tcp_{n}"] = lambda n=n: grpc_only.lookup(lookup_ns, lookup_hashes[:n])
            lookup_ops[f"unix_{n}"] = lambda n=n: over_unix.lookup(lookup_ns, lookup_hashes[:n])

        batch_ms = interleaved_ms(batch_ops, args.rounds, 1, seed=0)
        print(json.dumps({"batch_ms": batch_ms}), flush=True)
        single_ms = interleaved_ms(single_ops, args.rounds * 4, 1, seed=1)
        print(json.dumps({"single_ms": single_ms}), flush=True)
        put_ms = interleaved_ms(put_ops, args.rounds, 1, seed=2)
        print(json.dumps({"put_ms": put_ms}), flush=True)
        lookup_ms = interleaved_ms(lookup_ops, args.lookups, 1, seed=3)
        print(json.dumps({"lookup_ms": lookup_ms}), flush=True)
        assert shm.shared_memory() == ("attached",), shm.shared_memory()  # nothing fell back to gRPC meanwhile
        assert shm_grpc_control.shared_memory() == ("attached",)
        for client in (shm, grpc_only, over_unix, shm_grpc_control):
            client.close()
        rds.close()
    finally:
        node.close()
        redis_server.close()

    ratios = {
        "batch_vs_copy": batch_ms["copy_"] / batch_ms["shm_get_into"],
        "batch_vs_grpc": batch_ms["grpc_get"] / batch_ms["shm_get_into"],
        "single_vs_redis": single_ms["redis_get"] / single_ms["shm_get"],
        "put_vs_redis": put_ms["redis_set_pipelined"] / put_ms["shm_put"],
        "lookup_unix_vs_tcp": min(lookup_ms[f"tcp_{n}"] / lookup_ms[f"unix_{n}"] for n in (1, 64, 1024)),
    }
    goals = {name: {"ratio": ratios[name], "goal": GOALS[name], "met": ratios[name] >= GOALS[name]}
             for name in GOALS}
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_shm.py", *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(), "rounds": args.rounds, "lookups": args.lookups,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    result = {"meta": meta, "batch_ms": batch_ms, "single_ms": single_ms, "put_ms": put_ms,
              "lookup_ms": lookup_ms, "goals": goals}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result, batch_bytes, single_bytes))
    print(out.with_suffix(".md").read_text())
    return 0


def _markdown(result: dict[str, Any], batch_bytes: int, single_bytes: int) -> str:
    meta, goals = result["meta"], result["goals"]
    load = ", ".join(f"{x:.2f}" for x in meta["load_avg_start"])
    load_end = ", ".join(f"{x:.2f}" for x in meta["load_avg_end"])

    put = result["put_ms"]

    def rows(ms: dict[str, float], num_bytes: int) -> list[str]:
        return [f"| {name} | {value:.3f} | {_gbps(num_bytes, value):.2f} |" for name, value in ms.items()]

    def verdict(name: str) -> str:
        g = goals[name]
        return f"**{g['ratio']:.4g}x** (goal >= {g['goal']}x: {'met' if g['met'] else 'MISSED'})"

    lines = [
        "# bench_shm: the same-host data plane against copy_, gRPC, Redis and loopback TCP", "",
        f"Command: `{meta['command']}`", "",
        f"{meta['date']}; Python {meta['python']}, torch {meta['torch']}, {meta['cpus']} CPUs shared with other "
        f"work; load average (1, 5, 15 min) {load} at the start, {load_end} at the end. Node, redis-server and "
        "this client are separate processes on one host. Each group's ops take turns call by call in a random "
        "order; figures are median ms per call, GB/s of payload (batch: 16 MiB; single: 2 MiB).", "",
        f"## Batched Get: {NUM_BLOCKS} blocks of 256 KiB ({batch_bytes // MiB} MiB) into one caller tensor", "",
        "| op | ms | GB/s |", "|---|---:|---:|", *rows(result["batch_ms"], batch_bytes), "",
        f"- same-host `get_into` vs one `Tensor.copy_` of 16 MiB: {verdict('batch_vs_copy')}",
        f"- same-host `get_into` vs the gRPC `get`: {verdict('batch_vs_grpc')}", "",
        "## Single-block Get of 2 MiB", "",
        "| op | ms | GB/s |", "|---|---:|---:|", *rows(result["single_ms"], single_bytes), "",
        f"- same-host `get` (bytes) vs Redis GET (redis-py + hiredis): {verdict('single_vs_redis')}",
        "- `control_call` (a Lookup of the one hash, one round trip on the session's control channels; "
        "`control_call_grpc`: the same over gRPC) is the floor of any same-host Get: "
        f"{result['single_ms']['control_call']:.3f} ms of the same-host `get`'s {result['single_ms']['shm_get']:.3f} "
        f"ms; the rest is the node's copy into the segment and the client's copy out "
        f"({result['single_ms']['shm_get'] - result['single_ms']['control_call']:.3f} ms).", "",
        f"## Put of the {NUM_BLOCKS}-block batch", "",
        "| op | ms | GB/s |", "|---|---:|---:|", *rows(result["put_ms"], batch_bytes), "",
        f"- same-host `put` (tensors) vs 64 Redis SETs in one pipeline: {verdict('put_vs_redis')}",
        f"- its parts, timed here in the same turns: the client's staging (payload copy + checksum, a batch of like "
        f"tensors with one header build) {put['part_client_stage']:.3f} ms "
        f"(per block, as before: {put['part_client_stage_per_block']:.3f} ms), the node's copy out of the segment "
        f"with each copy checked as it is made {put['part_node_copy_check']:.3f} ms (copy alone "
        f"{put['part_node_copy_out']:.3f} ms; the checks as before, per block after all copies: "
        f"{put['part_node_verify']:.3f} ms): "
        f"{put['part_client_stage'] + put['part_node_copy_check']:.3f} ms of the Put's "
        f"{put['shm_put']:.3f} ms, the rest the control call and the store's placement "
        "(`benchmarks/results/put_profile.md`).", "",
        "## Lookup over the Unix socket vs loopback TCP", "",
        "| hashes | TCP ms | Unix ms | TCP / Unix |", "|---:|---:|---:|---:|",
    ]
    lookup = result["lookup_ms"]
    for n in (1, 64, 1024):
        lines.append(f"| {n} | {lookup[f'tcp_{n}']:.3f} | {lookup[f'unix_{n}']:.3f} "
                     f"| {lookup[f'tcp_{n}'] / lookup[f'unix_{n}']:.2f}x |")
    lines += ["", f"- Unix socket no slower than TCP (the worst of the three sizes): {verdict('lookup_unix_vs_tcp')}",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
