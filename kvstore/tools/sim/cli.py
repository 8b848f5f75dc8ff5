"""``kvstore simulate``: replay request traces through eviction policies and print hit ratios per capacity."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from kvstore.blocks.tensors import header_nbytes
from kvstore.config import parse_size
from kvstore.blocks.encoding.spec import encoded_fraction, encoding_of
from kvstore.errors import InvalidArgumentError
from kvstore.data import bundled_trace
from kvstore.tools.sim.replay import POLICIES, SimResult, resolve, simulate
from kvstore.tiers.lmdb import usable_bytes
from kvstore.tools.trace import FORMATS, MOONCAKE_BLOCK_TOKENS, is_session_file, read_session, read_trace

logger = logging.getLogger(__name__)

DEFAULT_TRACE = bundled_trace()
"""The trace used when ``--trace`` is not given: the Mooncake conversation trace, shipped in the package."""

DEFAULT_CAPACITIES = "1%,5%,10%,25%,50%,inf"
DEFAULT_POLICIES = "lru,default,belady"

_EPILOG = """\
capacities are block counts (5859), percentages of the trace's distinct blocks (5%),
sizes (3GiB; divided by --block-bytes) or inf. Policies: lru, slru, adaptive, default
(what a node runs by default: adaptive) and belady (the offline bound, MIN with bypass).
The replay runs the node's own store over tiers that keep no bytes; docs/simulate.md explains it. A progress bar runs
on stderr on a terminal (--no-progress hides it); the table's columns are explained
under it (--no-legend hides that).
examples:
  kvstore simulate --policy lru,default,belady --capacity 1%,5%,25%,inf
  kvstore simulate --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --capacity 3GiB --block-bytes 512KiB
  kvstore simulate --capacity 5% --disk-capacity 25% --json out.json --plot out.png
  kvstore simulate --trace sessions/ --block-tokens 64    # a directory of agentic session files
"""


def _is_size(text: str) -> bool:
    """Whether a capacity is a size with a unit (``25GiB``), not ``inf``, a block count or a percentage."""
    value = text.strip()
    return value[:1].isdigit() and not value.isdigit() and not value.endswith("%")


def parse_capacity(text: str, block_bytes: int | None, num_unique_blocks: int | None = None) -> int | None:
    """Parse one capacity into blocks: ``inf``, a block count, a percentage, or a size divided by ``block_bytes``.

    Args:
        text: ``inf``, an integer count of blocks (``5859``), a percentage of the
            trace's distinct blocks (``5%``), or a size with a unit (``3GiB``,
            ``512MB``; see ``kvstore.config.parse_size``).
        block_bytes: bytes of one block; required for a size with a unit.
        num_unique_blocks: distinct blocks of the trace; required for a percentage.

    Returns:
        Blocks (rounded down to whole blocks), or ``None`` for infinite.

    Raises:
        InvalidArgumentError: on anything else, a size without ``block_bytes``, or
            a percentage without ``num_unique_blocks``.
    """
    value = text.strip()
    if value.lower() in ("inf", "infinite", "none"):
        return None
    if value.isdigit():
        return int(value)
    if not value[:1].isdigit():  # e.g. -5: neither a count nor a size
        raise InvalidArgumentError(f"bad capacity {text!r}: give inf, a block count (5859), a percentage (5%) "
                                   f"or a size (3GiB)")
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            raise InvalidArgumentError(f"bad capacity {text!r}: not a percentage") from None
        if num_unique_blocks is None:
            raise InvalidArgumentError(f"capacity {text!r} is a percentage of a trace's distinct blocks")
        return int(num_unique_blocks * percent / 100.0)
    if block_bytes is None:
        raise InvalidArgumentError(f"capacity {text!r} is a size: give --block-bytes to turn it into blocks")
    try:
        return parse_size(value) // block_bytes
    except ValueError as exc:
        raise InvalidArgumentError(f"bad capacity {text!r}: {exc}") from None


def _split(values: Sequence[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _label(capacity_blocks: int | None) -> str:
    return "inf" if capacity_blocks is None else str(capacity_blocks)


COLUMNS = {
    "trace": "the trace file's name",
    "policy": "the eviction policy (default: what a node runs, adaptive; belady: the offline bound)",
    "capacity": "the memory tier's capacity as given (5%, 3GiB, 5859, inf)",
    "blocks": "the same in blocks: a percentage of the trace's distinct blocks, or a size over --block-bytes",
    "disk": "the disk tier below memory, as given, and in blocks (-: none)",
    "hit_ratio": "blocks found in the cached prefix / blocks requested",
    "token_hit": "prompt tokens those blocks cover / prompt tokens",
    "tier_hits": "the hit ratio's part served by each tier, memory/disk",
    "vs_lru": "hit_ratio / LRU's at the same capacities",
    "gap_closed": "(hit_ratio - LRU's) / (the bound's - LRU's): the share of LRU's distance to the bound made up",
    "M acc/s": "millions of block accesses the simulator replayed per second: its own speed, not the cache's",
}
"""Every column of the table, and what it means (printed under it)."""


def format_table(rows: Sequence[tuple[str, SimResult]], given: Sequence[tuple[str, str]] | None = None) -> str:
    """Plain aligned text: one row per (trace, result), with hit ratios, the ratio to LRU and the gap closed.

    Args:
        rows: ``(trace name, result)`` per run.
        given: per row, the memory and disk capacities as the user gave them (``5%``, ``3GiB``); the block
            counts alone when ``None``.

    ``vs_lru`` is the hit ratio over LRU's at the same capacities; ``gap_closed``
    is ``(hit - lru) / (bound - lru)``, the share of LRU's distance to the
    offline bound that the policy makes up (when both are in the rows).
    :data:`COLUMNS` says what every column means.
    """
    header = ("trace", "policy", "capacity", "blocks", "disk", "hit_ratio", "token_hit", "tier_hits", "vs_lru",
              "gap_closed", "M acc/s")

    def by(policy: str) -> dict[tuple[str, int | None, int], float]:
        return {(t, r.capacity_blocks, r.disk_capacity_blocks): r.hit_ratio for t, r in rows if r.policy == policy}

    lru, bound = by("lru"), by("belady")
    lines = [header]
    for index, (trace, r) in enumerate(rows):
        where = (trace, r.capacity_blocks, r.disk_capacity_blocks)
        base, top = lru.get(where), bound.get(where)
        closed = "-"
        if base is not None and top is not None and top > base and r.policy not in ("lru", "belady"):
            closed = f"{(r.hit_ratio - base) / (top - base):+.3f}"
        capacity_text, disk_text = given[index] if given is not None else (_label(r.capacity_blocks), "")
        disk = "-"
        if r.disk_capacity_blocks:
            disk = f"{disk_text} ({r.disk_capacity_blocks})" if disk_text and disk_text != str(
                r.disk_capacity_blocks) else str(r.disk_capacity_blocks)
        lines.append((
            trace, r.policy, capacity_text, _label(r.capacity_blocks), disk,
            f"{r.hit_ratio:.4f}", f"{r.token_hit_ratio:.4f}",
            "/".join(f"{x:.4f}" for x in r.tier_hit_ratios),
            f"{r.hit_ratio / base:.3f}" if base else "-", closed,
            f"{r.accesses_per_s / 1e6:.2f}" if r.policy != "infinite" else "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def legend() -> str:
    """What each column of :func:`format_table` means, a line each."""
    width = max(len(name) for name in COLUMNS)
    return "\n".join(f"  {name.ljust(width)}  {meaning}" for name, meaning in COLUMNS.items())


def plot(rows: Sequence[tuple[str, SimResult]], path: str | os.PathLike[str]) -> None:
    """Write a PNG of hit ratio against capacity, one line per (trace, policy); infinite is a dashed line.

    Raises:
        OSError: if the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(trace for trace, _ in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        mine = [r for t, r in rows if t == trace]
        for policy in dict.fromkeys(r.policy for r in mine):
            points = sorted((r.capacity_blocks, r.hit_ratio) for r in mine
                            if r.policy == policy and r.capacity_blocks is not None)
            if points:
                label = "bound (MIN with bypass)" if policy == "belady" else policy
                ax.plot([c for c, _ in points], [h for _, h in points], marker="o", label=label,
                         linestyle=":" if policy == "belady" else "-")
        infinite = [r.hit_ratio for r in mine if r.capacity_blocks is None]
        if infinite:
            ax.axhline(infinite[0], color="grey", linestyle="--", label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("prefix hit ratio (blocks)")
        ax.set_title(trace)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``subparsers``; it sets ``func=run``.

    Returns:
        The subcommand's parser.
    """
    parser = subparsers.add_parser(
        "simulate",
        help="replay request traces through eviction policies and report prefix hit ratios",
        description=("Replay request traces (Mooncake or generic JSONL, or agentic session files; see "
                     "kvstore.tools.trace) through the node's own store and eviction policies, over tiers that keep no bytes, and "
                     "through the offline bound, and report the prefix hit ratio at each capacity. A request "
                     "hits the longest prefix of its blocks that is resident."),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``simulate`` to ``parser``."""
    parser.add_argument("--trace", action="append", default=[], metavar="PATH",
                        help=f"trace file; repeatable or a comma list (default: {DEFAULT_TRACE})")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="trace format (default: auto)")
    parser.add_argument("--policy", default=DEFAULT_POLICIES,
                        help=f"comma list of default, {', '.join(POLICIES)} (default: {DEFAULT_POLICIES})")
    parser.add_argument("--capacity", default=DEFAULT_CAPACITIES,
                        help=f"comma list of memory-tier capacities: blocks, percentages of the trace's distinct "
                             f"blocks, sizes or inf (default: {DEFAULT_CAPACITIES.replace('%', '%%')})")
    parser.add_argument("--disk-capacity", default=None,
                        help="capacity of a disk tier below memory that takes its victims: blocks, a percentage "
                             "or a size (store.disk.capacity_bytes: blocks get the part of it LMDB leaves them, as on a node)")
    parser.add_argument("--block-bytes", default=None,
                        help="bytes of one block, to turn sizes into blocks (e.g. 512KiB)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help=f"tokens per block: checks Mooncake traces' hash_ids and weighs the token hit ratio "
                             f"(default: {MOONCAKE_BLOCK_TOKENS}, or a session file's block_size)")
    parser.add_argument("--kv-encoding", default="", metavar="NAME",
                        help="lossy KV encoding of the blocks (int8, fp8_e4m3, int4, int2): --block-bytes is the "
                             "exact bf16 block, and each block takes the bytes the encoding implies (docs/encodings.md)")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="write hit ratio vs capacity as a PNG")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result as JSON")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar over the runs on stderr (default: only on a terminal)")
    parser.add_argument("--legend", action=argparse.BooleanOptionalAction, default=True,
                        help="explain the table's columns under it (default: on)")


def encoded_block_bytes(exact_block_bytes: int | None, kv_encoding: str, block_tokens: int) -> int | None:
    """The bytes a block of ``exact_block_bytes`` (bf16, header included) takes under ``kv_encoding``.

    Raises:
        InvalidArgumentError: on an unknown encoding, or an encoding without ``--block-bytes``.
    """
    encoding = encoding_of(kv_encoding)
    if encoding is None:
        return exact_block_bytes
    if exact_block_bytes is None:
        raise InvalidArgumentError("--kv-encoding needs --block-bytes (the exact bf16 block's size)")
    header = header_nbytes(5, encoded=True)
    return header + math.ceil(max(exact_block_bytes - header, 0) * encoded_fraction(encoding, block_tokens))


def _block_tokens_of(path: str, format: str, given: int | None) -> int:
    """The trace's block size: ``given``, else a session file's ``block_size``, else Mooncake's 512."""
    if given is not None:
        return given
    first = path
    if os.path.isdir(path):
        first = next(iter(sorted(Path(path).glob("*.json"))), path)
    if os.path.isfile(first) and (format == "weka" or (format == "auto" and is_session_file(first))):
        return read_session(first).block_tokens
    return MOONCAKE_BLOCK_TOKENS


def run(args: argparse.Namespace) -> int:
    """Run ``simulate`` with parsed ``args``; print the table. Returns the exit status (0, or 2 on bad input)."""
    try:
        block_bytes = parse_size(args.block_bytes) if args.block_bytes else None
        if block_bytes is not None and block_bytes <= 0:
            raise InvalidArgumentError("--block-bytes must be > 0")
        if args.block_tokens is not None and args.block_tokens <= 0:
            raise InvalidArgumentError("--block-tokens must be > 0")
        policies = _split([args.policy])
        for policy in policies:
            resolve(policy)
        traces = _split(args.trace) or [str(DEFAULT_TRACE)]
        capacity_texts = _split([args.capacity])
        if not capacity_texts or not policies:
            raise InvalidArgumentError("give at least one capacity and one policy")
        for output in filter(None, (args.json, args.plot)):  # before the run, not after it
            if not Path(output).resolve().parent.is_dir():
                raise InvalidArgumentError(f"cannot write {output}: no directory {Path(output).resolve().parent}")
        rows: list[tuple[str, SimResult]] = []
        given: list[tuple[str, str]] = []
        exact_block_bytes = block_bytes
        plans = []
        for trace in traces:
            block_tokens = _block_tokens_of(trace, args.format, args.block_tokens)
            block_bytes = encoded_block_bytes(exact_block_bytes, getattr(args, "kv_encoding", ""), block_tokens)
            requests = read_trace(trace, args.format, block_tokens)
            if not requests:
                raise InvalidArgumentError(f"the trace {trace} has no requests (an empty file?); nothing to replay")
            unique = len({key for r in requests for key in r.block_ids})
            capacities = [parse_capacity(c, block_bytes, unique) for c in capacity_texts]
            disk_blocks = 0
            if args.disk_capacity:
                disk = parse_capacity(args.disk_capacity, block_bytes, unique)
                if disk is not None and _is_size(args.disk_capacity):
                    # a size is store.disk.capacity_bytes, the bound of data.mdb: blocks get its usable part
                    disk = usable_bytes(parse_size(args.disk_capacity.strip())) // block_bytes
                if disk is None:
                    raise InvalidArgumentError("--disk-capacity cannot be infinite")
                disk_blocks = disk
            name = Path(trace).stem
            for text, capacity in zip(capacity_texts, capacities):
                for policy in (["lru"] if capacity is None else policies):  # infinite: one row, nothing evicted
                    plans.append((name, requests, policy, text, capacity, disk_blocks, block_tokens))
        disk_text = (args.disk_capacity or "").strip()
        with _progress(len(plans), args.progress) as bar:
            for name, requests, policy, text, capacity, disk_blocks, block_tokens in plans:
                bar.set_postfix_str(f"{name} {policy} @ {text}", refresh=True)
                if capacity is None:
                    rows.append((name, simulate(requests, "lru", None, block_tokens=block_tokens)))
                else:
                    rows.append((name, simulate(requests, policy, capacity, disk_capacity_blocks=disk_blocks,
                                                block_tokens=block_tokens)))
                given.append((text, disk_text))
                bar.update(1)
    except (InvalidArgumentError, OSError) as exc:
        print(f"kvstore simulate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows, given))
    if args.legend:
        print(legend())
    if args.json:
        payload = {"traces": traces, "block_tokens": args.block_tokens, "block_bytes": block_bytes,
                   "kv_encoding": getattr(args, "kv_encoding", ""),
                   "results": [{"trace": t, "capacity": c, "disk_capacity": d or None, **r.to_dict()}
                               for (t, r), (c, d) in zip(rows, given)]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


def _progress(total: int, enabled: bool | None) -> Any:
    """A tqdm bar over the runs on stderr: shown when ``enabled``, or on a terminal when ``None``."""
    from tqdm import tqdm

    return tqdm(total=total, unit="run", desc="simulate", file=sys.stderr, leave=False,
                disable=not (sys.stderr.isatty() if enabled is None else enabled))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``simulate`` as a program of its own: ``python -m kvstore.tools.sim.cli [options]``."""
    parser = argparse.ArgumentParser(prog="kvstore")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["simulate", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
