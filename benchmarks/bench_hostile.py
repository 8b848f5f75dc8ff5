"""Hostile gRPC clients of a real node, and its resident memory (RSS) before, at the peak of, and after each attack.

Two ``kvstore serve`` nodes with a 16 MiB memory tier (as in issue 18's report), one open and one with token
authentication, are attacked in turn by raw gRPC clients (``tests/support/hostile.py``), while a well-behaved
client keeps reading its prefix and checking every byte:

* Lookups whose namespaces carry distinct 4 MB model strings (refused: INVALID_ARGUMENT);
* Lookups in many distinct valid namespaces of ~900 bytes (the servicer caches namespaces, bounded in bytes);
* without a token (UNAUTHENTICATED), and with a token in other tenants' namespaces (PERMISSION_DENIED);
* Gets of a cached prefix of 8 blocks of 512 KiB (8 layers, 8 KV heads, head_dim 128, 16 tokens, fp16) whose callers stop reading.

Each attack runs in rounds; a node keeps some freed heap for reuse by design (``kvstore.server.process.tune_malloc``),
so what matters is that the RSS after a round does not grow with the rounds or the number of calls. Issue 18
measured 238 MB to 2.3 GB for 250 refused 4 MB Lookups before the fix.

With ``--stalled-only`` it measures the reply budget (issue 32: bytes held for unread replies are bounded per
connection, ``limits.connection_reply_bytes``): ``--stalled`` stalled Gets on one connection, in rounds,
against a node whose budget is effectively off (64 GiB) and one with the default (64 MiB), in the same run. Goals:
the Gets add at most the budget to the node's RSS, and RSS comes back within 5% of its level before once the
client has gone. Results go to ``benchmarks/results/bench_hostile_stalled.{json,md}``.

Usage::

    python benchmarks/bench_hostile.py [--rounds 3] [--oversized 250] [--distinct 20000] [--stalled 256]
    python benchmarks/bench_hostile.py --stalled-only [--rounds 4] [--stalled 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--oversized", type=int, default=250, help="refused 4 MB Lookups per round")
    parser.add_argument("--distinct", type=int, default=20000, help="distinct namespaces per round")
    parser.add_argument("--denied", type=int, default=5000, help="PERMISSION_DENIED Lookups per round")
    parser.add_argument("--stalled", type=int, default=256, help="stalled Gets per round (one connection)")
    parser.add_argument("--threads", type=int, default=8, help="attackers calling at once")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_hostile"),
                        help="results path without suffix (.json and .md are written)")
    parser.add_argument("--stalled-only", action="store_true",
                        help="only the stalled readers, against a node without and one with the reply budget")
    args = parser.parse_args()
    if args.stalled_only:
        stalled_only(args)
        return

    from kvstore.keys import HashAlgorithm, Namespace
    from tests.support.security import AUTH_TOKENS, TOKEN_A
    from tests.security.test_hostile_clients import GoodClient
    from tests.support.server import kv_blocks
    from tests.support.hostile import Attacks, rss_bytes
    from tests.support.kvnode import KVNode
    from kvstore.client import KVStoreClient

    load_before = os.getloadavg()
    rows: list[dict[str, object]] = []
    reads: dict[str, int] = {}

    def record(node_name: str, figures) -> None:  # type: ignore[no-untyped-def]
        row = {"node": node_name, **figures.row()}
        rows.append(row)
        print(json.dumps(row), flush=True)

    sha = lambda name, salt="": Namespace(model=name, cache_salt=salt, hash_algorithm=HashAlgorithm.SHA256)  # noqa: E731
    with KVNode(memory_capacity="16MiB") as node:
        good = GoodClient(node, sha("good"))
        attacks = Attacks(node.target, node.pid, threads=args.threads)
        baseline = rss_bytes(node.pid)
        for _ in range(args.rounds):
            record("open", attacks.oversized_namespaces(args.oversized))
        for _ in range(args.rounds):
            record("open", attacks.distinct_namespaces(args.distinct))
        namespace = sha("stalled")
        hashes, tensors = kv_blocks(namespace, 8, num_layers=8, num_kv_heads=8, head_dim=128)
        with KVStoreClient(node.target, timeout_s=60) as kv:
            kv.put(namespace, hashes, tensors)
        for _ in range(args.rounds):
            record("open", Attacks(node.target, node.pid).stalled_readers(namespace, hashes, args.stalled, hold_s=2.0))
        good.stop()
        reads["open"] = good.num_reads
        open_baseline = baseline
    with KVNode(memory_capacity="16MiB", env={"KVSTORE_SECURITY__AUTH_TOKENS": AUTH_TOKENS}) as node:
        good = GoodClient(node, sha("good", "tenant-a"), token=TOKEN_A)
        auth_baseline = rss_bytes(node.pid)
        strangers = Attacks(node.target, node.pid, threads=args.threads)
        tenant_a = Attacks(node.target, node.pid, token=TOKEN_A, threads=args.threads)
        for _ in range(args.rounds):
            record("auth, no token", strangers.oversized_namespaces(args.oversized))
        for _ in range(args.rounds):
            record("auth, another tenant's", tenant_a.distinct_namespaces(args.denied, cache_salt="tenant-b"))
        for _ in range(args.rounds):
            record("auth, tenant A", tenant_a.oversized_namespaces(args.oversized))
        good.stop()
        reads["auth"] = good.num_reads

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "baseline_rss_mib": {"open": round(open_baseline / 2**20, 1), "auth": round(auth_baseline / 2**20, 1)},
            "good_client_reads": reads}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rounds": rows}, indent=2))
    lines = [
        "# Hostile clients: a node's RSS under attack",
        "",
        f"Command: `{command}` ({meta['cpus']} CPUs, Python {meta['python']}, load average "
        f"{meta['load_average_before'][0]} before, {meta['load_average_after'][0]} after). Nodes: `kvstore serve` "
        f"with a 16 MiB memory tier; RSS at start (after the good client's put): "
        f"{meta['baseline_rss_mib']['open']} MiB (open), {meta['baseline_rss_mib']['auth']} MiB (auth). "
        f"A good client read its prefix {reads['open']} and {reads['auth']} times during the attacks, every byte "
        "checked, with no error.",
        "",
        "| node | attack (one round) | status codes | s | RSS before (MiB) | peak (MiB) | after (MiB) |",
        "|---|---|---|---:|---:|---:|---:|",
        *[f"| {r['node']} | {r['attack']} | {', '.join(f'{k} {v}' for k, v in r['codes'].items())} | "  # type: ignore[union-attr]
          f"{r['seconds']} | {r['rss_before_mib']} | {r['rss_peak_mib']} | {r['rss_after_mib']} |" for r in rows],
        "",
        "Before this release, 250 refused Lookups with distinct 4 MB models took such a node from 238 MB to 2.3 GB "
        "(issue 18), and it stayed.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def stalled_only(args: argparse.Namespace) -> None:
    """Stalled Gets on one connection against a node with the reply budget off (64 GiB) and on (the default)."""
    import time

    from kvstore.client import KVStoreClient
    from kvstore.keys import Namespace
    from tests.support.hostile import Attacks, rss_bytes
    from tests.support.kvnode import KVNode
    from tests.support.server import kv_blocks

    load_before = os.getloadavg()
    rows: list[dict[str, object]] = []
    namespace = Namespace(model="stalled")
    hashes, tensors = kv_blocks(namespace, 8, num_layers=8, num_kv_heads=8, head_dim=128)
    reply_mib = round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 2)
    nodes = [("budget off (64 GiB)", {"KVSTORE_LIMITS__CONNECTION_REPLY_BYTES": "64GiB",
                                       "KVSTORE_LIMITS__TENANT_REPLY_BYTES": "64GiB"}),
             ("default budget (64 MiB)", {})]
    for name, env in nodes:
        with KVNode(memory_capacity="16MiB", env=env) as node:
            with KVStoreClient(node.target, timeout_s=60, shared_memory=False) as kv:
                kv.put(namespace, hashes, tensors)
                for _ in range(8):  # warm the Get path (and the node's bytes-per-block estimate)
                    kv.get(namespace, hashes)
            start = rss_bytes(node.pid)
            for _ in range(args.rounds):
                figures = Attacks(node.target, node.pid).stalled_readers(namespace, hashes, args.stalled, hold_s=2.0)
                time.sleep(1.0)  # a benchmark, not a test: let gRPC finish the cancelled calls before sampling
                row = {"node": name, **figures.row(), "rss_settled_mib": round(rss_bytes(node.pid) / 2**20, 1),
                       "rss_start_mib": round(start / 2**20, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    by_node: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_node.setdefault(str(row["node"]), []).append(row)
    summary = {}
    for name, node_rows in by_node.items():
        start_mib = float(node_rows[0]["rss_start_mib"])  # type: ignore[arg-type]
        added = max(float(r["rss_peak_mib"]) for r in node_rows) - start_mib  # type: ignore[arg-type]
        settled = float(node_rows[-1]["rss_settled_mib"])  # type: ignore[arg-type]
        summary[name] = {"added_peak_mib": round(added, 1), "settled_vs_start": round(settled / start_mib, 4)}
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "reply_mib": reply_mib,
            "summary": summary}
    out = Path(args.out + "_stalled")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rounds": rows}, indent=2))
    on = summary["default budget (64 MiB)"]
    lines = [
        "# Stalled readers and the reply budget: a node's RSS",
        "",
        f"Command: `{command}` ({meta['cpus']} CPUs, Python {meta['python']}, load average "
        f"{meta['load_average_before'][0]} before, {meta['load_average_after'][0]} after). Each round: "
        f"{args.stalled} Gets of a {reply_mib} MiB prefix (8 blocks) on one connection, none read for 2 s, then "
        "cancelled and the channel closed (the client gone); RSS sampled every 20 ms, and 1 s after.",
        "",
        "| node | round codes | s | RSS before (MiB) | peak (MiB) | after (MiB) | 1 s after (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
        *[f"| {r['node']} | {', '.join(f'{k} {v}' for k, v in r['codes'].items())} | {r['seconds']} | "  # type: ignore[union-attr]
          f"{r['rss_before_mib']} | {r['rss_peak_mib']} | {r['rss_after_mib']} | {r['rss_settled_mib']} |"
          for r in rows],
        "",
        "| node | peak RSS added over its start (MiB) | RSS at the end / at start |",
        "|---|---:|---:|",
        *[f"| {name} | {v['added_peak_mib']} | {v['settled_vs_start']:.4f} |" for name, v in summary.items()],
        "",
        f"Goals (issue 32): 256 stalled Gets on one connection add at most 64 MiB: "
        f"{on['added_peak_mib']} MiB, {'met' if on['added_peak_mib'] <= 64 else 'MISSED'}; RSS within 5% of its "
        f"level before once the client is gone: {on['settled_vs_start']:.4f}x, "
        f"{'met' if abs(on['settled_vs_start'] - 1) <= 0.05 else 'MISSED'}.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
