"""Lookup latency of a client fanned out over 3 kvstore nodes, as a ratio to the same lookup on 1 node.

Three real ``kvstore serve`` nodes (memory tier) run on loopback. The baseline is
a single-target client of node 0, which holds every block of its namespace; the
fan-out is a 3-target client (``KVStoreClient([...])``), whose blocks are spread
over the three nodes by rendezvous hashing, so a lookup of ``k`` hashes asks
each owner for its ~``k/3`` hashes in parallel and merges the prefixes. Both
look up the same number of cached hashes (1, 64, 1,024), one call at a time;
the two are called in turn so that each sees the same background load.

Reported per client kind (sync ``KVStoreClient``, asyncio ``AsyncKVStoreClient``)
and hash count: median and p90 latency of ``--lookups`` calls, and the ratio of
the medians (fan-out / one node). The client's own routing cost (``split`` of
the hashes by owner, with no I/O) is shown beside it.

Usage::

    python benchmarks/bench_fanout.py [--lookups 300] [--counts 1,64,1024]

Writes benchmarks/results/bench_fanout.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from kvstore.client import AsyncKVStoreClient, KVStoreClient  # noqa: E402
from kvstore.blocks.tensors import encode_block  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
NUM_NODES = 3
BLOCK_SIZE = 16


def make_blocks(ns: Namespace, num_blocks: int) -> tuple[list[bytes], list[bytes]]:
    """``num_blocks`` chained hashes and small encoded blocks (``[1, 2, 1, 16, 8]`` float16 each, 512 B of payload)."""
    import torch

    hashes = hash_blocks(ns, list(range(num_blocks * ns.block_size)))
    block = encode_block(torch.zeros(1, 2, 1, ns.block_size, 8, dtype=torch.float16), ns.layout)
    return list(hashes), [block] * num_blocks


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(one_s: list[float], fan_s: list[float]) -> dict[str, float]:
    """Median and p90 of both, milliseconds, and the ratio of the medians."""
    one_ms, fan_ms = statistics.median(one_s) * 1e3, statistics.median(fan_s) * 1e3
    return {
        "one_node_median_ms": one_ms, "one_node_p90_ms": percentile(one_s, 0.9) * 1e3,
        "fanout_median_ms": fan_ms, "fanout_p90_ms": percentile(fan_s, 0.9) * 1e3,
        "ratio": fan_ms / one_ms,
    }


def bench_sync(one: KVStoreClient, fan: KVStoreClient, ns_one: Namespace, ns_fan: Namespace,
               hashes_one: list[bytes], hashes_fan: list[bytes], count: int, num_calls: int) -> dict[str, float]:
    """Alternate single-node and fan-out lookups of ``count`` cached hashes; ``num_calls`` of each."""
    keys_one, keys_fan = hashes_one[:count], hashes_fan[:count]
    one_s: list[float] = []
    fan_s: list[float] = []
    for _ in range(10):  # warm-up
        one.lookup(ns_one, keys_one), fan.lookup(ns_fan, keys_fan)
    for _ in range(num_calls):
        for client, ns, keys, out in ((one, ns_one, keys_one, one_s), (fan, ns_fan, keys_fan, fan_s)):
            started = time.perf_counter()
            result = client.lookup(ns, keys)
            out.append(time.perf_counter() - started)
            assert result.num_blocks == count, (result.num_blocks, count)
    return summarize(one_s, fan_s)


async def bench_async(one: AsyncKVStoreClient, fan: AsyncKVStoreClient, ns_one: Namespace, ns_fan: Namespace,
                      hashes_one: list[bytes], hashes_fan: list[bytes], count: int,
                      num_calls: int) -> dict[str, float]:
    """The asyncio twin of :func:`bench_sync`."""
    keys_one, keys_fan = hashes_one[:count], hashes_fan[:count]
    one_s: list[float] = []
    fan_s: list[float] = []
    for _ in range(10):
        await one.lookup(ns_one, keys_one)
        await fan.lookup(ns_fan, keys_fan)
    calls: tuple[tuple[Callable[[], Awaitable[object]], list[float]], ...] = (
        (lambda: one.lookup(ns_one, keys_one), one_s), (lambda: fan.lookup(ns_fan, keys_fan), fan_s))
    for _ in range(num_calls):
        for call, out in calls:
            started = time.perf_counter()
            result = await call()
            out.append(time.perf_counter() - started)
            assert result.num_blocks == count  # type: ignore[attr-defined]
    return summarize(one_s, fan_s)


def routing_cost_us(fan: KVStoreClient, hashes: list[bytes], count: int, repeats: int = 200) -> float:
    """Median time of the client's split of ``count`` hashes by owner, microseconds (no I/O)."""
    keys = hashes[:count]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fan.router.split(keys)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=300, help="calls per cell and client (default 300)")
    parser.add_argument("--counts", default="1,64,1024", help="hashes per lookup (default 1,64,1024)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_fanout", help="results path without suffix")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    max_count = max(counts)
    load_before = os.getloadavg()[0]

    nodes = [KVNode(memory_capacity="256MiB", metrics=False) for _ in range(NUM_NODES)]
    rows: list[dict[str, object]] = []
    try:
        for node in nodes:
            node.start()
        targets = [node.target for node in nodes]
        ns_one = Namespace(model="bench-fanout-one", block_size=BLOCK_SIZE)
        ns_fan = Namespace(model="bench-fanout-three", block_size=BLOCK_SIZE)
        hashes_one, blocks_one = make_blocks(ns_one, max_count)
        hashes_fan, blocks_fan = make_blocks(ns_fan, max_count)
        with KVStoreClient(targets[0], timeout_s=60) as one, KVStoreClient(targets, timeout_s=60) as fan:
            one.put(ns_one, hashes_one, blocks_one)
            fan.put(ns_fan, hashes_fan, blocks_fan)
            spread = {t: sum(1 for h in hashes_fan if fan.router.owner(h) == t) for t in targets}
            for count in counts:
                row: dict[str, object] = {"client": "sync", "hashes": count,
                                          **bench_sync(one, fan, ns_one, ns_fan, hashes_one, hashes_fan, count,
                                                       args.lookups),
                                          "routing_us": routing_cost_us(fan, hashes_fan, count)}
                rows.append(row)
                print(json.dumps(row), flush=True)

        async def run_async() -> None:
            async with AsyncKVStoreClient(targets[0], timeout_s=60) as one, \
                    AsyncKVStoreClient(targets, timeout_s=60) as fan:
                for count in counts:
                    row: dict[str, object] = {"client": "async", "hashes": count,
                                              **await bench_async(one, fan, ns_one, ns_fan, hashes_one, hashes_fan,
                                                                  count, args.lookups)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)

        asyncio.run(run_async())
    finally:
        for node in nodes:
            node.close()

    command = "python benchmarks/bench_fanout.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    meta = {
        "command": command, "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0],
        "lookups_per_cell": args.lookups, "num_nodes": NUM_NODES, "blocks_per_node": spread,
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "lookup": rows}, indent=2) + "\n")
    lines = [
        "# Lookup fanned out over 3 nodes vs. 1 node",
        "",
        f"Command: `{command}`",
        "",
        f"Three `kvstore serve` nodes (memory tier) on loopback, and the client, on one host: Python "
        f"{meta['python']}, {meta['machine']}, {meta['cpus']} CPUs, 1-min load average {load_before:.1f} before and "
        f"{meta['load_avg_1m_after']:.1f} after (other work may share the host). One call at a time, "
        f"{args.lookups} calls per cell, one-node and fan-out calls alternating. One node: a single-target client of "
        f"node 0 holding every block. Fan-out: a 3-target client; blocks per node {list(spread.values())} of "
        f"{max_count}; each owner is asked for its own hashes in parallel (the sync client runs all but one on "
        "worker threads). Ratio = fan-out median / one-node median. Routing = the client's split of the hashes by "
        "owner (rendezvous, xxh3-64), included in the fan-out latency.",
        "",
        f"Reading: each owner pays a node's fixed per-call cost, and the sub-calls run in parallel only as far as "
        f"the CPUs allow; here the client and the three nodes share {meta['cpus']} CPUs, so the fan-out rows are an "
        "upper bound for nodes on their own hosts. With one hash only its owner is asked (no fan-out).",
        "",
        "| client | hashes | 1 node median | 1 node p90 | 3 nodes median | 3 nodes p90 | ratio | routing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        routing = f"{row['routing_us']:.0f} us" if "routing_us" in row else "(same)"
        lines.append(
            f"| {row['client']} | {row['hashes']:,} | {row['one_node_median_ms']:.3f} ms | "
            f"{row['one_node_p90_ms']:.3f} ms | {row['fanout_median_ms']:.3f} ms | {row['fanout_p90_ms']:.3f} ms | "
            f"{row['ratio']:.2f} | {routing} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
