"""Lossy KV encodings: encode and decode throughput against one ``Tensor.copy_`` of the same bytes, and stored
bytes per block against bfloat16 (issue 28).

Blocks are Llama-3-8B's (``[32, 2, 8, block_size, 128]`` bf16); a batch of them,
larger than the caches, is encoded (``kvstore.encoding.encode_lossy``) and
decoded into caller tensors (``decode_block_into``, what ``get_into`` runs),
and the same logical bytes are copied with ``Tensor.copy_``, in the same run,
interleaved. A ratio of 0.5 means half copy's throughput. Threads: one, as
the copy.

    python benchmarks/bench_encodings.py [--blocks 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvstore.codec import decode_header, encode_block
from kvstore.encoding import Encoding, encode_lossy
from kvstore.encoding.blocks import decode_block_into

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = (32, 2, 8, 16, 128)


def _best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per batch (2 MiB each)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(SHAPE, generator=generator).to(torch.bfloat16) for _ in range(args.blocks)]
    copies = [torch.empty_like(b) for b in blocks]
    logical = sum(b.numel() * b.element_size() for b in blocks)
    rows = []
    for encoding in Encoding:
        encoded = [encode_lossy(b, "kv", encoding) for b in blocks]
        headers = [decode_header(e) for e in encoded]

        def copy() -> None:
            for source, target in zip(blocks, copies):
                target.copy_(source)

        def encode() -> None:
            for b in blocks:
                encode_lossy(b, "kv", encoding)

        def decode() -> None:
            for e, h, target in zip(encoded, headers, copies):
                decode_block_into(e, h, target)

        def clone() -> None:
            for source in blocks:
                source.clone()

        copy_s = min(_best(copy, args.reps) for _ in range(2))
        clone_s = _best(clone, args.reps)
        encode_s = _best(encode, args.reps)
        copy_s = min(copy_s, _best(copy, args.reps))
        decode_s = _best(decode, args.reps)
        copy_s = min(copy_s, _best(copy, args.reps))
        rows.append({"encoding": encoding.value, "copy_gbps": logical / copy_s / 1e9,
                     "clone_gbps": logical / clone_s / 1e9, "encode_vs_clone": clone_s / encode_s,
                     "decode_vs_clone": clone_s / decode_s,
                     "encode_gbps": logical / encode_s / 1e9, "decode_gbps": logical / decode_s / 1e9,
                     "encode_vs_copy": copy_s / encode_s, "decode_vs_copy": copy_s / decode_s})
    sizes = []
    for block_size in (16, 32, 64, 256):
        shape = (32, 2, 8, block_size, 128)
        x = torch.randn(shape, generator=generator).to(torch.bfloat16)
        exact = len(encode_block(x))
        sizes.append({"block_size": block_size, "bf16_bytes": exact,
                      **{e.value: len(encode_lossy(x, "kv", e)) / exact for e in Encoding}})
    load = os.getloadavg()[0]
    command = f"python benchmarks/bench_encodings.py --blocks {args.blocks} --reps {args.reps}"
    lines = [f"# Lossy KV encodings: throughput and bytes", "", f"`{command}` (1 thread; load {load:.2f}; "
             f"{args.blocks} Llama-3-8B blocks {list(SHAPE)} bf16, {logical / 2**20:.0f} MiB)", "",
             "| encoding | copy_ GB/s | clone() GB/s | encode GB/s | decode GB/s | encode / copy_ | decode / copy_ | "
             "encode / clone() | decode / clone() | goal (vs copy_) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "✔" if min(r["encode_vs_copy"], r["decode_vs_copy"]) >= 0.5 else "✘"
        lines.append(f"| {r['encoding']} | {r['copy_gbps']:.2f} | {r['clone_gbps']:.2f} | {r['encode_gbps']:.2f} | "
                     f"{r['decode_gbps']:.2f} | {r['encode_vs_copy']:.2f}× | {r['decode_vs_copy']:.2f}× | "
                     f"{r['encode_vs_clone']:.2f}× | {r['decode_vs_clone']:.2f}× | ≥ 0.5× {ok} |")
    lines += ["", "Stored bytes per block (header and scales included) against the exact bf16 block:", "",
              "| tokens per block | bf16 bytes | " + " | ".join(e.value for e in Encoding) + " |",
              "|---|---|" + "---|" * len(Encoding)]
    for s in sizes:
        lines.append(f"| {s['block_size']} | {s['bf16_bytes']:,} | "
                     + " | ".join(f"{s[e.value]:.3f}×" for e in Encoding) + " |")
    lines += ["", "Goals: fp8/int8 ≤ 0.52×, int4 ≤ 0.28× (int4's keys carry a float16 minimum and scale per "
              "channel per block: 32 bits over the block's tokens, so short blocks pay more)."]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_encodings.md").write_text(text)
    (RESULTS / "bench_encodings.json").write_text(json.dumps({"command": command, "load": load, "speed": rows,
                                                              "bytes": sizes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
