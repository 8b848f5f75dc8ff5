"""How a same-host Put can become a block nothing but the node can change: the choices of issue 38, measured.

A stored block must never change after its Put returned, whoever holds the
memory it was written into. Two ways give that with ``memfd`` segments
(``kvstore.shm.segment``):

* **seal what the client wrote**: each Put is written into a fresh ``memfd``,
  which the node seals with ``F_SEAL_WRITE`` once the client has unmapped it,
  and keeps as it is: one copy (the client's), but into pages first touched;
* **the node copies once**: the client writes into its Put segment (warm pages
  it reuses), and the node copies each block into warm pages of its pool
  (``kvstore.shm.node.pool``), which it sealed with ``F_SEAL_FUTURE_WRITE``.

Every figure is a ratio against one ``Tensor.copy_`` of the same 24 MiB
between two warm CPU tensors, timed in the same run (median of ``--reps``),
and each step is timed as the path would run it.

Usage::

    python benchmarks/bench_put_choices.py [--reps 15] [--out benchmarks/results/shm_put_choices]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
NBYTES = 24 * MiB


def _median_s(step: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "shm_put_choices"))
    args = parser.parse_args()

    import numpy as np
    import torch
    import xxhash

    from kvstore.shm.segment import Segment

    source = torch.randint(0, 255, (NBYTES,), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    copy_s = _median_s(lambda: target.copy_(source), args.reps)

    warm = Segment.create("kvstore-bench-warm", NBYTES)
    warm_bytes = torch.frombuffer(warm.view, dtype=torch.uint8)
    warm_bytes.copy_(source)
    pool = Segment.create("kvstore-bench-pool", NBYTES)
    pool_array = np.frombuffer(pool.view, dtype=np.uint8)
    staged = np.frombuffer(warm.view, dtype=np.uint8)
    np.copyto(pool_array, staged)

    def fresh_and_seal() -> None:  # the client writes into fresh pages; the node seals them
        fd = os.memfd_create("kvstore-bench-fresh", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, NBYTES)
        mapping = mmap.mmap(fd, NBYTES)
        torch.frombuffer(mapping, dtype=torch.uint8).copy_(source)
        mapping.close()
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        os.close(fd)

    def checksum_blocks(view: memoryview) -> None:
        for offset in range(0, NBYTES, 256 * 1024):
            xxhash.xxh3_64_intdigest(view[offset:offset + 256 * 1024])

    steps = {
        "client copy into its warm Put segment": lambda: warm_bytes.copy_(source),
        "checksum of 96 blocks of 256 KiB": lambda: checksum_blocks(warm.view),
        "node copy into warm pool pages (numpy, one thread)": lambda: np.copyto(pool_array, staged),
        "client copy into fresh memfd pages, then F_SEAL_WRITE": fresh_and_seal,
    }
    figures = {name: _median_s(step, args.reps) / copy_s for name, step in steps.items()}
    node_copy = (figures["client copy into its warm Put segment"] + figures["checksum of 96 blocks of 256 KiB"] * 2
                 + figures["node copy into warm pool pages (numpy, one thread)"])
    sealed = figures["client copy into fresh memfd pages, then F_SEAL_WRITE"] + \
        figures["checksum of 96 blocks of 256 KiB"] * 2
    result = {"bytes": NBYTES, "copy_ms": copy_s * 1e3, "steps_x_copy": figures,
              "path_x_copy": {"node copies once (kvstore)": node_copy, "seal what the client wrote": sealed},
              "reps": args.reps, "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
              "machine": platform.platform(), "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Same-host Put: the node copies once, or the client's pages are sealed (issue 38)", "",
             f"`{result['command']}`, load average {', '.join(f'{x:.2f}' for x in result['load_average'])}, "
             f"{result['machine']}; one `copy_` of 24 MiB took {copy_s * 1e3:.2f} ms "
             f"({result['torch_threads']} torch threads).", "",
             "| step | × one `copy_` |", "|---|---:|"]
    lines += [f"| {name} | {x:.2f} |" for name, x in figures.items()]
    lines += ["", "| the whole Put (each step in turn, checksums on both sides) | × one `copy_` |", "|---|---:|"]
    lines += [f"| {name} | {x:.2f} |" for name, x in result["path_x_copy"].items()]
    lines += ["", "Pages first touched cost a page fault each (about a microsecond on this machine), which a "
              "fresh segment per Put pays on every Put; a pool's pages are touched once and reused, so kvstore's "
              "node copies once into them (``kvstore.shm.node.pool``)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    warm.close()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
