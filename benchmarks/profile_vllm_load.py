"""Where a kvstore hit's time goes in the vLLM connector: lookup, get, checks and the scatter into the paged cache.

``bench_vllm_ttft.py`` times whole requests in real engines; this script times,
without vLLM, each step the connector takes for the same hit: the 1,536 cached
tokens of a 2,048-token prompt (48 blocks of 32 tokens of the demo's Llama:
8 layers, 4 KV heads of 64 channels) through

* ``hash``:    the scheduler's chained block hashes of the prompt (``kvstore.keys.hash_blocks``);
* ``lookup``:  its Lookup of those hashes, to a ``kvstore serve`` node over loopback;
* ``get``:     the worker's Get of the 48 blocks, from the node, and from an embedded store;
* ``check``:   the worker's checks of each block (checksum, header) and its decode (a view, no copy);
* ``scatter``: the copy into vLLM's CPU paged cache (``PagedKV.scatter`` on the CPU
               backend's ``[num_blocks, H, 2N, D]`` pages, read through the connector's canonical view).

Steps are interleaved rep by rep, so load on this shared machine hits them alike; the table
gives the minimum and the median per step, in milliseconds. ``memcpy`` is one ``Tensor.copy_``
of the same bytes, the floor of any copy.

    .venv/bin/python benchmarks/profile_vllm_load.py                 # ~1 min
    .venv/bin/python benchmarks/profile_vllm_load.py --dtype bfloat16

Writes ``benchmarks/results/profile_vllm_load.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codec import decode_block, dtype_name, verify_block  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.connectors.vllm.layout import KVFamily, PagedKV, PageFormat, canonical_view  # noqa: E402
from kvstore.embedded import open_store  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 32


def paged(num_units: int, dtype: torch.dtype) -> PagedKV:
    """A CPU-backend paged cache: per layer ``[num_units, H, 2N, D]`` seen as vLLM's ``[num_units, H, N, 2D]``."""
    fmt = PageFormat(backend="CPU_ATTN", family=KVFamily.SPLIT_TOKENS.value, interior="cpu_attn:isa=vec",
                     num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, unit_tokens=BLOCK,
                     dtype=dtype_name(dtype), cache_dtype="auto")
    views = [canonical_view(torch.zeros(num_units, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype),
                            KVFamily.SPLIT_TOKENS, KV_HEADS, HEAD_DIM, BLOCK) for _ in range(LAYERS)]
    return PagedKV(fmt, views, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--cached-tokens", type=int, default=1536)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default=str(RESULTS / "profile_vllm_load"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    num_blocks = args.cached_tokens // BLOCK
    namespace = Namespace(model="bench/profile_vllm_load", dtype=args.dtype, block_size=BLOCK)
    tokens = [(i * 7919) % 251 + 1 for i in range(args.prompt_tokens)]
    hashes = hash_blocks(namespace, tokens[: args.cached_tokens])
    blocks = [torch.randn(LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM).to(dtype) for _ in range(num_blocks)]
    nbytes = sum(b.numel() * b.element_size() for b in blocks)
    cache = paged(4 * num_blocks, dtype)
    units = list(range(num_blocks, 2 * num_blocks))
    flat_src, flat_dst = torch.cat([b.flatten() for b in blocks]), torch.empty(nbytes // blocks[0].element_size(), dtype=dtype)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())

    node = KVNode(memory_capacity="1GiB", metrics=False).start()
    client = KVStoreClient([node.target], timeout_s=30)
    embedded = open_store(StoreConfig())
    try:
        client.put(namespace, hashes, blocks)
        embedded.put(namespace, hashes, blocks)
        fetched = client.get(namespace, hashes)
        assert len(fetched) == num_blocks
        decoded = [decode_block(b, verify=False) for b in fetched]

        def check() -> None:
            for buffer in fetched:
                verify_block(buffer)
                decode_block(buffer, verify=False)

        steps: dict[str, Callable[[], object]] = {
            "hash (scheduler)": lambda: hash_blocks(namespace, tokens),
            "lookup, kvstore serve": lambda: client.lookup(namespace, hashes),
            "get, kvstore serve": lambda: client.get(namespace, hashes),
            "get, embedded": lambda: embedded.get(namespace, hashes),
            "check + decode": check,
            "scatter into paged cache": lambda: cache.scatter(units, decoded, 1),
            "memcpy (Tensor.copy_)": lambda: flat_dst.copy_(flat_src),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for name, step in steps.items():  # warm-up
            step()
        for _ in range(args.reps):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        # the scatter wrote what the store holds
        got = cache.gather(units, 1)
        assert all(torch.equal(got[i], blocks[i]) for i in range(num_blocks)), "scatter wrote wrong bytes"
    finally:
        client.close()
        embedded.close()
        node.close()
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report(args, times, nbytes, num_blocks, load_before, load_after)


def report(args: argparse.Namespace, times: dict[str, list[float]], nbytes: int, num_blocks: int,
           load_before: str, load_after: str) -> None:
    rows = [{"step": name, "min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v),
             "gb_per_s_min": nbytes / min(v) / 1e9} for name, v in times.items()]
    command = "python benchmarks/profile_vllm_load.py" + (f" --dtype {args.dtype}" if args.dtype != "float32" else "") \
        + (f" --reps {args.reps}" if args.reps != 30 else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "command": command, "host": platform.platform(), "cpus": os.cpu_count(), "dtype": args.dtype,
        "blocks": num_blocks, "bytes": nbytes, "load_average_before": load_before, "load_average_after": load_after,
        "rows": rows}, indent=2) + "\n")
    lines = [
        "# profile_vllm_load: where a kvstore hit's time goes in the vLLM connector",
        "",
        f"Command (repo root, from `.venv`): `{command}`",
        "",
        f"{num_blocks} blocks of {BLOCK} tokens ({args.cached_tokens} cached tokens of a {args.prompt_tokens}-token "
        f"prompt), {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} channels, {args.dtype}: {nbytes / 2**20:.0f} MiB. "
        f"{args.reps} reps, steps interleaved. Host: {platform.platform()}, {os.cpu_count()} CPUs, shared: "
        f"load average (1/5/15 min) {load_before} before, {load_after} after.",
        "",
        "| step | min (ms) | median (ms) | GB/s (min) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['step']} | {r['min_ms']:.2f} | {r['median_ms']:.2f} | {r['gb_per_s_min']:.2f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
