"""What blocks cost each tier to hold: stored bytes over the blocks' own bytes, per tier and block kind.

Issue 38's footprint goal: stored bytes / the blocks' own bytes <= 1.05 in every
tier, for raw and encoded blocks of 16 KiB and up. For each kind of block (raw
float16 blocks from 16 KiB to 2 MiB, and lossy-encoded ones: ``kvstore.blocks.encoding``),
this puts ``--num-blocks`` distinct blocks straight into a fresh tier and reads
what the tier then takes, from the tier's own memory or file, not its accounting:

* ``memory``: the page pool (``kvstore.tiers.memory``): bytes of pages in use (the pool itself is preallocated);
* ``heap``: one ``bytes`` object per block (``kvstore.tiers.heap``): bytes ``tracemalloc`` sees allocated
  by the puts (the objects and the tier's records);
* ``lmdb``: the disk tier: pages of its B-trees (branch, leaf and overflow pages of every sub-database, from
  LMDB's own ``stat``, read from a fresh read-only environment after the tier closed) times the page size;
* ``memory-64k``: the page pool with the 64 KiB pages it had before (``page_bytes=64KiB``), for comparison;
* ``redis``: the shared tier: ``MEMORY USAGE`` of each block's key (Redis' allocator's bytes for the key,
  its value and their entry), against a real ``redis-server`` on a loopback port.

Beside each it gives the tier's own accounting (``footprint``, what the store counts against its capacity),
over the same blocks. A block's own bytes are its encoded length (header and payload, ``kvstore.blocks.tensors``);
``payload`` gives the ratio over the payload alone too.

    .venv/bin/python benchmarks/bench_footprint.py                 # all tiers (redis: if installed)
    .venv/bin/python benchmarks/bench_footprint.py --tiers memory,lmdb

Kinds are ``(name, float16 shape [layers, 2, kv_heads, tokens, head_dim], encoding)``; another benchmark (e.g. of
encodings) can call :func:`measure` with blocks of its own. Writes ``benchmarks/results/bench_footprint.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvstore.blocks.tensors import decode_header, encode_block  # noqa: E402
from kvstore.keys import Namespace, block_key  # noqa: E402
from kvstore.tiers.base import BlockMeta  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOAL = 1.05

KINDS: list[tuple[str, tuple[int, ...], str]] = [
    ("raw 16 KiB", (1, 2, 2, 16, 128), ""),
    ("raw 24 KiB", (3, 2, 1, 16, 128), ""),
    ("raw 32 KiB", (2, 2, 2, 16, 128), ""),
    ("raw 48 KiB", (3, 2, 2, 16, 128), ""),
    ("raw 64 KiB", (4, 2, 2, 16, 128), ""),
    ("raw 96 KiB", (6, 2, 2, 16, 128), ""),
    ("raw 128 KiB", (8, 2, 2, 16, 128), ""),
    ("raw 256 KiB", (8, 2, 4, 16, 128), ""),
    ("raw 2 MiB", (8, 2, 4, 128, 128), ""),
    ("int8 of 96 KiB", (6, 2, 2, 16, 128), "int8"),
    ("int4 of 96 KiB", (6, 2, 2, 16, 128), "int4"),
    ("int8 of 256 KiB", (8, 2, 4, 16, 128), "int8"),
    ("int4 of 256 KiB", (8, 2, 4, 16, 128), "int4"),
    ("fp8 of 256 KiB", (8, 2, 4, 16, 128), "fp8_e4m3"),
]
"""Block kinds measured by default: name, the float16 tensor's shape, the lossy encoding (``""``: raw)."""


def make_blocks(shape: Sequence[int], encoding: str, num_blocks: int, seed: int = 0) -> list[bytes]:
    """``num_blocks`` distinct encoded blocks of a float16 tensor of ``shape``, raw or under ``encoding``."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(num_blocks):
        tensor = torch.randn(*shape, generator=generator).to(torch.float16)
        if encoding:
            from kvstore.blocks.encoding import encode_lossy
            blocks.append(bytes(encode_lossy(tensor, "kv", encoding)))
        else:
            blocks.append(encode_block(tensor))
    return blocks


def keys_for(blocks: Sequence[bytes]) -> list[bytes]:
    namespace = Namespace("bench/footprint")
    return [block_key(namespace, i.to_bytes(16, "little")) for i in range(len(blocks))]


async def stored_memory(blocks: Sequence[bytes]) -> tuple[int, int]:
    from kvstore.tiers.memory import MemoryTier
    tier = MemoryTier(2 * sum(map(len, blocks)) + (1 << 20), pin_memory=False)
    try:
        await tier.put(keys_for(blocks), blocks, [BlockMeta()] * len(blocks))
        return tier.used_bytes, sum(tier.footprint(len(b)) for b in blocks)
    finally:
        await tier.close()


async def stored_heap(blocks: Sequence[bytes]) -> tuple[int, int]:
    from kvstore.tiers.heap import HeapTier
    tier = HeapTier(2 * sum(map(len, blocks)) + (1 << 20))
    copies = [bytearray(b) for b in blocks]  # the tier keeps each put's own bytes object, made inside the trace
    keys = keys_for(blocks)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await tier.put(keys, [bytes(c) for c in copies], [BlockMeta()] * len(blocks))
        stored = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        await tier.close()
    return stored, sum(tier.footprint(len(b)) for b in blocks)


async def stored_lmdb(blocks: Sequence[bytes]) -> tuple[int, int]:
    import lmdb

    from kvstore.tiers.lmdb import LMDBTier
    folder = tempfile.mkdtemp(prefix="kvstore-footprint-")
    try:
        tier = LMDBTier(folder, 4 * sum(map(len, blocks)) + (64 << 20))
        try:
            await tier.put(keys_for(blocks), blocks, [BlockMeta()] * len(blocks))
            accounted = tier.used_bytes
        finally:
            await tier.close()
        env = lmdb.open(folder, readonly=True, lock=False, max_dbs=16, subdir=True)
        try:
            with env.begin() as txn:
                names = [bytes(key) for key, _ in txn.cursor()]
            stored = 0
            for name in names:
                db = env.open_db(name, create=False)
                with env.begin() as txn:
                    stat = txn.stat(db)
                stored += (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
        finally:
            env.close()
        return stored, accounted
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def stored_redis(blocks: Sequence[bytes]) -> tuple[int, int]:
    import redis.asyncio as aioredis

    from kvstore.config import RedisTierConfig
    from kvstore.tiers.redis import RedisTier
    from tests.support.redis import RedisProcess
    with RedisProcess(maxmemory_bytes=0) as server:
        tier = RedisTier(RedisTierConfig(url=server.url, socket_timeout_s=10.0, connect_timeout_s=5.0))
        client = aioredis.from_url(server.url)
        try:
            await tier.put(keys_for(blocks), blocks, [BlockMeta()] * len(blocks))
            stored = 0
            async for name in client.scan_iter(match="*"):
                if name.endswith(b":generation"):
                    continue
                stored += await client.memory_usage(name, samples=0)
            return stored, sum(tier.footprint(len(b)) for b in blocks)
        finally:
            await client.aclose()
            await tier.close()


async def stored_memory_64k(blocks: Sequence[bytes]) -> tuple[int, int]:
    """The page pool as it was before issue 38: whole 64 KiB pages (``page_bytes=64KiB``), for the record."""
    from kvstore.tiers.memory import MemoryTier
    tier = MemoryTier(2 * sum(map(len, blocks)) + (8 << 20), page_bytes=64 << 10, pin_memory=False)
    try:
        await tier.put(keys_for(blocks), blocks, [BlockMeta()] * len(blocks))
        return tier.used_bytes, sum(tier.footprint(len(b)) for b in blocks)
    finally:
        await tier.close()


TIERS: dict[str, Callable[[Sequence[bytes]], object]] = {
    "memory": stored_memory, "heap": stored_heap, "lmdb": stored_lmdb, "redis": stored_redis,
    "memory-64k": stored_memory_64k}
"""Tier name -> an async function of the blocks that returns ``(stored bytes, accounted bytes)``."""


def measure(tier: str, blocks: Sequence[bytes]) -> dict:
    """Put ``blocks`` (encoded, distinct) into a fresh tier named ``tier`` and measure what it takes.

    Returns:
        ``stored_bytes`` (what the tier's memory or file holds for them), ``accounted_bytes`` (its ``footprint``
        sum), ``block_bytes`` (their encoded length), ``payload_bytes``, and the ratios ``stored_x``
        (stored / block bytes), ``accounted_x`` and ``stored_x_payload``.
    """
    stored, accounted = asyncio.run(TIERS[tier](blocks))  # type: ignore[arg-type]
    block_bytes = sum(len(b) for b in blocks)
    payload_bytes = sum(decode_header(b).payload_nbytes for b in blocks)
    return {"tier": tier, "num_blocks": len(blocks), "block_nbytes": len(blocks[0]), "stored_bytes": stored,
            "accounted_bytes": accounted, "block_bytes": block_bytes, "payload_bytes": payload_bytes,
            "stored_x": stored / block_bytes, "accounted_x": accounted / block_bytes,
            "stored_x_payload": stored / payload_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="memory,memory-64k,heap,lmdb,redis")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "bench_footprint"))
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    if "redis" in tiers and shutil.which("redis-server") is None:
        print("redis-server is not installed: the redis tier is left out", file=sys.stderr)
        tiers.remove("redis")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    for name, shape, encoding in KINDS:
        blocks = make_blocks(shape, encoding, args.num_blocks)
        for tier in tiers:
            row = measure(tier, blocks)
            row["kind"] = name
            rows.append(row)
            print(f"{name:>18} {tier:>6}: {row['stored_x']:.3f}x stored, {row['accounted_x']:.3f}x accounted",
                  flush=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = "python benchmarks/bench_footprint.py" + (f" --tiers {args.tiers}" if args.tiers != parser.get_default(
        "tiers") else "") + (f" --num-blocks {args.num_blocks}" if args.num_blocks != 64 else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "command": command, "host": platform.platform(), "goal": GOAL, "load_average_before": load_before,
        "load_average_after": load_after, "rows": rows}, indent=2) + "\n")
    lines = ["# bench_footprint: stored bytes over the blocks' own bytes, per tier", "",
             f"Command (repo root, `.venv`): `{command}`", "",
             f"{args.num_blocks} distinct blocks of each kind put into a fresh tier; stored bytes read from the "
             "tier's memory or file (see the script's docstring), accounted bytes from its `footprint`. A block's "
             f"own bytes: its encoded length (128-byte header and payload). Goal: stored <= {GOAL}x for blocks of "
             f"16 KiB and up. Host: {platform.platform()}; load average {load_before} before, {load_after} after "
             "(no timing here).", "",
             "| block | block bytes | " + " | ".join(f"{t} stored x | {t} accounted x" for t in tiers) + " |",
             "|---|---:|" + "---:|---:|" * len(tiers)]
    for name, _, _ in KINDS:
        cells = {r["tier"]: r for r in rows if r["kind"] == name}
        first = next(iter(cells.values()))
        line = f"| {name} | {first['block_nbytes']} |"
        for t in tiers:
            r = cells[t]
            mark = "" if r["stored_x"] <= GOAL else " ✘"
            line += f" {r['stored_x']:.3f}{mark} | {r['accounted_x']:.3f} |"
        lines.append(line)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
