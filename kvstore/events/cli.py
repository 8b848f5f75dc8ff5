"""``kvstore events``: subscribe to a node's KV events and print them, or the blocks per tier (``--summary``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

_EPILOG = """\
examples:
  kvstore events --target tcp://127.0.0.1:5557             # one JSON object per event, as they come
  kvstore events --target tcp://kv-0:5557 --summary --duration 10
  kvstore events --target tcp://127.0.0.1:5557 --from-seq 0 --max-batches 100 # replay what the node buffers

Each line is {"seq": ..., "ts": ..., "type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared",
"medium": ..., "namespace": "<hex>", "block_hashes": ["<hex>", ...], ...}. With --summary it prints
{"tiers": {"memory": N, "disk": M}, "events": {"stored": ..., "evicted": ...}, "missed_batches": ...}
once at the end (and every --every seconds). The replay socket is the next port (--replay to name it).
A node with tokens sends its events only to subscribers with a token, and only those of the tenants the
token covers (all of them for a token of every tenant): --token-file FILE, --token TOKEN, or the variables
KVSTORE_TOKEN_FILE and KVSTORE_TOKEN."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``events`` subcommand to ``subparsers``; it sets ``func``.

    Returns:
        The subcommand's parser.
    """
    parser = subparsers.add_parser(
        "events", help="subscribe to a node's KV events (events.endpoint) and print them",
        description="Follow a node's KV event stream (vLLM's framing; docs/events.md): print each event, or "
                    "count the blocks it holds per tier.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, metavar="ZMQ",
                        help="the node's events.endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--replay", metavar="ZMQ", default="",
                        help="its replay endpoint (default: the next tcp port; 'off': none)")
    parser.add_argument("--topic", default="kvstore", help="topic prefix (events.topic; default kvstore)")
    parser.add_argument("--from-seq", type=int, default=None, metavar="N",
                        help="first replay what the node buffers from sequence number N (default: live only)")
    parser.add_argument("--summary", action="store_true", help="print blocks per tier, not each event")
    parser.add_argument("--every", type=float, default=0.0, metavar="SECONDS",
                        help="with --summary, also print it every SECONDS")
    parser.add_argument("--duration", type=float, default=0.0, metavar="SECONDS",
                        help="stop after SECONDS (default: run until interrupted)")
    parser.add_argument("--max-batches", type=int, default=0, metavar="N", help="stop after N batches")
    parser.add_argument("--token-file", metavar="FILE", help="bearer token for a node with tokens, the file's first "
                                                             "line (KVSTORE_TOKEN_FILE)")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token itself (KVSTORE_TOKEN; prefer the file)")
    parser.set_defaults(func=_run)
    return parser


def event_json(seq: int, ts: float, event: Any) -> dict[str, Any]:
    """One event as a JSON-ready dict: its fields, bytes as hex, plus ``seq``, ``ts`` and ``type``."""
    import msgspec

    out: dict[str, Any] = {"seq": seq, "ts": ts, "type": type(event).__name__}
    for name, value in msgspec.structs.asdict(event).items():
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.hex() for v in value]
        out[name] = value
    return out


def _run(args: argparse.Namespace) -> int:
    from kvstore.connection import Connection
    from kvstore.events.publisher import replay_address
    from kvstore.events.subscriber import EventStreamError, EventSubscriber, TierView

    token = Connection.from_args(args).token or None

    replay = replay_address(args.target, args.replay) if args.target.startswith(("tcp://", "ipc://")) else None
    view = TierView()
    num_batches = 0
    started = last_summary = time.monotonic()

    def summary() -> None:
        print(json.dumps({"tiers": view.per_tier(), "events": dict(view.num_events),
                          "batches": num_batches, "missed_batches": subscriber.num_missed}), flush=True)

    with EventSubscriber(args.target, replay, topic=args.topic, from_seq=args.from_seq, token=token) as subscriber:
        try:
            while True:
                now = time.monotonic()
                if args.duration and now - started >= args.duration:
                    break
                if args.max_batches and num_batches >= args.max_batches:
                    break
                missed = subscriber.num_missed
                for seq, batch in subscriber.receive(0.2):
                    num_batches += 1
                    if subscriber.num_missed > missed:  # a hole no replay could fill: what we knew is unsure
                        view.reset()
                        missed = subscriber.num_missed
                    view.apply(batch)
                    if not args.summary:
                        for event in batch.events:
                            print(json.dumps(event_json(seq, batch.ts, event)), flush=True)
                if args.summary and args.every and time.monotonic() - last_summary >= args.every:
                    last_summary = time.monotonic()
                    summary()
        except KeyboardInterrupt:
            pass
        except (EventStreamError, TimeoutError) as exc:
            print(f"kvstore events: {exc}", file=sys.stderr)
            return 1
        if args.summary:
            summary()
    return 0
