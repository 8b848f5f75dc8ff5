"""Time to first token of a running SGLang server (CPU): a prefix read back from kvstore vs computed, and vs SGLang's
own ``HiCacheFile``, in one run (issue 44).

Per model, two SGLang 0.5.23 servers (``tests/connectors/sglang/server.py``: a
Qwen2 of random weights written from a config, bf16, 16-token pages,
``page_first``, ``--sleep-on-idle``) run side by side with the CPU test
scaffolding: one with kvstore's backend on a ``kvstore serve`` node on this host
(``docs/sglang.md``'s launch line), one with ``--hicache-storage-backend file`` on
a temporary folder. The models: the tests' ``tiny`` one (2 layers, hidden 128),
whose prefill is cheap, so its figures show the fixed costs of a storage hit;
and a ``small`` one (4 layers, hidden 512), whose prefill costs something. Each
round, in a fresh random order, each server gets a fresh prompt of
``--prompt-tokens`` token ids:

* **miss**: the prompt's first run, computed (SGLang's ``cached_tokens`` 0);
* then, once its pages are in storage (its backup thread writes them after the
  request; waited for), ``/flush_cache`` empties the device and host tiers;
* **hit**: the same prompt again, its prefix read from storage (checked: SGLang's
  ``cached_tokens_details.storage`` holds every full page, and the output token
  is the miss's).

A request asks for one token, so its latency (the HTTP round trip included) is
the time to first token. Figures are medians over the rounds. The machine is
shared: the load average is recorded.

Usage (from ``.venv-sglang``, this checkout on ``PYTHONPATH``)::

    python benchmarks/bench_sglang_ttft.py [--rounds 20] [--models tiny,small]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=1544, help="prompt length; SGLang's context is 2048")
    parser.add_argument("--models", default="tiny,small", help="which of the harness's models (server.TINY, SMALL)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_sglang_ttft"))
    args = parser.parse_args()

    import sglang

    from tests.connectors.sglang.server import SMALL, TINY, PAGE_SIZE, warm_page_hash

    shapes = {"tiny": TINY, "small": SMALL}
    stored_tokens = args.prompt_tokens // PAGE_SIZE * PAGE_SIZE
    if stored_tokens == args.prompt_tokens:
        stored_tokens -= PAGE_SIZE  # SGLang computes a prompt's last token itself: a full last page is not reused
    load_start = os.getloadavg()
    warm_page_hash()
    times = {name: measure(shapes[name], args.rounds, args.prompt_tokens, stored_tokens)
             for name in args.models.split(",")}
    load_end = os.getloadavg()

    median_ms = {model: {name: round(statistics.median(t) * 1e3, 1) for name, t in by_op.items()}
                 for model, by_op in times.items()}
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    result = {"command": command, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
              "stored_tokens": stored_tokens, "page_size": PAGE_SIZE, "load_average_start": load_start,
              "load_average_end": load_end, "host": platform.node(), "sglang": sglang.__version__,
              "models": {name: dataclasses.asdict(shapes[name]) for name in times}, "median_ms": median_ms,
              "times_ms": {model: {name: [round(t * 1e3, 1) for t in ts] for name, ts in by_op.items()}
                           for model, by_op in times.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# SGLang TTFT on CPU: a prefix from kvstore vs computed, vs SGLang's HiCacheFile", "",
             f"Command: `{command}` (from `.venv-sglang`; {args.rounds} rounds, medians). "
             f"SGLang {sglang.__version__} on CPU with the tests' CPU scaffolding, `--sleep-on-idle`; "
             f"{args.prompt_tokens}-token prompts, {stored_tokens} tokens ({stored_tokens // PAGE_SIZE} pages of "
             f"{PAGE_SIZE}) read back on a hit; one generated token per request (the HTTP round trip included). "
             f"Load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (2 cores, shared with other "
             "work).", "",
             "| model | server | miss ms | hit ms | hit / miss | kvstore hit / HiCacheFile hit |",
             "|---|---|---|---|---|---|"]
    for model, ms in median_ms.items():
        shape = shapes[model]
        page_kib = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * PAGE_SIZE * 2 // 1024
        label = f"{model} ({shape.num_layers} layers, hidden {shape.hidden_size}; {page_kib} KiB pages)"
        for name in ("kvstore", "HiCacheFile"):
            versus = f"{ms['kvstore hit'] / ms['HiCacheFile hit']:.3f}" if name == "kvstore" else ""
            lines.append(f"| {label} | {name} | {ms[f'{name} miss']} | {ms[f'{name} hit']} | "
                         f"{ms[f'{name} hit'] / ms[f'{name} miss']:.3f} | {versus} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def measure(shape: object, rounds: int, prompt_tokens: int, stored_tokens: int) -> dict[str, list[float]]:
    """Seconds of each miss and hit, per server (``kvstore`` and ``HiCacheFile``), for one model: see the module."""
    from tests.connectors.sglang.server import (
        SGLangServer, kvstore_config, kvstore_namespace, page_keys, prompt, wait_stored, write_qwen2)
    from tests.support.kvnode import KVNode
    from tests.support.waiting import wait_until

    seeds = iter(range(10_000, 1 << 30))
    times: dict[str, list[float]] = {f"{name} {kind}": [] for name in ("kvstore", "HiCacheFile")
                                     for kind in ("miss", "hit")}
    with tempfile.TemporaryDirectory(prefix="bench-sglang-ttft-") as tmp, \
            KVNode(memory_capacity="1GiB", metrics=False) as node:
        model = write_qwen2(Path(tmp) / "qwen2", shape=shape)
        for name in ("kvstore", "file"):
            (Path(tmp) / name).mkdir()
        servers = {"kvstore": SGLangServer(model, storage=kvstore_config(node.target), workdir=Path(tmp) / "kvstore"),
                   "HiCacheFile": SGLangServer(model, storage="file", workdir=Path(tmp) / "file")}
        namespace = kvstore_namespace(model, shape=shape)

        def files_stored(ids: list[int]) -> Callable[[], bool]:
            folder = servers["HiCacheFile"].workdir / "hicache"
            return lambda: all(any(folder.glob(f"{key}_*.bin")) for key in page_keys(ids))

        try:
            for server in servers.values():
                server.start()
                server.generate(prompt(64, next(seeds)), max_new_tokens=1)  # first-request costs, untimed
            for _ in range(rounds):
                order = list(servers)
                random.shuffle(order)
                for name in order:
                    server, ids = servers[name], prompt(prompt_tokens, next(seeds))
                    started = time.perf_counter()
                    miss = server.generate(ids, max_new_tokens=1)
                    times[f"{name} miss"].append(time.perf_counter() - started)
                    assert miss.cached_tokens == 0, miss
                    if name == "kvstore":
                        wait_stored(node.target, namespace, ids)
                    else:
                        wait_until(files_stored(ids), 120.0, "HiCacheFile writes the prompt's pages", pause_s=0.2)
                    server.flush_cache()
                    started = time.perf_counter()
                    hit = server.generate(ids, max_new_tokens=1)
                    times[f"{name} hit"].append(time.perf_counter() - started)
                    assert (hit.storage, hit.output_ids) == (stored_tokens, miss.output_ids), (name, hit, miss)
        finally:
            for server in servers.values():
                server.close()
    return times


if __name__ == "__main__":
    main()
