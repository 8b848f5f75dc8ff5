"""Put and get throughput of the memory and LMDB tiers, as ratios to torch ``Tensor.copy_`` of the same bytes.

For each block size, one batch of ``--batch-bytes`` (64 MiB by default) of
encoded blocks is put into a tier and read back, ``--reps`` times; medians
give GB/s (1e9 bytes per second). The baseline is ``dst[i].copy_(src[i])``
block by block between two preallocated host tensors, timed right before each
put and get, and each ratio is the median of the per-repetition ratios. Also
reported: ``copy_`` into a freshly allocated tensor, since every get must
return new ``bytes`` objects.

Fresh large ``bytes`` objects can cost page faults: glibc returns freed chunks
above its trim threshold to the kernel, so the next allocation of a batch
touches new pages. The run therefore has two phases, ``default`` (glibc as the
process started) and ``tuned`` (``mallopt(M_MMAP_THRESHOLD=256 MiB,
M_TRIM_THRESHOLD=1 GiB)``, equivalent to
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824``).

Usage::

    python benchmarks/bench_tiers.py [--block-sizes 262144,2097152] [--batch-bytes 67108864] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.blocks.tensors import encode_block, header_nbytes  # noqa: E402
from kvstore.tiers.base import BlockMeta  # noqa: E402
from kvstore.tiers.lmdb import LMDBTier  # noqa: E402
from kvstore.tiers.memory import MemoryTier  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LMDB_TEMP_ROOT = tempfile.mkdtemp(prefix="bench_tiers_")


def make_values(block_bytes: int, num_blocks: int) -> list[bytes]:
    """``num_blocks`` encoded uint8 blocks of exactly ``block_bytes`` bytes each."""
    head_dim = (block_bytes - header_nbytes(5)) // 2
    gen = torch.Generator().manual_seed(block_bytes)
    values = []
    for _ in range(num_blocks):
        tensor = torch.randint(0, 256, (1, 2, 1, 1, head_dim), generator=gen, dtype=torch.uint8)
        values.append(encode_block(tensor))
    assert all(len(v) == block_bytes for v in values)
    return values


def timed(fn: Callable[[], object]) -> float:
    """Wall time of ``fn()``, seconds."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def timed_async(fn: Callable[[], Awaitable[object]]) -> float:
    """Wall time of ``await fn()``, seconds (the result is dropped after the clock stops)."""
    start = time.perf_counter()
    result = await fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


async def measure(tier, values: list[bytes], reps: int) -> dict[str, list[float]]:
    """Per repetition, back to back: ``copy_`` of the batch, a put into ``tier``, a get of it (seconds).

    Measuring the baseline next to each tier call keeps the ratios fair on a
    shared, noisy machine. One untimed warm-up round runs first; the bytes of
    the first get are checked.
    """
    num_blocks, block_bytes = len(values), len(values[0])
    src = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = [i.to_bytes(8, "little") * 3 for i in range(num_blocks)]
    metas = [BlockMeta()] * num_blocks

    def copy_prealloc() -> None:
        for i in range(num_blocks):
            dst[i].copy_(src[i])

    def copy_fresh() -> list[torch.Tensor]:
        return [torch.empty(block_bytes, dtype=torch.uint8).copy_(src[i]) for i in range(num_blocks)]

    out: dict[str, list[float]] = {"copy_s": [], "copy_fresh_s": [], "put_s": [], "get_s": []}
    for rep in range(reps + 1):
        copy_s = timed(copy_prealloc)
        copy_fresh_s = timed(copy_fresh)
        put_s = await timed_async(lambda: tier.put(keys, values, metas))
        if rep == 0:
            assert await tier.get(keys) == values, f"tier {tier.name} returned wrong bytes"
        get_s = await timed_async(lambda: tier.get(keys))
        await tier.delete(keys)
        if rep:
            for name, seconds in zip(out, (copy_s, copy_fresh_s, put_s, get_s)):
                out[name].append(seconds)
    return out


def tune_malloc() -> bool:
    """Keep freed heap memory in the process (glibc only), so fresh ``bytes`` reuse faulted pages."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 256 * MiB)) and bool(libc.mallopt(m_trim_threshold, 1024 * MiB))


async def run(args: argparse.Namespace) -> dict:
    load_at_start = os.getloadavg()[0]
    rows = []
    phases = ["default", "tuned"] if args.malloc == "both" else [args.malloc]
    lmdb_root = Path(args.lmdb_dir or LMDB_TEMP_ROOT)
    for phase in phases:
        if phase == "tuned" and not tune_malloc():
            print("mallopt is not available; skipping the tuned phase", file=sys.stderr)
            continue
        for block_bytes in args.block_sizes:
            num_blocks = max(1, args.batch_bytes // block_bytes)
            nbytes = num_blocks * block_bytes
            values = make_values(block_bytes, num_blocks)
            tiers = {
                "memory": lambda: MemoryTier(nbytes + 64 * MiB, page_bytes=args.page_bytes),
                "memory-inline": lambda: MemoryTier(
                    nbytes + 64 * MiB, page_bytes=args.page_bytes, offload_min_bytes=1 << 62
                ),
                "lmdb": lambda: LMDBTier(lmdb_root / f"{phase}-{block_bytes}", 2 * nbytes + 64 * MiB),
            }
            for name, make_tier in tiers.items():
                tier = make_tier()
                times = await measure(tier, values, args.reps)
                await tier.close()
                gbps = {k.replace("_s", "_GBps"): [nbytes / t / 1e9 for t in v] for k, v in times.items()}
                row = {
                    "malloc": phase,
                    "tier": name,
                    "block_bytes": block_bytes,
                    "batch_bytes": nbytes,
                    **{k: statistics.median(v) for k, v in gbps.items()},
                    "put_ratio": statistics.median(p / c for p, c in zip(gbps["put_GBps"], gbps["copy_GBps"])),
                    "get_ratio": statistics.median(g / c for g, c in zip(gbps["get_GBps"], gbps["copy_GBps"])),
                    "best_put_ratio": max(gbps["put_GBps"]) / max(gbps["copy_GBps"]),
                    "best_get_ratio": max(gbps["get_GBps"]) / max(gbps["copy_GBps"]),
                    "best_copy_GBps": max(gbps["copy_GBps"]),
                    "samples_GBps": gbps,
                }
                rows.append(row)
                print(
                    f"{phase:8s} {name:14s} {block_bytes // KiB:6d} KiB  copy_ {row['copy_GBps']:6.2f} GB/s  "
                    f"put {row['put_GBps']:6.2f} GB/s ({row['put_ratio']:.2f}x)  "
                    f"get {row['get_GBps']:6.2f} GB/s ({row['get_ratio']:.2f}x)  "
                    f"best put/get {row['best_put_ratio']:.2f}x/{row['best_get_ratio']:.2f}x",
                    flush=True,
                )
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda": torch.cuda.is_available(),
            "loadavg_1m_start_end": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
        },
        "params": {
            "block_sizes": args.block_sizes,
            "batch_bytes": args.batch_bytes,
            "reps": args.reps,
            "page_bytes": args.page_bytes,
            "lmdb_dir": str(lmdb_root),
            "torch_threads": torch.get_num_threads(),
        },
        "rows": rows,
    }


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# bench_tiers: memory and LMDB tier throughput",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}  ",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in result["machine"].items()),
        "",
        f"One batch of {result['params']['batch_bytes'] // MiB} MiB of encoded blocks per put and per get; "
        f"{result['params']['reps']} repetitions after a warm-up; each repetition times `copy_`, put and get "
        "back to back, and the table shows medians of GB/s (1e9 bytes/s) and of the per-repetition ratios; "
        "the `best` columns compare the fastest repetition of each, which is steadier on a shared machine. "
        "Ratios are against `Tensor.copy_` of the same bytes, block by block, between preallocated host "
        "tensors (`copy_` into fresh tensors is shown for reference). "
        "`memory` copies batches of 4 MiB or more in a worker thread (its default), `memory-inline` always on "
        "the event loop. "
        "Phase `default` runs with glibc's malloc as started; `tuned` after "
        "`mallopt(M_MMAP_THRESHOLD=256 MiB, M_TRIM_THRESHOLD=1 GiB)`, so fresh `bytes` reuse faulted pages.",
        "",
        "| malloc | tier | block | copy_ GB/s | copy_ fresh GB/s | put GB/s | put / copy_ | get GB/s "
        "| get / copy_ | best copy_ GB/s | best put / copy_ | best get / copy_ |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['malloc']} | {r['tier']} | {r['block_bytes'] // KiB} KiB | {r['copy_GBps']:.2f} | "
            f"{r['copy_fresh_GBps']:.2f} | {r['put_GBps']:.2f} | {r['put_ratio']:.2f} | "
            f"{r['get_GBps']:.2f} | {r['get_ratio']:.2f} | {r['best_copy_GBps']:.2f} | "
            f"{r['best_put_ratio']:.2f} | {r['best_get_ratio']:.2f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", default=f"{256 * KiB},{2 * MiB}",
                        type=lambda s: [int(x) for x in s.split(",")], help="encoded block sizes, bytes")
    parser.add_argument("--batch-bytes", type=int, default=64 * MiB, help="bytes per put/get batch")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--page-bytes", type=int, default=64 * KiB, help="memory tier page size, bytes")
    parser.add_argument("--malloc", choices=["default", "tuned", "both"], default="both")
    parser.add_argument("--lmdb-dir", default="", help="directory for the LMDB environments (a temp dir if empty)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "bench_tiers"), help="output path without extension")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = asyncio.run(run(args))
    finally:
        if not args.lmdb_dir:
            shutil.rmtree(LMDB_TEMP_ROOT, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, out.with_suffix(".md"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
