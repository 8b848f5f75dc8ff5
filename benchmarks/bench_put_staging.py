"""Whether a same-host Put's staging pays for one pass: copy-then-checksum per block against a chunked copy that
checksums each chunk while it is in cache (issue 33, "stage puts with one pass").

The client stages a Put (``kvstore.blocks.copying.encode_into``) by copying each tensor's payload into its put
segment and then computing the header's xxh3-64 checksum over that copy: two reads of the payload, the second
from a copy just written. This times, in one run and interleaved, on an anonymous mapping the size of the
64 x 256 KiB batch of ``bench_shm.py``:

* ``two_pass``: what ``encode_into`` does (one ``copy_`` per block, then one xxh3 over it);
* ``chunked_64k`` / ``chunked_32k``: copy and checksum each 64 / 32 KiB chunk in turn (one pass in cache
  terms, more calls);
* ``hash_source``: checksum the caller's tensor, then copy.

Run: ``python benchmarks/bench_put_staging.py [--rounds N]`` (prints medians and minima, ms, and the load).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import torch
import xxhash

NUM_BLOCKS = 64
SHAPE = (8, 2, 4, 16, 128)  # float16: 256 KiB of payload per block


def main() -> None:
    """Time the staging variants and print each one's median and minimum (ms) and the load average."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    blocks = [torch.randn(SHAPE).half() for _ in range(NUM_BLOCKS)]
    nbytes = blocks[0].numel() * blocks[0].element_size()
    segment = mmap.mmap(-1, NUM_BLOCKS * nbytes)
    view, raw = memoryview(segment), torch.frombuffer(segment, dtype=torch.uint8)

    def two_pass() -> None:
        for i, block in enumerate(blocks):
            start = i * nbytes
            raw[start:start + nbytes].view(torch.float16).view(SHAPE).copy_(block)
            xxhash.xxh3_64(view[start:start + nbytes]).intdigest()

    def chunked(chunk: int) -> None:
        for i, block in enumerate(blocks):
            start, source = i * nbytes, block.view(-1).view(torch.uint8)
            digest = xxhash.xxh3_64()
            for offset in range(0, nbytes, chunk):
                raw[start + offset:start + offset + chunk].copy_(source[offset:offset + chunk])
                digest.update(view[start + offset:start + offset + chunk])
            digest.intdigest()

    def hash_source() -> None:
        for i, block in enumerate(blocks):
            start = i * nbytes
            xxhash.xxh3_64(memoryview(block.numpy()).cast("B")).intdigest()
            raw[start:start + nbytes].view(torch.float16).view(SHAPE).copy_(block)

    ops = {"two_pass": two_pass, "chunked_64k": lambda: chunked(64 << 10), "chunked_32k": lambda: chunked(32 << 10),
           "hash_source": hash_source}
    times: dict[str, list[float]] = {name: [] for name in ops}
    load_start = os.getloadavg()
    for _ in range(args.rounds):
        for name, op in ops.items():
            started = time.perf_counter()
            op()
            times[name].append((time.perf_counter() - started) * 1e3)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} ms, min {min(values):.2f} ms")
    print(f"load average {load_start} before, {os.getloadavg()} after")


if __name__ == "__main__":
    main()
