"""Stored bytes per block of each KV encoding in each tier, as the tiers account for them, beside the encoding's own
size (issue 41: "the footprint each encoding promises holds in every tier").

For each encoding (and exact blocks), ``--blocks`` blocks of a model's shape are
put, then each tier's own accounting is read:

* memory, embedded: ``EmbeddedStore(...).stats().tier("memory").bytes`` (the page pool's pages);
* memory, served: a real ``kvstore serve`` node's ``stats()``, over gRPC;
* LMDB: a disk-only embedded store's ``stats().tier("disk").bytes`` (records as the tier counts them);
* Redis: ``MEMORY USAGE`` of each block's key in a real ``redis-server`` (Redis's own accounting).

Each figure is per block, and over the exact bfloat16 block (header included).
Two shapes: Llama-3-8B's 2 MiB blocks and a small model's (``[12, 2, 2, 16, 64]``,
96 KiB), where a pool's page rounding shows.

    python benchmarks/bench_encoding_footprint.py [--blocks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.blocks.tensors import encode_block  # noqa: E402
from kvstore.config import DiskTierConfig, MemoryTierConfig, RedisTierConfig, StoreConfig  # noqa: E402
from kvstore.embedded import EmbeddedStore  # noqa: E402
from kvstore.blocks.encoding import Encoding, encode_lossy  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402
from tests.support.redis import RedisProcess  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"Llama-3-8B": (32, 2, 8, 16, 128), "small (96 KiB)": (12, 2, 2, 16, 64)}
GOALS = {"int8": 0.52, "int8_v2": 0.52, "fp8_e4m3": 0.52, "int4": 0.28, "int4_v2": 0.28}


def _blocks(shape: tuple[int, ...], count: int, encoding: str) -> list[bytes | bytearray]:
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(count)]
    return [encode_lossy(t, "kv", encoding) if encoding else encode_block(t) for t in tensors]


def _namespace(shape: tuple[int, ...], encoding: str) -> Namespace:
    return Namespace(model=f"footprint-{'x'.join(map(str, shape))}", dtype="bfloat16", block_size=shape[3],
                     kv_encoding=encoding)


def measure(shape: tuple[int, ...], encoding: str, count: int, node_target: str, redis: RedisProcess,
            scratch: Path) -> dict[str, float]:
    """Bytes per block in each tier for ``count`` blocks of ``encoding`` (``""``: exact)."""
    ns = _namespace(shape, encoding)
    blocks = _blocks(shape, count, encoding)
    hashes = hash_blocks(ns, range(count * shape[3]))
    total = sum(len(b) for b in blocks) * 4
    row = {"encoding": encoding or "exact", "block_bytes": sum(len(b) for b in blocks) / count}
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=total + (64 << 20)))) as store:
        assert store.put(ns, hashes, blocks) == count
        tier = store.stats().tier("memory")
        row["memory_embedded"] = tier.bytes / tier.blocks
    with KVStoreClient(node_target, retries=0, timeout_s=120.0) as client:
        before = client.stats().tier("memory")
        assert client.put(ns, hashes, blocks) == count
        after = client.stats().tier("memory")
        row["memory_served"] = (after.bytes - before.bytes) / (after.blocks - before.blocks)
        client.clear(ns)
    disk = scratch / f"disk-{encoding or 'exact'}-{shape[0]}"
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=0),
                                   disk=DiskTierConfig(path=str(disk), capacity_bytes=total + (256 << 20)))) as store:
        assert store.put(ns, hashes, blocks) == count
        store.drain()
        tier = store.stats().tier("disk")
        row["lmdb"] = tier.bytes / tier.blocks
    client = redis.client()
    client.flushall()
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=total + (64 << 20)),
                                   redis=RedisTierConfig(url=redis.url, mode="write_through"))) as store:
        assert store.put(ns, hashes, blocks) == count
        store.drain()
    keys = [k for k in client.scan_iter(match=f"*:{ns.tag.hex()}:*") if not k.endswith(b":generation")]
    assert len(keys) == count, len(keys)
    row["redis"] = sum(client.memory_usage(k, samples=0) for k in keys) / count
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    encodings = [""] + [e.value for e in Encoding]
    results: dict[str, list[dict[str, float]]] = {}
    redis = RedisProcess(maxmemory_bytes=2 << 30).start()
    try:
        with tempfile.TemporaryDirectory() as scratch, KVNode(memory_capacity="1GiB") as node:
            for name, shape in SHAPES.items():
                results[name] = [measure(shape, e, args.blocks, node.target, redis, Path(scratch)) for e in encodings]
    finally:
        redis.stop()
    load = os.getloadavg()[0]
    command = f"python benchmarks/bench_encoding_footprint.py --blocks {args.blocks}"
    lines = ["# Lossy KV encodings: stored bytes per block in each tier", "",
             f"`{command}` (load average {load:.2f}, shared 2-core machine). Each tier's own accounting, per block, "
             "and over the exact bfloat16 block; bfloat16 blocks of 16 tokens.", ""]
    for name, rows in results.items():
        exact = rows[0]["block_bytes"]
        lines += [f"## {name}, `{list(SHAPES[name])}`: exact block {exact:,.0f} bytes", "",
                  "| encoding | the encoding's size | memory, embedded | memory, served | LMDB | Redis | goal |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows:
            cells = [f"{row[k]:,.0f} ({row[k] / exact:.3f}×)" for k in
                     ("block_bytes", "memory_embedded", "memory_served", "lmdb", "redis")]
            goal = GOALS.get(row["encoding"])
            verdict = "" if goal is None else f"≤ {goal}× " + (
                "✔" if max(row[k] for k in ("memory_embedded", "memory_served", "lmdb", "redis")) / exact <= goal
                else "✘")
            lines.append(f"| {row['encoding']} | " + " | ".join(cells) + f" | {verdict} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_encoding_footprint.md").write_text(text)
    (RESULTS / "bench_encoding_footprint.json").write_text(json.dumps(
        {"command": command, "load": load, "shapes": {k: list(v) for k, v in SHAPES.items()}, "results": results},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
