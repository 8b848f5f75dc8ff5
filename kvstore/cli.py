"""The ``kvstore`` command line: ``serve`` a node, ask one for its ``stats`` or ``health``, and more subcommands.

Subcommands of other components live in their own modules, listed in
:data:`SUBCOMMAND_MODULES`; each has a ``register(subparsers)`` function that
adds its parser and sets ``func`` (called with the parsed arguments; it returns
the exit status).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvstore.connection import add_connection_arguments, target_argument

if TYPE_CHECKING:
    from kvstore.client import KVStoreClient

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "kvstore.tools.sim.cli", "kvstore.tools.sim.trace_cli", "kvstore.tools.loadtest.cli", "kvstore.tools.demo.cli", "kvstore.events.cli",
    "kvstore.tools.explain_cli",
)
"""Modules that add subcommands through ``register(subparsers)``."""

DEFAULT_TARGET = "127.0.0.1:50051"

_SERVE_EXAMPLES = """\
examples:
  kvstore serve                                   # memory tier of 1 GiB on 127.0.0.1:50051, metrics on :9400
  kvstore serve --host 0.0.0.0 --memory-capacity 8GiB --disk-path /var/lib/kvstore --disk-capacity 100GiB
  kvstore serve --config kvstore.toml --redis-url redis://cache:6379/0
  kvstore serve --port 0 --metrics-port 0         # free ports; the "serving" log line names them
  kvstore serve --unix-socket /run/kvstore/kvstore.sock --port -1   # no TCP port: file permissions grant access
  KVSTORE_MEMORY_CAPACITY=4GiB kvstore serve      # any setting from the environment (KVSTORE_*)

Settings are read from defaults, then --config, then KVSTORE_* variables, then
these flags. The server logs one JSON object a line on stderr, e.g.
{"event": "serving", "port": 50051, "metrics_port": 9400, ...}, and on SIGTERM or
SIGINT reports NOT_SERVING (for server.shutdown_delay_s seconds with the port
still open), drains calls for server.grace_s seconds and closes the store
(memory demoted to disk, LMDB flushed); a second signal cuts the waits short."""

_STATS_EXAMPLES = """\
examples:
  kvstore stats                                   # the node on 127.0.0.1:50051: a table on a terminal
  kvstore stats --target kv-0.kv:50051 --target kv-1.kv:50051   # several nodes, one table each
  kvstore stats --watch                           # refresh every 2 s, with rates (Ctrl-C stops)
  kvstore stats --json | jq '.tiers[] | {name, blocks, hit_ratio}'

On a terminal: the node's prefix hit ratio, then a line per tier, fastest first:
state, blocks, stored bytes, capacity and fill, hits, misses and hit ratio,
evictions, demotions, promotions and errors. Piped, or with --json: the same as
JSON, {"tiers": [{"name", "blocks", "bytes", "capacity_bytes", "fill", "hits",
"misses", "hit_ratio", "evictions", ..., "state", "last_error"}, ...],
"lookup_hit_blocks", "lookup_miss_blocks", "lookup_hit_ratio"} (a list under
"nodes" for several targets); "blocks" is null where the tier cannot tell (Redis)."""

_HEALTH_EXAMPLES = """\
examples:
  kvstore health                                  # exit 0 if SERVING
  kvstore health --target 10.0.0.7:50051 --timeout 2
  HEALTHCHECK CMD ["kvstore", "health", "--timeout", "2"]   # in a Dockerfile

Prints the grpc.health.v1 status (SERVING, NOT_SERVING, SERVICE_UNKNOWN for an
unknown --service, ...) and exits 0 only when it is SERVING; 1 otherwise, also
when the node cannot be reached (UNREACHABLE on stderr); 2 on a bad option.
A node that serves while its shared tier is down (Redis) is still SERVING; a
line such as "tier redis: down (last error: ...)" follows. The node's health
service tells (kvstore.tiers, kvstore.tier.<name>: no token needed); the last
error comes from its stats, which on a node with tokens need one."""


def _timeout_s(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0 (argparse reports the error and exits 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a client subcommand's ``--target``, ``--timeout`` and connection (TLS, token) flags to ``parser``."""
    parser.add_argument("--target", type=target_argument, default=DEFAULT_TARGET, metavar="HOST:PORT",
                        help=f"address of the node; a bare HOST means HOST:50051 (default {DEFAULT_TARGET})")
    parser.add_argument("--timeout", type=_timeout_s, default=5.0, metavar="SECONDS",
                        help="deadline of the call, seconds > 0 (default 5)")
    add_connection_arguments(parser)


_CORE_COMMANDS = ("serve", "stats", "health")

SERVE_SECURITY_HINT = (
    "a node takes TLS and tokens from its security.* settings, not from flags: in the --config file "
    "(security.tls_cert_file, tls_key_file, tls_client_ca_file, auth_tokens_file) or from KVSTORE_SECURITY__* "
    "variables, e.g. KVSTORE_SECURITY__TLS_CERT_FILE=server.crt; --tls-ca, --tls-cert/--tls-key and --token-file "
    "are the client commands' (docs/security.md)")
"""Added to ``serve``'s error for a client's TLS or token flag."""


def build_parser(extra_modules: Sequence[str] = SUBCOMMAND_MODULES) -> argparse.ArgumentParser:
    """The ``kvstore`` argument parser: the core commands plus those of ``extra_modules``."""
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="A multi-tier KV-cache store for LLM inference, served over gRPC.",
        epilog="Run 'kvstore COMMAND --help' for the options and examples of a command.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = subparsers.add_parser(
        "serve", help="run a kvstore node (gRPC, health, reflection, Prometheus metrics)",
        description="Run a kvstore node: the KVStore gRPC service with grpc.health.v1 and reflection, "
                    "and Prometheus metrics over HTTP.",
        epilog=_SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE", help="TOML or YAML file whose tables mirror kvstore.config.Config")
    serve.add_argument("--host", help="bind address (server.host, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port; 0 picks a free one, -1 none (server.port, default 50051)")
    serve.add_argument("--unix-socket", metavar="PATH",
                       help="also listen on this Unix socket, e.g. /run/kvstore/kvstore.sock (server.unix_socket); "
                            "clients connect to unix:///run/kvstore/kvstore.sock")
    serve.add_argument("--no-shared-memory", dest="shared_memory", action="store_false", default=None,
                       help="offer no same-host data plane: every client uses gRPC (shared_memory.enabled)")
    serve.add_argument("--no-bulk", dest="bulk", action="store_false", default=None,
                       help="offer no bulk path: remote clients' bytes ride in gRPC messages (bulk.enabled)")
    serve.add_argument("--bulk-port", type=int,
                       help="the bulk listener's TCP port; 0 picks a free one (bulk.port, default 0)")
    serve.add_argument("--metrics-port", type=int,
                       help="Prometheus port; 0 picks a free one, -1 disables (server.metrics_port, default 9400)")
    serve.add_argument("--events-endpoint", metavar="ZMQ",
                       help="publish KV events for routers on this ZMQ address, e.g. tcp://127.0.0.1:5557 "
                            "(events.endpoint; off by default; docs/events.md)")
    serve.add_argument("--memory-capacity", metavar="SIZE",
                       help="memory tier size, e.g. 8GiB; 0 disables it (store.memory.capacity_bytes)")
    serve.add_argument("--disk-path", metavar="DIR", help="LMDB directory; enables the disk tier (store.disk.path)")
    serve.add_argument("--disk-capacity", metavar="SIZE", help="disk tier size, e.g. 100GiB (store.disk.capacity_bytes)")
    serve.add_argument("--redis-url", metavar="URL", help="redis:// or rediss:// URL; enables the Redis tier")
    serve.add_argument("--policy", metavar="NAME",
                       help="eviction policy of the local tiers: default, lru, slru, adaptive or session (agentic "
                            "sessions: docs/agentic.md), as kvstore simulate --policy names them (store.policy, "
                            "default: default = adaptive)")
    serve.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper,
                       help="server.log_level (default INFO)")
    serve.add_argument("--log-format", choices=("json", "text"), help="server.log_format (default json)")
    serve.set_defaults(func=_serve)

    stats = subparsers.add_parser(
        "stats", help="show a node's hit ratio and per-tier stats (a table, JSON, or a live view)",
        description=textwrap.fill("Show a node's prefix hit ratio and its tiers' stats: blocks, bytes stored and the "
                                  "capacity they fill, hits, misses and hit ratio, evictions, demotions, promotions, "
                                  "errors. A table on a terminal, JSON when piped or with --json.") + "\n\n" +
        textwrap.fill(
            "A tier's misses are the blocks a lookup or get asked it for and it could not serve: a block served "
            "from disk is a memory miss and a disk hit, and every block a lookup asked for past the cached prefix "
            "is a miss of every tier; so a tier's hit ratio, hits / (hits + misses), is the share of the blocks "
            "asked of it that it served. The prefix hit ratio is the lookups': blocks found in the cached prefix "
            "over blocks asked for. Every counter is defined in docs/service.md (Metrics)."),
        epilog=_STATS_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument("--target", type=target_argument, action="append", default=None, metavar="HOST:PORT",
                       help=f"address of a node, a bare HOST meaning HOST:50051; repeatable (default {DEFAULT_TARGET})")
    stats.add_argument("--timeout", type=_timeout_s, default=5.0, metavar="SECONDS",
                       help="deadline of each call, seconds > 0 (default 5)")
    add_connection_arguments(stats)
    output = stats.add_mutually_exclusive_group()
    output.add_argument("--json", dest="format", action="store_const", const="json",
                        help="print JSON (the default when stdout is not a terminal)")
    output.add_argument("--table", dest="format", action="store_const", const="table",
                        help="print the table (the default on a terminal)")
    stats.add_argument("--watch", type=_timeout_s, nargs="?", const=2.0, default=None, metavar="SECONDS",
                       help="refresh every SECONDS (default 2) with the rates since the last refresh, as "
                            "`redis-cli --stat` does; Ctrl-C stops")
    stats.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")
    stats.set_defaults(func=_stats)

    health = subparsers.add_parser(
        "health", help="check a node's health; exit 0 if SERVING",
        description="Ask a node for its grpc.health.v1 status; exit 0 if SERVING, 1 otherwise.",
        epilog=_HEALTH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(health)
    health.add_argument("--service", default="", help="service to check; empty for the whole server (default)")
    health.set_defaults(func=_health)

    for name in extra_modules:
        _register(name, subparsers)
    for command in subparsers.choices.values():
        command.allow_abbrev = False  # `serve --memory 1GiB` is not --memory-capacity
        command.set_defaults(command_parser=command)  # to report an unknown option with this usage
    return parser


def _register(module_name: str, subparsers: Any) -> None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module exists but a dependency of it is missing
            raise
        return  # an optional component that is not installed
    register: Callable[[Any], None] = module.register
    register(subparsers)


def _serve(args: argparse.Namespace) -> int:
    from kvstore.config import load_config
    from kvstore.errors import ConfigError
    from kvstore.server.process import run

    overrides = {
        "server.host": args.host,
        "server.port": args.port,
        "server.unix_socket": args.unix_socket,
        "shared_memory.enabled": args.shared_memory,
        "bulk.enabled": args.bulk,
        "bulk.port": args.bulk_port,
        "server.metrics_port": args.metrics_port,
        "events.endpoint": args.events_endpoint,
        "server.log_level": args.log_level,
        "server.log_format": args.log_format,
        "store.memory.capacity_bytes": args.memory_capacity,
        "store.disk.path": args.disk_path,
        "store.disk.capacity_bytes": args.disk_capacity,
        "store.redis.url": args.redis_url,
        "store.policy": args.policy,
    }
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvstore serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return run(config)


def client_from_args(command: str, args: argparse.Namespace) -> KVStoreClient | None:
    """A client of ``--target`` with ``--timeout`` and no retries (the flags of :func:`add_target_arguments`);
    ``None``, the error printed under ``kvstore COMMAND``, on a bad flag."""
    from kvstore.client import KVStoreClient
    from kvstore.connection import Connection
    from kvstore.errors import ConfigError, InvalidArgumentError

    try:
        return KVStoreClient(args.target, timeout_s=args.timeout, retries=0,
                             **Connection.from_args(args).client_kwargs())
    except (InvalidArgumentError, ConfigError) as exc:
        print(f"kvstore {command}: invalid argument: {exc}", file=sys.stderr)
        return None


def _stats(args: argparse.Namespace) -> int:
    """``kvstore stats``: 0 with the stats on stdout; 1 if a node fails the call; 2 on a bad flag."""
    from kvstore.client import KVStoreClient
    from kvstore.connection import Connection
    from kvstore.errors import ConfigError, InvalidArgumentError, KVStoreError
    from kvstore.tools.stats_view import FOOTNOTE, format_table, format_watch, stats_report

    targets = args.target or [DEFAULT_TARGET]
    if args.count is not None and (args.count < 1 or args.watch is None):
        print("kvstore stats: invalid argument: --count needs --watch and must be >= 1", file=sys.stderr)
        return 2
    table = args.format == "table" or (args.format is None and sys.stdout.isatty())
    try:
        kwargs = Connection.from_args(args).client_kwargs()
        clients = [KVStoreClient(t, timeout_s=args.timeout, retries=0, **kwargs) for t in targets]
    except (InvalidArgumentError, ConfigError) as exc:
        print(f"kvstore stats: invalid argument: {exc}", file=sys.stderr)
        return 2
    previous: list[Any] = [None] * len(clients)
    frames, last = 0, 0.0
    try:
        while True:
            started = time.monotonic()
            current = []
            for target, client in zip(targets, clients):
                try:
                    current.append(client.stats())
                except KVStoreError as exc:
                    print(f"kvstore stats: {target}: {exc}", file=sys.stderr)
                    return 1
            if args.watch is None and not table:
                reports = [stats_report(s) for s in current]
                print(json.dumps(reports[0] if len(reports) == 1 else
                                 {"nodes": [{"target": t, **r} for t, r in zip(targets, reports)]}, indent=2))
                return 0
            if args.watch is None:
                print("\n\n".join(format_table(t, s) for t, s in zip(targets, current)))
                print(textwrap.fill(FOOTNOTE))
                return 0
            if table:
                print("\x1b[H\x1b[2J", end="")  # clear the screen, as watch(1) and top do
            now = time.monotonic()
            frame = "\n\n".join(format_watch(t, s, p, now - last) for t, s, p in zip(targets, current, previous))
            print(f"{time.strftime('%H:%M:%S')}  every {args.watch:g} s\n{frame}" if table else
                  json.dumps({"time": time.time(), "nodes": [{"target": t, **stats_report(s)}
                                                             for t, s in zip(targets, current)]}), flush=True)
            previous, frames, last = current, frames + 1, now
            if args.count is not None and frames >= args.count:
                return 0
            time.sleep(max(0.0, args.watch - (time.monotonic() - started)))  # the refresh period of the live view
    except KeyboardInterrupt:
        return 0
    finally:
        for client in clients:
            client.close()


def _health(args: argparse.Namespace) -> int:
    """``kvstore health``: prints the status and returns 0 if SERVING, else 1 (also when the node
    cannot be reached, printed as UNREACHABLE on stderr); 2 on a bad flag."""
    from kvstore.errors import KVStoreError, UnavailableError

    client = client_from_args("health", args)
    if client is None:
        return 2
    with client:
        try:
            status = client.health(args.service)
        except UnavailableError as exc:  # also DeadlineExceededError
            print(f"UNREACHABLE: {args.target}: {exc}", file=sys.stderr)
            return 1
        except KVStoreError as exc:  # the node answered with an error (e.g. UNAUTHENTICATED)
            print(f"kvstore health: {args.target}: {exc}", file=sys.stderr)
            return 1
        print(status)
        if status == "SERVING":
            for line in _tier_problems(client):
                print(line)
    return 0 if status == "SERVING" else 1


def _tier_problems(client: KVStoreClient) -> list[str]:
    """A line for each tier of the node that is down (a shared Redis), empty while all are up.

    Asks the health service ``kvstore.tiers`` (``kvstore.server.health``; it
    needs no token), and only while a tier is down the stats, for its last
    error; where those need a token that was not given, the line says so.
    """
    from kvstore.errors import KVStoreError
    from kvstore.server.health import TIERS_SERVICE

    try:
        if client.health(TIERS_SERVICE) != "NOT_SERVING":
            return []  # SERVING, or SERVICE_UNKNOWN from a node that predates the tier services
        stats = client.stats()
    except KVStoreError:
        return ["a tier of the node is down; `kvstore stats` (with the node's token) gives its last error"]
    return [f"tier {t.name}: {t.state}" + (f" (last error: {t.last_error})" if t.last_error else "")
            for t in stats.tiers if t.state == "down"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvstore`` command line; returns the exit status (the ``kvstore`` console script).

    Args:
        argv: arguments after the program name; ``sys.argv[1:]`` when ``None``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    core_only = bool(argv) and argv[0] in _CORE_COMMANDS  # `kvstore health` in a probe need not import torch
    parser = build_parser(() if core_only else SUBCOMMAND_MODULES)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the usage of the subcommand, not the top level's
        command: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        hint = ""
        if getattr(args, "command", None) == "serve" and any(u.startswith(("--tls", "--token")) for u in unknown):
            hint = f" ({SERVE_SECURITY_HINT})"
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
