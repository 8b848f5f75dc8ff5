"""Decode throughput of a vLLM engine's running requests while kvstore hits load, synchronous against asynchronous loads.

One run, on the demo's ~147M-parameter Llama (vLLM's CPU backend, dummy
weights, block size 32; the model of ``bench_vllm_ttft.py``), through a
``kvstore serve`` node on the same host, for each mode in turn
(``load_async`` false, then true; one engine at a time, since an idle vLLM CPU
worker's threads spin on the cores):

1. an engine (``kv_both``, vLLM's own prefix caching off, so every repeat of
   a prompt is a kvstore hit) serves the ``--hits`` hit prompts once, which
   saves their blocks, and waits for the saves;
2. it starts ``--running`` requests with long outputs and, once all of them
   decode, runs ``--trials`` rounds (plus one warm-up round, discarded) of:
   ``--baseline-steps`` steps with nothing else in the engine (the **baseline
   window**), then the hit prompts added at once (``--hit-tokens`` + 1 tokens
   each, all but the last token in kvstore, one output token) and steps
   until every hit has its first token, then a few steps to settle.

The engine is driven one ``step()`` at a time (``tests/connectors/vllm/engine.py``,
``decode_with_hits``): a window's throughput is the running requests' new
tokens in its steps over their seconds. The **load window** is the steps that
begin with a hit's load in flight (the hit not yet looked up, or in vLLM's
``WAITING_FOR_REMOTE_KVS`` and not yet reported received): synchronously, the
one step that loads (and computes the hits' last tokens); asynchronously, the
steps that run beside the fetch threads. Per round, **ratio = load-window
tokens/s / baseline-window tokens/s**, both in the same engine seconds apart;
medians over rounds per mode. Beside it, the same over every step until each
hit has its first token (which adds, asynchronously, the step that computes
the hits' last tokens). The hits' TTFT is from ``add_request`` to the end of the
step that returns their first token. The goal (issue 33): with asynchronous
loads the ratio is >= 0.9, and the hits' TTFT is no worse than with
synchronous loads (the baseline, in the same run).

    .venv-vllm/bin/python benchmarks/bench_vllm_async.py --rounds 2  # ~2.5 min on 2 cores, engines interleaved
    .venv-vllm/bin/python benchmarks/bench_vllm_async.py --quick     # smoke test, small model, ~1 min

Writes ``benchmarks/results/bench_vllm_async.{json,md}`` (``--out`` to change).
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

from benchmarks.bench_vllm_ttft import default_dtype, describe, load_avg, prompt, vllm_version, write_model  # noqa: E402
from tests.connectors.vllm.harness import Engine, counter  # noqa: E402
from tests.support.kvnode import KVNode  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOAL_RATIO = 0.9
BLOCK = 32
MODES = {"sync": False, "async": True}
"""Mode name -> ``load_async``."""
QUICK = {"trials": 2, "hits": 2, "hit_tokens": 512, "model": "small", "baseline_steps": 8}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6, help="measured rounds per engine (after one warm-up round)")
    parser.add_argument("--running", type=int, default=4, help="requests decoding throughout")
    parser.add_argument("--hits", type=int, default=4, help="hit prompts added at once per round")
    parser.add_argument("--hit-tokens", type=int, default=2048,
                        help="tokens each hit loads (a multiple of 32; its prompt has one more)")
    parser.add_argument("--running-tokens", type=int, default=64, help="prompt tokens per running request")
    parser.add_argument("--baseline-steps", type=int, default=16, help="steps in each round's baseline window")
    parser.add_argument("--settle-steps", type=int, default=4, help="steps after a load window, not measured")
    parser.add_argument("--rounds", type=int, default=1,
                        help="engines per mode, interleaved (sync, async, sync, async, ...)")
    parser.add_argument("--model", default="default", help="kvstore.tools.demo preset: default (~147M) or small")
    parser.add_argument("--dtype", default=default_dtype(), choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK}")
    parser.add_argument("--out", default=str(RESULTS / "bench_vllm_async"))
    args = parser.parse_args()
    args.command = "python benchmarks/bench_vllm_async.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    assert args.hit_tokens % BLOCK == 0 and args.hit_tokens > BLOCK
    return args


def run_engine(engine: Engine, args: argparse.Namespace, hits: list[list[int]], running: list[list[int]],
               max_tokens: int) -> dict[str, Any]:
    """Warm the node with the hits, then the rounds; the connector's counters and load seconds they took."""
    engine.generate(hits, max_tokens=1)  # saves their blocks (or finds them saved by an engine before)
    engine.drain()
    before = engine.metrics()
    result = engine.call("decode_with_hits", running=running, hits=hits, max_tokens=max_tokens,
                         trials=args.trials + 1, baseline_steps=args.baseline_steps, settle_steps=args.settle_steps)
    after = engine.metrics()
    grew = {name: counter(after, name) - counter(before, name)
            for name in ("hit_blocks", "loaded_blocks", "load_failed_blocks")}
    loads = after.get("kvstore_load_seconds_count", 0.0) - before.get("kvstore_load_seconds_count", 0.0)
    seconds = after.get("kvstore_load_seconds_sum", 0.0) - before.get("kvstore_load_seconds_sum", 0.0)
    return {"trials": result["trials"][1:], "warmup": result["trials"][0], "counters": grew,
            "load_s_mean": seconds / loads if loads else None, "num_loads": loads}


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-async-"))
    model = write_model(work / "model", args.model)
    max_model_len = args.hit_tokens + 64
    max_tokens = max_model_len - args.running_tokens - 8
    steps_needed = (args.trials + 1) * (args.baseline_steps + args.settle_steps + 64)
    assert steps_needed < max_tokens, f"{args.trials} trials need ~{steps_needed} decode steps; raise --hit-tokens"
    common = {"load_format": "dummy", "max_model_len": max_model_len, "kv_cache_memory_bytes": 1 << 30,
              "max_num_batched_tokens": max_model_len, "dtype": args.dtype}
    hits = [prompt(7000 + i, args.hit_tokens + 1) for i in range(args.hits)]
    running = [prompt(8000 + i, args.running_tokens) for i in range(args.running)]
    load_before = load_avg()
    runs: list[dict[str, Any]] = []
    with KVNode(memory_capacity="2GiB", metrics=False) as node:
        for round_index in range(args.rounds):
            for mode, load_async in MODES.items():
                started = time.monotonic()
                extra = {"target": node.target, "timeout_s": 10, "load_async": load_async}
                with Engine(model, kv_role="kv_both", extra=extra, **common) as engine:
                    up_s = time.monotonic() - started
                    print(f"{mode} (round {round_index}): engine up in {up_s:.0f} s (load {load_avg()})", flush=True)
                    run = run_engine(engine, args, hits, running, max_tokens)
                run.update(mode=mode, round=round_index, load_average_after=load_avg(),
                           seconds=time.monotonic() - started)
                runs.append(run)
                partial = Path(args.out).with_suffix(".partial.json")  # what a crash later leaves
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(runs, indent=1) + "\n")
                summary = summarize([run])
                print(f"  {mode}: ratio {summary['ratio_median']:.3f} (per round "
                      f"{', '.join(f'{r:.3f}' for r in summary['ratios'])}), hit TTFT median "
                      f"{summary['ttft_median_s']:.3f} s, counters {run['counters']} "
                      f"(load {run['load_average_after']})", flush=True)
    report(args, runs, load_before, load_avg())


def rate(steps: list[dict[str, float]]) -> float:
    """Tokens per second over steps (``{"seconds", "tokens"}``)."""
    return sum(st["tokens"] for st in steps) / sum(st["seconds"] for st in steps)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round ratios (load window / baseline window tokens/s), hits' TTFT and window sizes over ``runs``."""
    trials = [t for run in runs for t in run["trials"]]
    base = [rate([t["baseline"]]) for t in trials]
    in_flight = [[st for st in t["steps"] if st["loading"]] for t in trials]
    ratios = [rate(steps) / b for steps, b in zip(in_flight, base)]
    to_first = [rate(t["steps"]) / b for t, b in zip(trials, base)]
    ttfts = [s for t in trials for s in t["hit_ttft_s"]]
    load_s = [r["load_s_mean"] for r in runs if r["load_s_mean"] is not None]
    return {
        "ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "to_first_token_ratios": to_first,
        "to_first_token_ratio_median": statistics.median(to_first),
        "baseline_tokens_per_s_median": statistics.median(base),
        "loads_tokens_per_s_median": statistics.median(rate(steps) for steps in in_flight),
        "baseline_step_s_median": statistics.median(t["baseline"]["seconds"] / t["baseline"]["steps"] for t in trials),
        "load_window_steps_median": statistics.median(len(steps) for steps in in_flight),
        "load_window_s_median": statistics.median(sum(st["seconds"] for st in steps) for steps in in_flight),
        "ttft_median_s": statistics.median(ttfts), "ttft_min_s": min(ttfts), "ttft_max_s": max(ttfts),
        "load_s_mean": statistics.mean(load_s) if load_s else None,
    }


def report(args: argparse.Namespace, runs: list[dict[str, Any]], load_before: str, load_after: str) -> None:
    modes = {mode: summarize([r for r in runs if r["mode"] == mode]) for mode in MODES}
    sync, asyn = modes["sync"], modes["async"]
    ttft_ratio = asyn["ttft_median_s"] / sync["ttft_median_s"]
    ratio_met = asyn["ratio_median"] >= GOAL_RATIO
    ttft_met = ttft_ratio <= 1.0
    kv_mib = args.hits * args.hit_tokens * kv_bytes_per_token(args.model, args.dtype) / 2**20
    result = {
        "command": args.command, "host": platform.platform(), "cpus": os.cpu_count(), "vllm": vllm_version(),
        "model": args.model, "dtype": args.dtype, "load_average_before": load_before, "load_average_after": load_after,
        "settings": {k: v for k, v in vars(args).items() if k not in ("command", "out")},
        "kv_mib_per_round": kv_mib, "modes": modes, "async_over_sync_ttft_median": ttft_ratio,
        "goal_ratio_met": ratio_met, "goal_ttft_met": ttft_met, "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# bench_vllm_async: decode throughput while kvstore hits load, synchronous vs asynchronous loads",
        "",
        f"Command (repo root, from `.venv-vllm`, under `flock /tmp/heavy.lock`): `{args.command}`",
        "",
        f"{vllm_version()} (CPU backend), the demo's `{args.model}` Llama ({describe(args.model)}, {args.dtype}, dummy "
        f"weights), block size {BLOCK}, one `kvstore serve` node on the same host, vLLM's prefix caching off. "
        f"Per engine: {args.running} requests of {args.running_tokens} prompt tokens decode throughout; "
        f"{args.trials} rounds (after a warm-up round) of a baseline window of {args.baseline_steps} steps, then "
        f"{args.hits} hit prompts of {args.hit_tokens + 1} tokens added at once ({args.hit_tokens} in kvstore each, "
        f"{kv_mib:.1f} MiB of KV per round, one output token) and the steps until every hit has its first token. "
        "**ratio** = the running requests' tokens/s in the load window (the steps that begin with a hit's load in "
        "flight) / in the baseline window of the same round; **to first token**: the same over every step until "
        f"each hit has its first token; medians over rounds. Engines one at a time ({args.rounds} per mode, in the order "
        + ", ".join(f"{r['mode']}" for r in runs) + ").",
        f"Host: {platform.platform()}, {os.cpu_count()} CPUs, shared with other jobs: load average (1/5/15 min) "
        f"{load_before} at start; after each engine: "
        + "; ".join(f"{r['mode']} {r['load_average_after']}" for r in runs) + f"; {load_after} at the end.",
        "",
        "| mode | ratio median | min | max | to first token: ratio | baseline tokens/s | load-window tokens/s | "
        "baseline step (ms) | load window: steps / ms | hit TTFT median (ms) | min | max | connector load (ms, mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, s in modes.items():
        load_ms = f"{s['load_s_mean'] * 1e3:.1f}" if s["load_s_mean"] is not None else ""
        lines.append(
            f"| {mode} (`load_async: {str(MODES[mode]).lower()}`) | {s['ratio_median']:.3f} | {s['ratio_min']:.3f} | "
            f"{s['ratio_max']:.3f} | {s['to_first_token_ratio_median']:.3f} | {s['baseline_tokens_per_s_median']:.1f} | {s['loads_tokens_per_s_median']:.1f} | "
            f"{s['baseline_step_s_median'] * 1e3:.1f} | {s['load_window_steps_median']:g} / "
            f"{s['load_window_s_median'] * 1e3:.0f} | {s['ttft_median_s'] * 1e3:.0f} | {s['ttft_min_s'] * 1e3:.0f} | "
            f"{s['ttft_max_s'] * 1e3:.0f} | {load_ms} |")
    lines += [
        "",
        f"- Per-round ratios: " + "; ".join(f"{m} " + ", ".join(f"{r:.3f}" for r in s["ratios"])
                                            for m, s in modes.items()) + ".",
        f"- Connector counters per engine (hit / loaded / failed blocks): "
        + "; ".join(f"{r['mode']} {r['counters']['hit_blocks']:g} / {r['counters']['loaded_blocks']:g} / "
                    f"{r['counters']['load_failed_blocks']:g}" for r in runs) + ".",
        f"- **Throughput goal {'met' if ratio_met else 'NOT met'}**: with asynchronous loads the running requests "
        f"keep **{asyn['ratio_median']:.3f}x** their tokens/s while hits load (goal >= {GOAL_RATIO}); synchronous "
        f"loads keep {sync['ratio_median']:.3f}x.",
        f"- **TTFT goal {'met' if ttft_met else 'NOT met'}**: the hits' TTFT with asynchronous loads is "
        f"{ttft_ratio:.3f}x that with synchronous loads (medians {asyn['ttft_median_s'] * 1e3:.0f} vs "
        f"{sync['ttft_median_s'] * 1e3:.0f} ms; minima {asyn['ttft_min_s'] * 1e3:.0f} vs "
        f"{sync['ttft_min_s'] * 1e3:.0f} ms; goal <= 1).",
        "- connector load = `vllm:kvstore_load_seconds` per load (its sum / count over the rounds): synchronous, "
        "the step's whole fetch, checks and scatter; asynchronous, one request's, on a fetch thread.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    print("\n".join(lines))


def kv_bytes_per_token(preset: str, dtype: str) -> int:
    """KV bytes one token takes in vLLM's cache (every layer, K and V)."""
    from kvstore.tools.demo.model import spec_from

    spec = spec_from(preset)
    head_dim = spec.hidden_size // spec.num_heads
    return spec.num_layers * 2 * spec.num_kv_heads * head_dim * (4 if dtype == "float32" else 2)


if __name__ == "__main__":
    main()
