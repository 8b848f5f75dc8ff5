"""``kvstore trace``: convert agentic session files into one trace, or generate synthetic agentic sessions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from kvstore.errors import InvalidArgumentError
from kvstore.tools.sim.agentic import AgenticConfig, generate_agentic
from kvstore.tools.trace import merge_sessions, write_trace

_EPILOG = """\
examples:
  kvstore trace convert sessions/*.json -o agentic.jsonl                 # kv-cache-tester sessions, all at t=0
  kvstore trace convert sessions/*.json -o agentic.jsonl --stagger 30 --shared-prefix 0.5
  kvstore trace generate -o synthetic_agentic.jsonl --sessions 100 --seed 1
  kvstore trace generate -o agentic_ttl.jsonl --ttl 300                   # every request with a 5-minute TTL
  kvstore simulate --trace agentic.jsonl --block-tokens 64 --capacity 1%,5%,25%
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``trace`` subcommand (``convert``, ``generate``) to ``subparsers``; it sets ``func``.

    Returns:
        The subcommand's parser.
    """
    parser = subparsers.add_parser(
        "trace", help="convert agentic session files to a trace, or generate synthetic agentic sessions",
        description="Make traces for kvstore simulate and kvstore loadtest (generic JSONL, see kvstore.tools.trace).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="trace_command", required=True)
    convert = actions.add_parser(
        "convert", help="merge kv-cache-tester agentic session files (JSON) into one trace",
        description="Merge agentic session files (one session per file, kv-cache-tester's format) into one "
                    "generic JSONL trace, their requests interleaved by time; sessions with local ids keep "
                    "apart.",
    )
    convert.add_argument("sessions", nargs="+", metavar="SESSION.json")
    convert.add_argument("-o", "--output", required=True, metavar="PATH.jsonl")
    convert.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                         help="seconds between the starts of consecutive sessions (default: 0, all at once)")
    convert.add_argument("--ttl", type=float, default=0.0, metavar="SECONDS",
                         help="a cache-control TTL every request carries (default: none; docs/agentic.md)")
    convert.add_argument("--shared-prefix", type=float, default=0.0, metavar="FRACTION",
                         help="fraction of each session's tool and system prefix that all sessions share "
                              "(kv-cache-tester's --warm-prefix-pct; default: 0)")
    convert.set_defaults(func=_convert)
    generate = actions.add_parser(
        "generate", help="generate synthetic agentic-coding sessions (kvstore.tools.sim.agentic)",
        description="Generate synthetic agentic sessions: shared system and tool prefixes, growing histories, "
                    "subagents forking a prefix, compaction; 64-token blocks. Seeded: the same options give "
                    "the same trace.",
    )
    defaults = AgenticConfig()
    generate.add_argument("-o", "--output", required=True, metavar="PATH.jsonl")
    generate.add_argument("--sessions", type=int, default=defaults.num_sessions)
    generate.add_argument("--duration", type=float, default=defaults.duration_s, metavar="SECONDS",
                          help="sessions start uniformly within this many seconds")
    generate.add_argument("--agent-types", type=int, default=defaults.num_agent_types,
                          help="distinct system and tool prefixes")
    generate.add_argument("--subagent-prob", type=float, default=defaults.subagent_prob)
    generate.add_argument("--block-tokens", type=int, default=defaults.block_tokens)
    generate.add_argument("--seed", type=int, default=defaults.seed)
    generate.add_argument("--ttl", type=float, default=defaults.ttl_s, metavar="SECONDS",
                          help="the cache-control TTL every request carries (default: none; docs/agentic.md)")
    generate.set_defaults(func=_generate)
    return parser


def _convert(args: argparse.Namespace) -> int:
    try:
        requests = merge_sessions([Path(p) for p in args.sessions], stagger_s=args.stagger,
                                  shared_prefix_fraction=args.shared_prefix, ttl_s=args.ttl)
        count = write_trace(args.output, requests)
    except (InvalidArgumentError, OSError) as exc:
        print(f"kvstore trace convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} requests from {len(args.sessions)} sessions to {args.output}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        config = AgenticConfig(num_sessions=args.sessions, duration_s=args.duration,
                               num_agent_types=args.agent_types, subagent_prob=args.subagent_prob,
                               block_tokens=args.block_tokens, seed=args.seed, ttl_s=args.ttl)
        count = write_trace(args.output, generate_agentic(config))
    except (InvalidArgumentError, OSError) as exc:
        print(f"kvstore trace generate: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} requests of {args.sessions} sessions to {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trace`` as a program of its own: ``python -m kvstore.tools.sim.trace_cli convert|generate ...``."""
    parser = argparse.ArgumentParser(prog="kvstore")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["trace", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
