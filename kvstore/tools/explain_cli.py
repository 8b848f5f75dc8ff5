"""``kvstore explain``: ask a node why the blocks of one request hit or missed, block by block."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from kvstore.store.explain import BlockExplanation, differing_fields
from kvstore.keys import HashAlgorithm, Namespace, hash_blocks

_EPILOG = """\
examples:
  kvstore explain --target 127.0.0.1:50051 --model meta-llama/Llama-3.1-8B --block-size 16 --tokens 1,2,3,...
  kvstore explain --model m --block-size 16 --tokens-file prompt_ids.json --json
  kvstore explain --model m --block-size 16 --hashes 9f3a...,71c0...          # block hashes, hex
  kvstore explain --request-id 5c2e1d                                        # a recent Lookup that named it

Each block is a hit (and its tier) or one cause of a miss: never_stored, other_namespace,
evicted, expired, dropped, lost, deleted, after_miss, tier_unavailable, lease_lost
(docs/agentic.md explains each, and how to read them to size a cache). Runs of blocks
with one cause are printed as one line. Explain changes nothing on the node.
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``explain`` subcommand to ``subparsers``; it sets ``func=run``.

    Returns:
        The subcommand's parser.
    """
    from kvstore.cli import add_target_arguments

    parser = subparsers.add_parser(
        "explain", help="why the blocks of one request hit or missed on a node, block by block",
        description="Ask a node, for the blocks of one request (a token list, a block-hash list, or a request id a "
                    "Lookup named), whether each is cached and, where it is not, why: the cause of the miss, in words "
                    "and as JSON.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", metavar="IDS", help="token ids, comma-separated (hashed here, full blocks only)")
    what.add_argument("--tokens-file", metavar="PATH", help="a JSON list of token ids")
    what.add_argument("--hashes", metavar="HEX", help="block hashes in hex, comma-separated")
    what.add_argument("--hashes-file", metavar="PATH", help="block hashes in hex, one a line")
    what.add_argument("--request-id", metavar="ID", help="a request id a recent Lookup named (the node keeps the last)")
    parser.add_argument("--model", help="the namespace's model (not with --request-id)")
    parser.add_argument("--revision", default="")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--layout", default="kv")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--adapter", default="")
    parser.add_argument("--cache-salt", default="", help="the tenant's salt")
    parser.add_argument("--hash-algorithm", default="xxh3_128", choices=[a.value for a in HashAlgorithm])
    parser.add_argument("--kv-encoding", default="")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines for a person")
    parser.set_defaults(func=run)
    return parser


def _namespace(args: argparse.Namespace) -> Namespace:
    return Namespace(model=args.model, revision=args.revision, dtype=args.dtype, layout=args.layout,
                     block_size=args.block_size, tp_size=args.tp_size, tp_rank=args.tp_rank, adapter=args.adapter,
                     cache_salt=args.cache_salt, hash_algorithm=HashAlgorithm(args.hash_algorithm),
                     kv_encoding=args.kv_encoding)


def _tokens(args: argparse.Namespace) -> list[int] | None:
    if args.tokens is not None:
        return [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
    if args.tokens_file is not None:
        data = json.loads(Path(args.tokens_file).read_text())
        if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
            raise ValueError(f"{args.tokens_file} must hold a JSON list of token ids")
        return data
    return None


def _hashes(args: argparse.Namespace) -> list[bytes] | None:
    if args.hashes is not None:
        return [bytes.fromhex(h.removeprefix("0x")) for h in args.hashes.replace(" ", "").split(",") if h]
    if args.hashes_file is not None:
        return [bytes.fromhex(line.strip().removeprefix("0x")) for line in Path(args.hashes_file).read_text().splitlines()
                if line.strip()]
    return None


def summarize(blocks: Sequence[BlockExplanation]) -> list[str]:
    """Lines for a person: the hit prefix, then each run of blocks with one cause (and one detail)."""
    lines: list[str] = []
    hits = sum(block.hit for block in blocks)
    lines.append(f"{len(blocks)} blocks: {hits} hit, {len(blocks) - hits} missed")
    start = 0
    while start < len(blocks):
        first = blocks[start]
        end = start + 1
        while end < len(blocks) and (blocks[end].hit, blocks[end].tier if first.hit else blocks[end].cause,
                                     blocks[end].detail if not first.hit else "") == \
                (first.hit, first.tier if first.hit else first.cause, first.detail if not first.hit else ""):
            end += 1
        span = f"block {start}" if end == start + 1 else f"blocks {start}-{end - 1} ({end - start})"
        if first.hit:
            lines.append(f"  {span}: hit in {first.tier}")
        else:
            where = f" [in {first.tier}]" if first.tier else ""
            lines.append(f"  {span}: {first.cause}{where}: {first.detail}")
        start = end
    return lines


def run(args: argparse.Namespace) -> int:
    """Run ``explain``; print the blocks. Returns 0, 1 if the node fails the call, or 2 on bad input."""
    from kvstore.cli import client_from_args
    from kvstore.errors import KVStoreError

    try:
        tokens = _tokens(args)
        hashes = _hashes(args)
        namespace = None
        if args.request_id is None:
            if not args.model:
                raise ValueError("--model is needed (the namespace of the request) unless --request-id names it")
            namespace = _namespace(args)
            if tokens is not None:
                hashes = hash_blocks(namespace, tokens)
    except (ValueError, OSError, KVStoreError) as exc:
        print(f"kvstore explain: error: {exc}", file=sys.stderr)
        return 2
    client = client_from_args("explain", args)
    if client is None:
        return 2
    with client:
        try:
            blocks, explained, near = client.explain(namespace, hashes or [], request_id=args.request_id)
            confirm = _confirm_near(client, explained or namespace, near, tokens)
        except KVStoreError as exc:
            print(f"kvstore explain: {args.target}: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"blocks": [b.to_dict() for b in blocks],
                          "near_namespace": _namespace_dict(near), "near": confirm}, indent=2))
        return 0
    print("\n".join(summarize(blocks)))
    asked = explained or namespace
    if near is not None and asked is not None:
        fields = differing_fields(asked, near)
        print(f"a near namespace holds blocks here; it differs in {', '.join(fields)}: "
              + ", ".join(f"{name} {getattr(near, name)!r} (this request: {getattr(asked, name)!r})"
                          for name in fields))
        if confirm is not None:
            print(f"the same tokens under it: {confirm['hit_blocks']} of {confirm['blocks']} blocks cached")
    return 0


def _confirm_near(client: Any, namespace: Namespace | None, near: Namespace | None,
                  tokens: list[int] | None) -> dict[str, int] | None:
    """With tokens and a near namespace: how many of the same tokens' blocks it holds (an Explain there, which,
    unlike a Lookup, counts nothing)."""
    if near is None or tokens is None or namespace is None:
        return None
    near_hashes = hash_blocks(near, tokens)
    blocks, _, _ = client.explain(near, near_hashes)
    return {"blocks": len(near_hashes), "hit_blocks": sum(block.hit for block in blocks)}


def _namespace_dict(namespace: Namespace | None) -> dict[str, Any] | None:
    if namespace is None:
        return None
    return {name: (value.value if isinstance(value, HashAlgorithm) else value)
            for name, value in ((n, getattr(namespace, n)) for n in (
                "model", "revision", "dtype", "layout", "block_size", "tp_size", "tp_rank", "adapter", "cache_salt",
                "hash_algorithm", "kv_encoding"))}
