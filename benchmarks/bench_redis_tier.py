"""Get and put throughput of the Redis tier, as a ratio to raw redis-py (hiredis) on the same server in the same run.

Run: python benchmarks/bench_redis_tier.py [--repeats N]
Writes benchmarks/results/bench_redis_tier.{md,json}.

For each block size (256 KiB, 2 MiB) a batch of encoded blocks is written and
read back, alternately by the tier (``RedisTier.put`` / ``get``: chunked
pipelines, checksum verification, breaker bookkeeping) and by a raw
``redis.asyncio`` client with the hiredis parser (one non-transactional
pipeline of ``SET``s, one ``MGET`` of the same keys: the floor of what any
client must do). Because one huge pipeline is slower in redis-py's asyncio
client than a few smaller ones, raw is also measured cut into the tier's
8 MiB chunks, and the goal (a ratio of at least 0.9) is checked against the
faster of the two raw variants. All of them talk to one ``redis-server``
started here on a free loopback port with persistence off. Throughput is the
median over repeats of value bytes moved per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402
import torch  # noqa: E402
from redis.utils import HIREDIS_AVAILABLE  # noqa: E402

from kvstore.blocks.tensors import encode_block  # noqa: E402
from kvstore.config import RedisTierConfig  # noqa: E402
from kvstore.keys import Namespace, block_key  # noqa: E402
from kvstore.tiers.base import BlockMeta  # noqa: E402
from kvstore.tiers.redis import CHUNK_BYTES, RedisTier  # noqa: E402
from tests.support.redis import RedisProcess  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
KiB, MiB = 1 << 10, 1 << 20
CASES = [(256 * KiB, 64), (2 * MiB, 16)]
"""(block bytes, blocks per batch): 16 MiB and 32 MiB per batch."""
GOAL_RATIO = 0.9


def make_values(block_bytes: int, num_blocks: int) -> list[bytes]:
    """``num_blocks`` encoded uint8 blocks of ``block_bytes`` payload bytes each (``[1, 2, 1, 1, n/2]``)."""
    gen = torch.Generator().manual_seed(block_bytes)
    return [
        encode_block(torch.randint(0, 256, (1, 2, 1, 1, block_bytes // 2), generator=gen, dtype=torch.uint8))
        for _ in range(num_blocks)
    ]


async def timed(work) -> float:
    start = time.perf_counter()
    await work
    return time.perf_counter() - start


async def bench_case(url: str, block_bytes: int, num_blocks: int, repeats: int) -> dict[str, object]:
    values = make_values(block_bytes, num_blocks)
    nbytes = sum(map(len, values))
    namespace = Namespace("bench/redis", block_size=16)
    keys = [block_key(namespace, i.to_bytes(16, "little")) for i in range(num_blocks)]
    metas = [BlockMeta()] * num_blocks
    # Generous socket timeout: this measures throughput, not failure handling.
    tier = RedisTier(RedisTierConfig(url=url, socket_timeout_s=5.0, connect_timeout_s=5.0))
    raw = aioredis.Redis.from_url(url, socket_timeout=5.0)
    raw_names = [f"raw:{i}" for i in range(num_blocks)]

    async def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for name, value in zip(raw_names, values):
            pipe.set(name, value)
        assert all(await pipe.execute())

    async def raw_get() -> None:
        got = await raw.mget(raw_names)
        assert len(got) == num_blocks and all(g is not None for g in got)

    per_chunk = max(1, CHUNK_BYTES // len(values[0]))
    chunks = [raw_names[i : i + per_chunk] for i in range(0, num_blocks, per_chunk)]
    by_name = dict(zip(raw_names, values))

    async def chunked_put() -> None:
        for chunk in chunks:
            pipe = raw.pipeline(transaction=False)
            for name in chunk:
                pipe.set(name, by_name[name])
            assert all(await pipe.execute())

    async def chunked_get() -> None:
        got: list[bytes | None] = []  # keep every value, as a caller of get does
        for chunk in chunks:
            got.extend(await raw.mget(chunk))
        assert len(got) == num_blocks and all(g is not None for g in got)

    async def tier_put() -> None:
        assert all(await tier.put(keys, values, metas))

    async def tier_get() -> None:
        got = await tier.get(keys)
        assert all(g is not None for g in got)

    variants = [("raw", raw_put, raw_get), ("chunked", chunked_put, chunked_get), ("tier", tier_put, tier_get)]
    samples: dict[str, list[float]] = {f"{who}_{op}": [] for who, _, _ in variants for op in ("put", "get")}
    try:
        for _, put, get in variants:  # warm-up: connections, CONFIG GET
            await put()
            await get()
        for rep in range(repeats):
            order = variants[rep % 3 :] + variants[: rep % 3]  # rotate who goes first, so drift hits all alike
            for who, put, get in order:
                samples[f"{who}_put"].append(await timed(put()))
                samples[f"{who}_get"].append(await timed(get()))
        assert await tier.get(keys) == values
        counters = tier.counters()
    finally:
        await tier.close()
        await raw.aclose()
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    best_put, best_get = max(gbps["raw_put"], gbps["chunked_put"]), max(gbps["raw_get"], gbps["chunked_get"])
    return {
        "block_bytes": block_bytes, "num_blocks": num_blocks, "batch_bytes": nbytes, "repeats": repeats,
        **{f"{name}_GBps": value for name, value in gbps.items()},
        "put_ratio": gbps["tier_put"] / best_put, "get_ratio": gbps["tier_get"] / best_get,
        "put_ratio_to_one_pipeline": gbps["tier_put"] / gbps["raw_put"],
        "get_ratio_to_one_mget": gbps["tier_get"] / gbps["raw_get"],
        "tier_errors": counters["errors"], "tier_corrupt_records": counters["corrupt_records"],
    }


async def run(repeats: int) -> list[dict[str, object]]:
    rows = []
    with RedisProcess(maxmemory_bytes=1 << 30) as server:
        for block_bytes, num_blocks in CASES:
            rows.append(await bench_case(server.url, block_bytes, num_blocks, repeats))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed repeats per case (median is reported)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = asyncio.run(run(args.repeats))
    load_after = os.getloadavg()[0]
    command = "python benchmarks/bench_redis_tier.py" + (f" --repeats {args.repeats}" if args.repeats != 25 else "")
    lines = [
        "# Redis tier throughput against raw redis-py", "",
        f"Command: `{command}`", "",
        f"One local redis-server on loopback, persistence off; redis-py with hiredis={HIREDIS_AVAILABLE}; "
        f"median of {args.repeats} repeats, alternating tier and raw. Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before and "
        f"{load_after:.1f} after (other work shares the host, so single runs vary by about 10%).",
        "Raw = one non-transactional pipeline of SETs, one MGET (same values, same server); "
        "raw chunked = the same cut into 8 MiB pipelines / MGETs, one after another.",
        "Tier = RedisTier.put / get: 8 MiB chunks, checksum verified on every get.",
        "Ratio = tier / the faster raw variant (in brackets: tier / one pipeline or MGET).", "",
        "| block | batch | raw put | raw chunked put | tier put | put ratio | raw get | raw chunked get | tier get "
        f"| get ratio | goal (>= {GOAL_RATIO}x) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = True
    for r in rows:
        ok = r["put_ratio"] >= GOAL_RATIO and r["get_ratio"] >= GOAL_RATIO
        met &= ok
        lines.append(
            f"| {r['block_bytes'] // KiB} KiB | {r['num_blocks']} | {r['raw_put_GBps']:.2f} GB/s "
            f"| {r['chunked_put_GBps']:.2f} GB/s | {r['tier_put_GBps']:.2f} GB/s "
            f"| {r['put_ratio']:.3f} ({r['put_ratio_to_one_pipeline']:.2f}) | {r['raw_get_GBps']:.2f} GB/s "
            f"| {r['chunked_get_GBps']:.2f} GB/s | {r['tier_get_GBps']:.2f} GB/s "
            f"| {r['get_ratio']:.3f} ({r['get_ratio_to_one_mget']:.2f}) | {'met' if ok else 'MISSED'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_redis_tier.md").write_text(text)
    (RESULTS / "bench_redis_tier.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
