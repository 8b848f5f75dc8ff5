"""A same-host Get after the client was idle, against the same Get back to back, by ``release_after_s``.

The node gives a get segment's pages back to the kernel ``release_after_s``
after their lease ends (``kvstore.shm.node.sessions.SessionTable.reclaim``). A Get
into pages given back takes a fresh page fault per 4 KiB page as the node
writes them, so a worker whose hits are seconds apart pays that on every hit.
This runs two ``kvstore serve`` nodes in one run, one with the old 1 s and one
with the default, and times a 64 x 256 KiB ``get_into`` (16 MiB) back to back
and after an idle gap longer than 1 s; the ratio idle / back-to-back per node
is the figure (1.0: the idle costs nothing).

The gap is a ``time.sleep``: it is what is measured (a client with nothing to
do), not a wait for an event.

Usage::

    python benchmarks/bench_shm_idle.py [--hot 15] [--idle 6] [--gap-s 1.6] [--out benchmarks/results/bench_shm_idle]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

SHAPE = (8, 2, 4, 16, 128)  # [num_layers, 2, num_kv_heads, block_size, head_dim], float16: 256 KiB
NUM_BLOCKS = 64


def _run_node(release_after_s: float | None, hot: int, idle: int, gap_s: float) -> dict[str, object]:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.keys import Namespace, hash_blocks
    from tests.support.kvnode import KVNode

    ns = Namespace(model="bench-shm-idle", dtype="float16", block_size=SHAPE[3])
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randn(SHAPE, generator=generator).to(torch.float16) for _ in range(NUM_BLOCKS)]
    hashes = hash_blocks(ns, list(range(NUM_BLOCKS * SHAPE[3])))
    env = {} if release_after_s is None else {"KVSTORE_SHARED_MEMORY__RELEASE_AFTER_S": str(release_after_s)}
    with KVNode(memory_capacity="1GiB", metrics=False, env=env, extra_args=["--log-level", "WARNING"]) as node:
        client = KVStoreClient(node.target, timeout_s=60)
        try:
            assert client.put(ns, hashes, batch) == NUM_BLOCKS
            dest = torch.empty((NUM_BLOCKS, *SHAPE), dtype=torch.float16)
            views = list(dest.unbind(0))
            assert client.get_into(ns, hashes, views) == NUM_BLOCKS and torch.equal(dest, torch.stack(batch))
            assert client.shared_memory() == ("attached",), client.shared_memory()

            def timed() -> float:
                start = time.perf_counter()
                assert client.get_into(ns, hashes, views) == NUM_BLOCKS
                return (time.perf_counter() - start) * 1e3

            for _ in range(3):
                timed()
            hot_ms = [timed() for _ in range(hot)]
            idle_ms = []
            for _ in range(idle):
                time.sleep(gap_s)
                idle_ms.append(timed())
        finally:
            client.close()
    return {"release_after_s": release_after_s, "hot_ms": hot_ms, "idle_ms": idle_ms,
            "hot_median_ms": statistics.median(hot_ms), "idle_median_ms": statistics.median(idle_ms),
            "idle_over_hot": statistics.median(idle_ms) / statistics.median(hot_ms)}


def main() -> None:
    """Run both nodes, print the table, and write ``<out>.json`` and ``<out>.md`` when ``--out`` is given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hot", type=int, default=15, help="back-to-back Gets per node")
    parser.add_argument("--idle", type=int, default=6, help="Gets after an idle gap, per node")
    parser.add_argument("--gap-s", type=float, default=1.6, help="idle seconds before each of those Gets")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    from kvstore.config import SharedMemoryConfig

    default = SharedMemoryConfig().release_after_s
    load_start = os.getloadavg()
    rows = [_run_node(1.0, args.hot, args.idle, args.gap_s), _run_node(None, args.hot, args.idle, args.gap_s)]
    rows[1]["release_after_s"] = default
    load_end = os.getloadavg()
    command = "python benchmarks/bench_shm_idle.py" + "".join(
        f" {flag} {value}" for flag, value in (("--hot", args.hot), ("--idle", args.idle), ("--gap-s", args.gap_s)))
    lines = ["# bench_shm_idle: a same-host Get after an idle gap, against back to back", "",
             f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {os.cpu_count()} CPUs, shared; load average (1, 5, 15 min) "
             f"{', '.join(f'{x:.2f}' for x in load_start)} at the start, "
             f"{', '.join(f'{x:.2f}' for x in load_end)} at the end. 64 x 256 KiB blocks (16 MiB) `get_into` one "
             f"tensor through a same-host `kvstore serve`; idle gap {args.gap_s} s.", "",
             "| release_after_s | back to back, median ms | after the gap, median ms | after / back to back |",
             "|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['release_after_s']} | {row['hot_median_ms']:.2f} | {row['idle_median_ms']:.2f} | "
                     f"{row['idle_over_hot']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"command": command, "load_start": load_start, "load_end": load_end, "rows": rows}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
