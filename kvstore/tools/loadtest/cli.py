"""``kvstore loadtest``: replay a request trace against running kvstore nodes and report hits, rates and latencies."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from kvstore.client import AsyncKVStoreClient
from kvstore.config import parse_size
from kvstore.connection import Connection, add_connection_arguments, target_argument
from kvstore.data import bundled_trace
from kvstore.blocks.encoding.spec import encoded_fraction, encoding_of
from kvstore.errors import ConfigError, InvalidArgumentError, KVStoreError
from kvstore.tools.loadtest.blocks import DEFAULT_MODEL, DEFAULT_PAYLOAD_BYTES
from kvstore.config import DEFAULT_HISTORY_BLOCKS
from kvstore.tools.loadtest.runner import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_TARGET,
    DEFAULT_WINDOW_S,
    LoadTestConfig,
    LoadTestResult,
    run_loadtest,
)
from kvstore.tools.trace import FORMATS, MOONCAKE_BLOCK_TOKENS, TraceRequest, iter_trace

logger = logging.getLogger(__name__)

DEFAULT_TRACE = bundled_trace()
"""The trace used when ``--trace`` is not given: the Mooncake conversation trace, shipped in the package."""

EXIT_OK = 0
EXIT_FAILED = 1
"""Exit status when a call failed, a block mismatched, or no node answered."""
EXIT_USAGE = 2
"""Exit status on a bad argument or a malformed trace."""

_EPILOG = """\
Per request: Lookup the longest cached prefix, Get it and check every block byte
for byte, Put all blocks after it. Every trace block id is one block, the last
(partial) one included; a block is a [1, 2, 1, block_tokens, head_dim] uint8
tensor of --block-bytes bytes behind the codec's 128-byte header.

examples:
  kvstore loadtest --target 127.0.0.1:50051                      # conversation trace, 1 worker, file order
  kvstore loadtest --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --concurrency 8 --duration 60
  kvstore loadtest --speedup 10 --max-inflight 32 --json out.json --plot-dir plots/
  kvstore loadtest --requests 2000 --sim-capacity node           # also simulate the node's capacity and compare
  kvstore loadtest --sim-capacity 1827 --sim-disk-capacity 45697 # capacities in blocks, given

Exit status: 0 if every call succeeded and every block matched; 1 if a call
failed, a block mismatched or the node is unreachable; 2 on a bad argument or
a malformed trace (the message names the file and line)."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to ``subparsers``; it sets ``func=run``.

    Returns:
        The subcommand's parser.
    """
    parser = subparsers.add_parser(
        "loadtest",
        help="replay a request trace against running nodes and report hit ratio, throughput and latency",
        description=("Replay a request trace (Mooncake or generic JSONL, see kvstore.tools.trace) against running "
                     "kvstore nodes, closed loop or open loop, and report block and token hit ratios (overall, "
                     "per tier and over time), requests/s, GB/s, lookup/get/put latency percentiles, errors "
                     "and byte mismatches."),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``loadtest`` to ``parser``."""
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), metavar="PATH",
                        help=f"trace file (default: {DEFAULT_TRACE})")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="trace format (default: auto)")
    parser.add_argument("--target", action="append", default=None, metavar="HOST:PORT", type=target_argument,
                        help=f"a node, a bare HOST meaning HOST:50051; repeatable (default: {DEFAULT_TARGET})")
    pacing = parser.add_mutually_exclusive_group()
    pacing.add_argument("--concurrency", type=_positive_int, default=None, metavar="N",
                        help="closed loop: N workers, each starting its next request when the last ends (default: 1)")
    pacing.add_argument("--speedup", type=_positive_float, default=None, metavar="X",
                        help="open loop: start requests at their trace timestamps, X times faster")
    parser.add_argument("--max-inflight", type=_positive_int, default=DEFAULT_MAX_INFLIGHT, metavar="N",
                        help=f"open loop: requests in flight at most (default: {DEFAULT_MAX_INFLIGHT})")
    parser.add_argument("--requests", type=int, default=None, metavar="N", help="stop after the first N requests")
    parser.add_argument("--duration", type=_positive_float, default=None, metavar="SECONDS",
                        help="start no request after this many seconds")
    parser.add_argument("--block-bytes", default=None, metavar="SIZE",
                        help=("payload bytes of one block, a multiple of 2 * block tokens (default: 63KiB, so that "
                              "with the 128-byte header a block fills one 64 KiB page of a page-pool memory tier)"))
    parser.add_argument("--kv-encoding", default="", metavar="NAME",
                        help="size blocks as a lossy KV encoding (int8, fp8_e4m3, int4, int2) would store them: "
                             "--block-bytes is the exact bf16 payload (docs/encodings.md)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, metavar="N",
                        help=f"tokens per trace block (default: {MOONCAKE_BLOCK_TOKENS}, Mooncake's)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"namespace model name (default: {DEFAULT_MODEL})")
    parser.add_argument("--cache-salt", default="", metavar="TENANT",
                        help="namespace cache_salt: the tenant, which a node with tokens checks (default: none)")
    parser.add_argument("--hash-algorithm", choices=("auto", "xxh3_128", "sha256"), default="auto",
                        help="namespace block hash; auto is sha256 when a token is sent (a node with tokens "
                             "requires it by default), else xxh3_128")
    parser.add_argument("--seed", type=int, default=0, help="payload seed (default: 0)")
    parser.add_argument("--window", type=_positive_float, default=DEFAULT_WINDOW_S, metavar="SECONDS",
                        help=f"window of the hit ratio over time (default: {DEFAULT_WINDOW_S:g})")
    parser.add_argument("--timeout", type=_positive_float, default=30.0, metavar="SECONDS",
                        help="deadline of each call (default: 30)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not compare got blocks with their expected bytes")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    parser.add_argument("--plot-dir", default=None, metavar="DIR",
                        help="write loadtest_hit_ratio.png and loadtest_latency_cdf.png there")
    parser.add_argument("--sim-capacity", default=None, metavar="BLOCKS",
                        help="also run kvstore simulate on the replayed requests with a memory tier of this many "
                             "blocks (or inf), or `node`: the node's own memory tier (and disk tier), read from its "
                             "stats after the run (its capacity over one block's footprint); one --target only")
    parser.add_argument("--sim-disk-capacity", default=None, metavar="BLOCKS",
                        help="the simulation's disk tier, blocks: give it for a node with a disk tier, so that the "
                             "simulation has the same (default: none)")
    parser.add_argument("--sim-policy", default="default",
                        help="policy of the simulation, the node's --policy (default: default)")
    parser.add_argument("--sim-history-blocks", type=int, default=DEFAULT_HISTORY_BLOCKS, metavar="N",
                        help="removals the simulation remembers to name misses: the node's "
                             f"store.miss_history_blocks (default: {DEFAULT_HISTORY_BLOCKS})")
    parser.add_argument("--ttl-scale", type=_positive_float, default=1.0, metavar="X",
                        help="multiply the trace's TTLs by X before sending them: 1/speedup keeps an open "
                             "loop's TTLs as the trace has them (default: 1)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="live progress bar on stderr (default: only on a terminal)")
    parser.add_argument("--legend", action=argparse.BooleanOptionalAction, default=None,
                        help="explain the summary's rows under it (default: only on a terminal)")
    add_connection_arguments(parser)


def read_requests(path: str, format: str, limit: int | None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace (all when ``None``), read before any load starts.

    Args:
        path: the trace (``kvstore.tools.trace``).
        format: its format, or ``auto``.
        limit: requests to read at most.
        block_tokens: tokens per block (a Mooncake trace's ``hash_ids`` are checked against it).

    Raises:
        TraceFormatError: naming the file and line of a malformed line.
        InvalidArgumentError: on an unknown format, or a trace with no request.
        OSError: if the file cannot be read.
    """
    requests = list(itertools.islice(iter_trace(path, format, block_tokens), limit))
    if not requests:
        raise InvalidArgumentError(f"the trace {path} has no requests (an empty file?); nothing to replay")
    return requests


NODE_CAPACITY = "node"
"""``--sim-capacity node``: simulate the capacities the node reports."""


def _sim_capacity(text: str | None) -> tuple[bool, int | None]:
    if text is None:
        return False, None
    value = text.strip().lower()
    if value in ("inf", "infinite", "none"):
        return True, None
    if value == NODE_CAPACITY:
        return True, -1  # read from the node after the run
    if not value.isdigit():
        raise InvalidArgumentError(f"--sim-capacity must be a block count or inf, got {text!r}")
    return True, int(value)


def _sim_disk_capacity(text: str | None, compare: bool) -> int:
    if text is None:
        return 0
    if not compare:
        raise InvalidArgumentError("--sim-disk-capacity needs --sim-capacity")
    if not text.strip().isdigit():
        raise InvalidArgumentError(f"--sim-disk-capacity must be a block count, got {text!r}")
    return int(text)


def encoded_payload_bytes(payload_bytes: int, kv_encoding: str, block_tokens: int) -> int:
    """The payload bytes a block of ``payload_bytes`` (exact bf16) takes under ``kv_encoding`` (``""``: as it is),
    rounded down to the multiple of ``2 * block_tokens`` the load test's blocks need.

    Raises:
        InvalidArgumentError: on an unknown encoding.
    """
    encoding = encoding_of(kv_encoding)
    if encoding is None:
        return payload_bytes
    step = 2 * max(block_tokens, 1)
    return max(step, int(payload_bytes * encoded_fraction(encoding, block_tokens)) // step * step)


def config_from_args(args: argparse.Namespace, connection: Connection | None = None) -> LoadTestConfig:
    """The :class:`LoadTestConfig` of parsed ``loadtest`` arguments.

    Args:
        args: the parsed arguments.
        connection: the client's TLS and token; with a token, ``--hash-algorithm auto`` is ``sha256``.

    Raises:
        InvalidArgumentError: on an invalid size or value.
    """
    hash_algorithm = getattr(args, "hash_algorithm", "auto")
    if hash_algorithm == "auto":
        hash_algorithm = "sha256" if connection is not None and connection.token else "xxh3_128"
    try:
        payload_bytes = parse_size(args.block_bytes) if args.block_bytes is not None else DEFAULT_PAYLOAD_BYTES
    except ValueError as exc:
        raise InvalidArgumentError(f"--block-bytes: {exc}") from None
    payload_bytes = encoded_payload_bytes(payload_bytes, getattr(args, "kv_encoding", ""), args.block_tokens)
    if args.requests is not None and args.requests < 0:
        raise InvalidArgumentError(f"--requests must be >= 0, got {args.requests}")
    return LoadTestConfig(
        targets=tuple(args.target or (DEFAULT_TARGET,)),
        concurrency=args.concurrency or 1,
        speedup=args.speedup,
        max_inflight=args.max_inflight,
        max_requests=args.requests,
        duration_s=args.duration,
        payload_bytes=payload_bytes,
        block_tokens=args.block_tokens,
        model=args.model,
        cache_salt=getattr(args, "cache_salt", ""),
        hash_algorithm=hash_algorithm,
        seed=args.seed,
        window_s=args.window,
        timeout_s=args.timeout,
        verify=args.verify,
        ttl_scale=getattr(args, "ttl_scale", 1.0),
    )


SUMMARY_LEGEND = {
    "requests": "trace requests completed and failed, and what ended the run (trace_end, max_requests, duration)",
    "targets": "the nodes the client spread blocks over",
    "block hit ratio": "blocks the lookups found in the cached prefix (and the gets returned) / blocks requested",
    "token hit ratio": "prompt tokens those blocks cover / prompt tokens",
    "hits per tier": "the hit blocks by the tier that held them at lookup",
    "elapsed": "wall time from the first request to the last completion",
    "requests/s": "completed requests per second of that time",
    "GB/s moved": "10^9 bytes of encoded blocks read (gets) and written (puts) per second",
    "latency": "per call, percentiles over the run (request: lookup + get + put of one trace request)",
    "start lag": "open loop: how late requests started behind their trace time (waiting for --max-inflight)",
    "errors": "failed calls, by operation and error class",
    "byte mismatches": "blocks whose bytes differed from what was put (must be 0)",
    "short gets": "gets that returned fewer blocks than their lookup found (evicted in between)",
    "simulator": "kvstore simulate on the same requests: its hit ratio, and the load test's minus it",
    "misses by cause": "the nodes' missed blocks over the run, by cause (kvstore.store.misses; docs/agentic.md)",
    "causes named": "missed blocks the nodes named a cause for / missed blocks (equal with one worker)",
    "sim capacity": "with --sim-capacity node: the node's capacity over one block's footprint, per tier",
    "simulator causes": "the simulator's missed blocks by cause, and whether they are the node's",
}
"""What the summary's rows mean (printed under it with --legend)."""


def format_summary(result: LoadTestResult, comparison: dict[str, Any] | None = None) -> str:
    """Plain aligned text: hit ratios, per-tier hits, rates, latency percentiles, errors and mismatches."""
    rows: list[tuple[str, str]] = [
        ("requests", f"{result.num_requests} completed, {result.num_failed} failed, stop: {result.stop_reason}"),
        ("targets", ", ".join(result.client_targets)),
        ("block hit ratio", f"{result.hit_ratio:.4f} ({result.hit_blocks} / {result.num_blocks} blocks)"),
        ("token hit ratio", f"{result.token_hit_ratio:.4f}"),
        ("hits per tier", ", ".join(f"{t}={n}" for t, n in result.hit_blocks_per_tier.items()) or "-"),
        ("elapsed", f"{result.elapsed_s:.2f} s"),
        ("requests/s", f"{result.requests_per_s:.1f}"),
        ("GB/s moved", f"{result.gb_per_s:.3f} (read {result.bytes_read / 1e9:.3f} GB, "
                       f"written {result.bytes_written / 1e9:.3f} GB)"),
    ]
    for name in ("lookup", "get", "put", "request"):
        s = result.latency_ms.get(name, {})
        if s.get("count"):
            rows.append((f"{name} latency", f"p50 {s['p50_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms, "
                                            f"p99 {s['p99_ms']:.2f} ms ({s['count']} calls)"))
    if result.schedule_lag_ms.get("count"):
        lag = result.schedule_lag_ms
        rows.append(("start lag", f"p50 {lag['p50_ms']:.2f} ms, p99 {lag['p99_ms']:.2f} ms"))
    errors = ", ".join(f"{k} x{v}" for k, v in result.errors.items())
    rows.append(("errors", f"{result.num_errors}" + (f" ({errors})" if errors else "")))
    rows.append(("byte mismatches", str(result.byte_mismatches)))
    rows.append(("short gets", str(result.short_gets)))
    if result.missed_blocks:
        named = sum(result.missed_blocks.values())
        rows.append(("misses by cause", ", ".join(f"{c}={n}" for c, n in result.missed_blocks.items() if n) or "-"))
        rows.append(("causes named", f"{named} of {result.num_blocks - result.hit_blocks} missed blocks"))
    if comparison is not None:
        capacity = "inf" if comparison["capacity_blocks"] is None else comparison["capacity_blocks"]
        disk = f" + disk {comparison['disk_capacity_blocks']}" if comparison["disk_capacity_blocks"] else ""
        rows.append(("simulator", f"{comparison['policy']}@{capacity}{disk}: hit ratio "
                                  f"{comparison['sim_hit_ratio']:.4f}, "
                                  f"loadtest - sim = {comparison['hit_ratio_diff']:+.4f}"))
        if comparison.get("capacity_source", "given") != "given":
            rows.append(("sim capacity", comparison["capacity_source"]))
        if comparison.get("sim_missed_blocks"):
            same = "the same" if comparison.get("causes_agree") else "NOT the same"
            rows.append(("simulator causes", ", ".join(f"{c}={n}" for c, n in comparison["sim_missed_blocks"].items()
                                                       if n) + f" ({same} as the node's)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


async def _check_reachable(targets: Sequence[str], timeout_s: float, connection: Connection) -> str | None:
    """``None`` if every target reports SERVING, else what is wrong with the first that does not."""
    for target in targets:
        async with AsyncKVStoreClient(target, timeout_s=timeout_s, retries=1, **connection.client_kwargs()) as client:
            try:
                status = await client.health()
                if status == "SERVING":
                    await client.stats()  # health needs no token: this call checks TLS and token in full
            except KVStoreError as exc:
                return f"{target}: {exc}"
        if status != "SERVING":
            return f"{target} is {status}"
    return None


async def _replay(requests: Sequence[TraceRequest], config: LoadTestConfig, connection: Connection,
                  progress: bool | None) -> LoadTestResult:
    """:func:`run_loadtest` through a client of ``config.targets`` with the TLS and token of ``connection``."""
    async with AsyncKVStoreClient(targets=list(config.targets), timeout_s=config.timeout_s,
                                  max_inflight=max(config.concurrency, config.max_inflight),
                                  **connection.client_kwargs()) as client:
        return await run_loadtest(requests, config, client=client, progress=progress)


def run(args: argparse.Namespace) -> int:
    """Run ``loadtest`` with parsed ``args``; print a summary. Returns the exit status (0, 1 or 2)."""
    try:
        connection = Connection.from_args(args)
        connection.client_kwargs()  # an unreadable TLS file is a usage error, before any call
        config = config_from_args(args, connection)
        compare, sim_capacity = _sim_capacity(args.sim_capacity)
        sim_disk = _sim_disk_capacity(args.sim_disk_capacity, compare)
        if sim_capacity == -1 and (len(config.targets) > 1 or args.sim_disk_capacity is not None):
            raise InvalidArgumentError("--sim-capacity node reads one node's tiers: give one --target, and no "
                                       "--sim-disk-capacity")
        requests = read_requests(args.trace, args.format, config.max_requests, config.block_tokens)
    except (InvalidArgumentError, ConfigError, OSError) as exc:
        print(f"kvstore loadtest: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    unreachable = asyncio.run(_check_reachable(config.targets, min(config.timeout_s, 10.0), connection))
    if unreachable is not None:
        print(f"kvstore loadtest: node not serving: {unreachable}", file=sys.stderr)
        return EXIT_FAILED
    try:
        result = asyncio.run(_replay(requests, config, connection, args.progress))
    except InvalidArgumentError as exc:
        print(f"kvstore loadtest: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    comparison = None
    if compare:
        from kvstore.tools.loadtest.compare import compare_with_simulator, node_capacity_blocks

        try:
            source = "given"
            if sim_capacity == -1:
                sim_capacity, sim_disk, source = node_capacity_blocks(result.server_stats)
            elif sim_capacity is not None and len(config.targets) == 1:
                _warn_if_not_the_nodes(result.server_stats, sim_capacity)
            if sys.stderr.isatty():
                print("kvstore loadtest: simulating the replayed requests ...", file=sys.stderr, flush=True)
            comparison = compare_with_simulator(requests, result, sim_capacity, policy=args.sim_policy,
                                                disk_capacity_blocks=sim_disk,
                                                history_blocks=args.sim_history_blocks)
            comparison["capacity_source"] = source
        except InvalidArgumentError as exc:
            print(f"kvstore loadtest: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    print(format_summary(result, comparison))
    if args.legend or (args.legend is None and sys.stdout.isatty()):
        width = max(map(len, SUMMARY_LEGEND))
        print("\n".join(f"  {name.ljust(width)}  {meaning}" for name, meaning in SUMMARY_LEGEND.items()))
    if args.json:
        payload = {"trace": str(args.trace), **result.to_dict(), "simulator": comparison}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot_dir:
        from kvstore.tools.loadtest.plot import write_plots

        write_plots(result, args.plot_dir, sim_hit_ratio=comparison["sim_hit_ratio"] if comparison else None)
    return EXIT_OK if result.ok else EXIT_FAILED


def _warn_if_not_the_nodes(server_stats: dict[str, Any] | None, sim_capacity: int) -> None:
    """A line on stderr when ``--sim-capacity`` is not what the node's memory tier holds of these blocks."""
    from kvstore.tools.loadtest.compare import node_capacity_blocks

    try:
        node_blocks, _, how = node_capacity_blocks(server_stats)
    except InvalidArgumentError:
        return  # nothing to measure: say nothing
    if abs(node_blocks - sim_capacity) > max(1, node_blocks // 100):
        print(f"kvstore loadtest: warning: --sim-capacity {sim_capacity} is not the node's memory tier, which holds "
              f"{node_blocks:,} of these blocks ({how}); the two hit ratios then differ. --sim-capacity node "
              f"simulates the node's", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``loadtest`` as a program of its own: ``python -m kvstore.tools.loadtest.cli [options]``.

    Args:
        argv: the options (without ``loadtest``); ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit status (see the epilog).
    """
    parser = argparse.ArgumentParser(prog="kvstore")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["loadtest", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
