"""SGLang's HiCache storage tier: kvstore's ``batch_set_v1`` / ``batch_get_v1`` of 64 pages against ``Tensor.copy_``
and SGLang's own file backend (``HiCacheFile``), in one run on one host (issue 30).

The pages live in a real ``MHATokenToKVPoolHost`` (``page_first``, bfloat16, 16
tokens, 8 layers, 4 KV heads of 128: 256 KiB a page, 16 MiB the batch) on CPU.
Per round, in a fresh random order, each op runs once and is timed:

* ``copy_``: one ``Tensor.copy_`` of the batch's 16 MiB between two CPU tensors (the baseline);
* ``kvstore get_v1`` / ``set_v1``: the backend over one ``kvstore serve`` node on this
  host (the same-host data plane), and over an embedded store;
* ``HiCacheFile get`` / ``set``: SGLang's file backend (0.5.23) on a temporary
  directory, driven as SGLang's cache controller drives it (``_generic_page_get``:
  ``batch_get`` into flat pages, then ``set_from_flat_data_page``; ``_generic_page_set``:
  ``get_data_page`` per page, then ``batch_set``).

Every write names new keys (HiCacheFile skips a key it has; kvstore does too).
Figures are medians; goals: ``get_v1`` and ``set_v1`` >= 0.3x ``copy_``, and faster than HiCacheFile.
Every read is checked to return the bytes written before timing.

Usage (from ``.venv-sglang``)::

    python benchmarks/bench_sglang.py [--rounds 30] [--out benchmarks/results/bench_sglang]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

NUM_PAGES = 64
GOAL_VS_COPY = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_sglang"))
    args = parser.parse_args()

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from kvstore import open_store
    from kvstore.config import StoreConfig
    from kvstore.connectors.sglang import KVStoreHiCacheStorage
    from tests.connectors.sglang.harness import fill_random, host_indices, mha_pool, page_keys, storage_config
    from tests.support.kvnode import KVNode

    load_start = os.getloadavg()
    torch.set_num_threads(1)
    page = 16
    pool = mha_pool("page_first", torch.bfloat16, page_size=page, num_layers=8, num_heads=4, head_dim=128,
                    device_pages=NUM_PAGES)
    fill_random(pool, seed=0)
    src = host_indices(0, NUM_PAGES, page)
    dst = host_indices(NUM_PAGES, NUM_PAGES, page)
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
    batch_bytes = NUM_PAGES * page_bytes
    copy_src = torch.randn(batch_bytes // 2).to(torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)

    counter = iter(range(1 << 30))

    def fresh_keys() -> list[str]:
        return page_keys(NUM_PAGES, page, first_token=next(counter) * NUM_PAGES * page)

    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp, \
            KVNode(memory_capacity="1GiB", metrics=False) as node, \
            open_store(StoreConfig()) as embedded:
        backends = {
            "node": KVStoreHiCacheStorage(storage_config({"target": node.target, "timeout_s": 30.0}), {}),
            "embedded": KVStoreHiCacheStorage(storage_config(), {}, store=embedded),
        }
        for storage in backends.values():
            storage.register_mem_pool_host(pool)
        files = HiCacheFile(storage_config({"file_storage_path": os.path.join(tmp, "hicache")}))
        read_keys = fresh_keys()
        for storage in backends.values():
            assert all(storage.batch_set_v1(read_keys, src))
        files.batch_set(read_keys, [pool.get_data_page(int(src[i * page])) for i in range(NUM_PAGES)])
        want = pool.kv_buffer[:, :NUM_PAGES * page].clone()
        for name, storage in backends.items():  # checked before timing: the bytes written come back
            pool.kv_buffer[:, NUM_PAGES * page:2 * NUM_PAGES * page].zero_()
            assert all(storage.batch_get_v1(read_keys, dst)), name
            assert torch.equal(pool.kv_buffer[:, NUM_PAGES * page:2 * NUM_PAGES * page], want), name

        def file_get() -> None:
            pages = files.batch_get(read_keys, [pool.get_dummy_flat_data_page() for _ in read_keys])
            for i, data in enumerate(pages):
                pool.set_from_flat_data_page(int(dst[i * page]), data)

        def file_set() -> None:
            keys = fresh_keys()
            files.batch_set(keys, [pool.get_data_page(int(src[i * page])) for i in range(NUM_PAGES)])

        def v1_get(storage: KVStoreHiCacheStorage) -> Callable[[], None]:
            return lambda: storage.batch_get_v1(read_keys, dst)

        def v1_set(storage: KVStoreHiCacheStorage) -> Callable[[], None]:
            return lambda: storage.batch_set_v1(fresh_keys(), src)

        file_get()
        assert torch.equal(pool.kv_buffer[:, NUM_PAGES * page:2 * NUM_PAGES * page], want), "HiCacheFile"
        ops: dict[str, Callable[[], object]] = {
            "copy_": lambda: copy_dst.copy_(copy_src),
            "kvstore node get_v1": v1_get(backends["node"]),
            "kvstore node set_v1": v1_set(backends["node"]),
            "kvstore embedded get_v1": v1_get(backends["embedded"]),
            "kvstore embedded set_v1": v1_set(backends["embedded"]),
            "HiCacheFile get": file_get,
            "HiCacheFile set": file_set,
        }
        times: dict[str, list[float]] = {name: [] for name in ops}
        for op in ops.values():  # warm-up
            op()
        for _ in range(args.rounds):
            order = list(ops)
            random.shuffle(order)
            for name in order:
                started = time.perf_counter()
                ops[name]()
                times[name].append(time.perf_counter() - started)
        errors = {name: s.stats().errors for name, s in backends.items()}
        for storage in backends.values():
            storage.close()
    load_end = os.getloadavg()

    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    copy_ms = median_ms["copy_"]
    rows = []
    for name, ms in median_ms.items():
        rows.append({"op": name, "median_ms": round(ms, 3), "gib_per_s": round(batch_bytes / (ms / 1e3) / (1 << 30), 2),
                     "vs_copy": round(copy_ms / ms, 4)})
    goals = {}
    for where in ("node", "embedded"):
        for kind, file_op in (("get", "HiCacheFile get"), ("set", "HiCacheFile set")):
            ms = median_ms[f"kvstore {where} {kind}_v1"]
            goals[f"{where} {kind}_v1"] = {"vs_copy": round(copy_ms / ms, 4),
                                           "vs_file": round(median_ms[file_op] / ms, 3),
                                           "met": copy_ms / ms >= GOAL_VS_COPY and ms < median_ms[file_op]}
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    result = {"command": command, "rounds": args.rounds, "num_pages": NUM_PAGES, "page_bytes": page_bytes,
              "load_average_start": load_start, "load_average_end": load_end, "host": platform.node(),
              "python": platform.python_version(), "torch": torch.__version__, "rows": rows, "goals": goals,
              "errors": errors}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# SGLang HiCache storage: kvstore v1 pair vs `Tensor.copy_` and HiCacheFile", "",
             f"Command: `{command}` (from `.venv-sglang`, under the heavy lock; {args.rounds} rounds, medians).",
             f"{NUM_PAGES} pages of {page_bytes // 1024} KiB (page_first MHA, bfloat16) = "
             f"{batch_bytes >> 20} MiB per call. Load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} "
             "(2 cores, shared).", "",
             "| op | median ms | GiB/s | vs copy_ |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['median_ms']} | {r['gib_per_s']} | {r['vs_copy']:.4f}x |" for r in rows]
    lines += ["", "| goal: >= 0.3x copy_ and faster than HiCacheFile | vs copy_ | vs HiCacheFile | |",
              "|---|---|---|---|"]
    lines += [f"| {name} | {g['vs_copy']:.4f}x | {g['vs_file']}x | {'met' if g['met'] else 'MISSED'} |"
              for name, g in goals.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
