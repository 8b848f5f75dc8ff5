"""``kvstore demo``: end-to-end prefill reuse with a small random-weight Llama on real text, with and without kvstore.

Importing this module is cheap (torch and transformers load when the demo runs),
so ``kvstore --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from kvstore.api import BlockClient
from kvstore.connection import Connection, add_connection_arguments, redact, target_argument
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

DEFAULT_OUT = "./kvstore-demo-out"
DEFAULT_BLOCK_SIZE = 256
DEFAULT_PASSAGE_TOKENS = 1800
DEFAULT_QUESTIONS = 4
DEFAULT_TURNS = 4
DEFAULT_TURN_TOKENS = 500
DEFAULT_MAX_NEW_TOKENS = 8
EMBEDDED_MEMORY_BYTES = 256 << 20


LOGIT_TOLERANCE = 1e-3
"""Largest |logit difference| at the last prompt position that still counts as identical.

Tokens alone are weak evidence with random weights (a model may emit the same
tokens whatever its context), so the demo also compares the first token's
logits: reused KV must give the full prefill's logits up to float32 rounding,
which differs only because the suffix is computed in a shorter batch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's flags to ``parser`` (shared by ``kvstore demo`` and ``python -m kvstore.tools.demo``)."""
    parser.add_argument("--target", metavar="HOST:PORT", default="", type=target_argument,
                        help="use a running `kvstore serve` at HOST:PORT, a bare HOST meaning HOST:50051 "
                             "(default: an embedded in-process store)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder for summary.json and ttft.png (default {DEFAULT_OUT})")
    model = parser.add_argument_group("model (random weights, built offline)")
    model.add_argument("--model", default="default", choices=["default", "small", "tiny"],
                       help="preset: default ~147M params (8 layers, hidden 1024, 16 heads, 4 KV heads), small ~12M, tiny")
    model.add_argument("--layers", type=int, help="decoder layers (overrides the preset)")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    model.add_argument("--intermediate", type=int, help="MLP width")
    model.add_argument("--seed", type=int, help="weight seed (default 0)")
    model.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="model and KV dtype (default float32)")
    model.add_argument("--device", default="auto", help="cpu, cuda[:N], or auto (cuda when available)")
    model.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    work = parser.add_argument_group("workload (tinyshakespeare)")
    work.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=f"tokens per block (default {DEFAULT_BLOCK_SIZE})")
    work.add_argument("--passage-tokens", type=int, default=DEFAULT_PASSAGE_TOKENS,
                      help=f"length of the shared passage, tokens (default {DEFAULT_PASSAGE_TOKENS})")
    work.add_argument("--questions", type=int, default=DEFAULT_QUESTIONS, help=f"questions about the passage (default {DEFAULT_QUESTIONS})")
    work.add_argument("--turns", type=int, default=DEFAULT_TURNS, help=f"conversation turns (default {DEFAULT_TURNS})")
    work.add_argument("--turn-tokens", type=int, default=DEFAULT_TURN_TOKENS,
                      help=f"tokens each conversation turn adds, roughly (default {DEFAULT_TURN_TOKENS})")
    work.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                      help=f"greedy tokens generated per request (default {DEFAULT_MAX_NEW_TOKENS})")
    work.add_argument("--cache-salt", default="", help="tenant salt of the namespace")
    add_connection_arguments(parser)
    return parser


DESCRIPTION = """\
Show prefill reuse end to end: a small Llama with random weights (built
offline, nothing downloaded) answers questions about a passage of Shakespeare,
then holds a growing conversation; each request runs without kvstore and with
it, and the demo prints, per request, the tokens served from kvstore, the time
to first token (TTFT) of both runs and the largest difference of their first
token's logits (the outputs are identical). Blocks go to an embedded store in
this process, or to a running node with --target."""
"""``kvstore demo --help``'s description: what the demo does, for a user."""

EPILOG = """\
examples:
  kvstore demo                                   # embedded store, the default 147M model (minutes on a CPU)
  kvstore demo --model tiny --questions 2        # a quick look
  kvstore demo --target 127.0.0.1:50051          # through a running kvstore serve

Writes summary.json and ttft.png to --out (docs/demo.md explains both)."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to a ``kvstore`` CLI; it runs :func:`run` (``args.func``)."""
    parser = subparsers.add_parser(
        "demo",
        help="end-to-end prefix-KV reuse demo with a small HF Llama (no download, no server needed)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def open_client(target: str, connection: Connection | None = None) -> tuple[BlockClient, str]:
    """A block client: the gRPC ``KVStoreClient`` for ``HOST:PORT``, else an embedded store.

    Args:
        target: ``HOST:PORT`` of a node, or empty for an embedded store.
        connection: TLS and token settings for the node (``kvstore.connection``); plaintext when ``None``.

    Returns:
        The client and a label for reports (``embedded`` or the target).

    Raises:
        KVStoreError: (e.g. ``UnavailableError``, ``DeadlineExceededError``, ``UnauthenticatedError``)
            if the target cannot be reached or refuses the call; ``ConfigError`` on an unreadable TLS file.
    """
    if target:
        from kvstore.client import KVStoreClient

        client = KVStoreClient(target, **(connection or Connection()).client_kwargs())
        try:
            client.stats()  # fail now, not by silently falling back on every request
        except Exception:
            client.close()
            raise
        return client, target
    from kvstore.config import MemoryTierConfig, StoreConfig
    from kvstore.embedded import open_store

    return open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=EMBEDDED_MEMORY_BYTES))), "embedded"


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code: 0, or 1 if any output differs with the cache.

    For each request (questions about one passage, then conversation turns) it
    generates greedily twice with the same code path: once with no store (full
    prefill) and once through kvstore (load cached prefix, prefill the rest,
    save new blocks in the background), and compares TTFT and the tokens.
    Writes ``summary.json`` and ``ttft.png`` under ``--out``.
    """
    import torch
    from tqdm import tqdm

    from kvstore.connectors.hf import HFConnector
    from kvstore.tools.demo.model import build_model, spec_from
    from kvstore.tools.demo.plot import plot_ttft
    from kvstore.tools.demo.tokenizer import ByteTokenizer
    from kvstore.tools.demo.workload import conversation, load_corpus, passage_questions

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.block_size < 1 or args.max_new_tokens < 1 or args.passage_tokens < 1 or args.turns < 0:
        print("ERROR: --block-size, --max-new-tokens and --passage-tokens must be >= 1, --turns >= 0", file=sys.stderr)
        return 2
    try:
        spec = spec_from(args.model, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, seed=args.seed,
                         dtype=args.dtype)
    except ValueError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = ByteTokenizer()
    corpus = load_corpus()
    requests = passage_questions(corpus, args.passage_tokens, args.questions) + conversation(
        corpus, args.turns, args.turn_tokens
    )
    print(f"kvstore demo: Llama {spec.num_layers}x{spec.hidden_size} ({spec.num_params() / 1e6:.1f}M params, "
          f"random weights, seed {spec.seed}, {spec.dtype}, {args.device}), block size {args.block_size}, "
          f"{len(requests)} requests, {args.max_new_tokens} new tokens each", flush=True)
    started = time.perf_counter()
    model = build_model(spec, device=args.device)
    try:
        connection = Connection.from_args(args)
        client, store_label = open_client(args.target, connection)
    except KVStoreError as exc:
        print(f"ERROR: cannot use the store at {args.target}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    # a node with tokens requires SHA-256 block hashes by default (security.require_sha256)
    hash_algorithm = "sha256" if args.target and connection.token else "xxh3_128"
    print(f"model built in {time.perf_counter() - started:.1f} s; store: {store_label}", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        with HFConnector(model, client, block_size=args.block_size, model_id=spec.model_id,
                         cache_salt=args.cache_salt, hash_algorithm=hash_algorithm) as connector:
            connector.generate(tokenizer.encode(requests[0].text[:64]), 2, use_store=False)  # warm-up, untimed
            progress = tqdm(requests, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True, disable=None)
            for request in progress:
                ids = tokenizer.encode(request.text)
                base = connector.generate(ids, args.max_new_tokens, use_store=False)
                hit = connector.generate(ids, args.max_new_tokens)
                connector.flush()  # the next request may hit this one's blocks; not part of any TTFT
                logit_diff = float((base.first_logits - hit.first_logits).abs().max())
                row = {
                    "name": request.name,
                    "kind": request.kind,
                    "prompt_tokens": hit.num_prompt_tokens,
                    "cached_tokens": hit.num_cached_tokens,
                    "hit_ratio": hit.hit_ratio,
                    "ttft_no_cache_s": base.ttft_s,
                    "ttft_cache_s": hit.ttft_s,
                    "speedup": base.ttft_s / hit.ttft_s if hit.ttft_s > 0 else float("inf"),
                    "load_s": hit.load_s,
                    "prefill_s": hit.prefill_s,
                    "fell_back": hit.fell_back,
                    "identical": base.token_ids == hit.token_ids and logit_diff <= LOGIT_TOLERANCE,
                    "max_logit_diff": logit_diff,
                    "output_tokens": list(hit.token_ids),
                    "output_text": tokenizer.decode(hit.token_ids),
                }
                rows.append(row)
                progress.write(
                    f"{row['name']:>11}: {row['prompt_tokens']:5d} tokens, {row['cached_tokens']:5d} cached "
                    f"({row['hit_ratio']:4.0%})  TTFT {row['ttft_no_cache_s']:7.3f} s -> {row['ttft_cache_s']:7.3f} s "
                    f"({row['speedup']:5.1f}x)  output {'identical' if row['identical'] else 'DIFFERS'}"
                    f" (logits max |diff| {logit_diff:.1e})"
                    + ("  [store failed: full prefill]" if hit.fell_back else "")
                )
            progress.close()
            connector_stats = connector.stats()
        store_stats = _store_stats(client)
    finally:
        client.close()
    summary = _summary(args, spec, store_label, rows, connector_stats, store_stats, time.perf_counter() - started)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    plot_path = plot_ttft(rows, out_dir / "ttft.png",
                          title=f"TTFT, Llama {spec.num_params() / 1e6:.1f}M random weights, {spec.dtype}, "
                                f"{args.device}, block {args.block_size} ({store_label} store)")
    totals = summary["totals"]
    print(f"\nTTFT total: {totals['ttft_no_cache_s']:.2f} s without cache, {totals['ttft_cache_s']:.2f} s with "
          f"({totals['speedup']:.2f}x); requests that hit: {totals['ttft_hits_no_cache_s']:.2f} s -> "
          f"{totals['ttft_hits_cache_s']:.2f} s ({totals['speedup_hits']:.2f}x); "
          f"{totals['cached_tokens']} of {totals['prompt_tokens']} prompt tokens from kvstore")
    print(f"outputs identical: {totals['num_identical']}/{len(rows)}")
    print(f"wrote {summary_path} and {plot_path}")
    if totals["num_identical"] != len(rows):
        print("ERROR: some outputs differ with the cache", file=sys.stderr)
        return 1
    return 0


def _store_stats(client: BlockClient) -> list[dict[str, Any]]:
    try:
        return [asdict(t) for t in client.stats().tiers]
    except Exception as exc:  # noqa: BLE001 - stats are informational
        logger.warning("could not read store stats: %s", exc)
        return []


def _summary(args: argparse.Namespace, spec: Any, store_label: str, rows: list[dict[str, Any]],
             connector_stats: Any, store_stats: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    import torch

    hits = [r for r in rows if r["cached_tokens"]]
    base_total = sum(r["ttft_no_cache_s"] for r in rows)
    cache_total = sum(r["ttft_cache_s"] for r in rows)
    hits_base = sum(r["ttft_no_cache_s"] for r in hits)
    hits_cache = sum(r["ttft_cache_s"] for r in hits)
    return {
        "command": getattr(args, "demo_command", None) or "kvstore " + " ".join(redact(sys.argv[1:])),
        "model": {**asdict(spec), "model_id": spec.model_id, "num_params": spec.num_params(), "device": args.device},
        "store": store_label,
        "block_size": args.block_size,
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "requests": rows,
        "totals": {
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(r["cached_tokens"] for r in rows),
            "ttft_no_cache_s": base_total,
            "ttft_cache_s": cache_total,
            "speedup": base_total / cache_total if cache_total else 0.0,
            "ttft_hits_no_cache_s": hits_base,
            "ttft_hits_cache_s": hits_cache,
            "speedup_hits": hits_base / hits_cache if hits_cache else 0.0,
            "num_identical": sum(r["identical"] for r in rows),
            "wall_s": wall_s,
        },
        "connector": {**{f: getattr(connector_stats, f) for f in connector_stats.__slots__},
                      "hit_ratio": connector_stats.hit_ratio},
        "store_tiers": store_stats,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore.tools.demo [flags]``: parse flags and :func:`run`."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvstore demo", description=__doc__))
    args = parser.parse_args(argv)
    args.demo_command = "python -m kvstore.tools.demo " + " ".join(redact(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)
