"""Replay peers that never read, against a real node: its resident memory (RSS) before, at the peak of, and after
each attack (issue 39, item 6).

A ``kvstore serve`` node with events on (no other change to its defaults) gets its replay buffer filled with
``--batches`` batches of about 34 KB each (a Put or a Delete of 1,000 small blocks each: under pyzmq's 64 KiB
copy threshold, where a ``bytes`` frame used to be copied on every send). Then, as in the issue's report:

* **burst**: ``--peers`` peers each ask for the whole buffer ``--requests`` times at once and read nothing for
  ``--hold`` seconds, then disconnect; RSS is read again ``--after`` seconds later;
* **steady**: four peers each ask once a second for ``--steady`` seconds, reading nothing, then disconnect.

Goal (issue 39): the node's RSS under each attack stays within 64 MiB of its level before, and is back to it
after the attacker leaves. Issue 39 measured 288 -> 815 MiB for the burst (2 peers x 200 requests), still held
5 s after the peers left, and about +300 MiB in 25 s for the steady attack. Run it against another checkout
(``PYTHONPATH=<checkout>``, its ``tests/support`` with ``replay_hog.py``) to measure that one: the node is
``python -m kvstore.cli serve`` from the ``kvstore`` that is imported.

Usage::

    python benchmarks/bench_replay_hog.py [--batches 200] [--peers 2] [--requests 200] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
NUM_BLOCKS = 1000


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvstore_events\S*) (\S+)$", text, re.M)}


def fill(node, url: str, num_batches: int) -> None:  # type: ignore[no-untyped-def]
    """``num_batches`` batches of 1,000 SHA-256 hashes: Puts and Deletes of 1,000 small blocks, one batch each."""
    from kvstore.client import KVStoreClient
    from kvstore.keys import HashAlgorithm, Namespace
    from tests.support.server import encoded, kv_blocks

    ns = Namespace(model="bench-replay-hog", hash_algorithm=HashAlgorithm.SHA256)
    hashes, tensors = kv_blocks(ns, NUM_BLOCKS, num_layers=1, num_kv_heads=1, head_dim=8)
    blocks = encoded(ns, tensors)
    with KVStoreClient(node.target, retries=0, shared_memory=False) as kv:
        for i in range(num_batches):
            before = metrics(url).get('kvstore_events_total{event="batches"}', 0)
            if i % 2 == 0:
                kv.put(ns, hashes, blocks)
            else:
                kv.delete(ns, hashes)
            while not (metrics(url).get('kvstore_events_total{event="batches"}', 0) > before
                       and metrics(url).get("kvstore_events_queued", 1) == 0):
                time.sleep(0.01)


def steady(replay: str, pid: int, seconds: float, after_s: float) -> dict[str, object]:
    """Four peers asking once a second for ``seconds``, never reading, then gone; RSS before, peak, after."""
    import zmq

    from tests.support.hostile import rss_bytes

    ctx = zmq.Context()
    peers = []
    for _ in range(4):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(replay)
        peers.append(sock)
    before = peak = rss_bytes(pid)
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < seconds:
        for sock in peers:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            sent += 1
        tick = time.monotonic()
        while time.monotonic() - tick < 1.0:
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.05)
    for sock in peers:
        sock.close(linger=0)
    ctx.term()
    threading.Event().wait(after_s)
    after = rss_bytes(pid)
    return {"attack": f"steady: 4 peers asking once a second for {seconds:g} s, never read", "calls": sent,
            "rss_before_mib": round(before / MiB, 1), "rss_peak_mib": round(max(peak, after) / MiB, 1),
            "rss_after_mib": round(after / MiB, 1), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200, help="batches in the replay buffer")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200, help="requests per peer (burst)")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the burst's peers stay, reading nothing")
    parser.add_argument("--after", type=float, default=5.0, help="seconds after the peers left to read RSS again")
    parser.add_argument("--steady", type=float, default=25.0, help="seconds of the steady attack (0: none)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_replay_hog"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()

    from tests.support.hostile import rss_bytes
    from tests.support.kvnode import KVNode, free_port
    from tests.support.replay_hog import ReplayHog

    load_before = os.getloadavg()
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    rows: list[dict[str, object]] = []
    with KVNode(env={"KVSTORE_EVENTS__ENDPOINT": endpoint, "KVSTORE_EVENTS__REPLAY_ENDPOINT": replay}) as node:
        url = node.metrics_url
        started_rss = rss_bytes(node.pid)  # type: ignore[arg-type]
        fill(node, url, args.batches)
        buffered = metrics(url).get("kvstore_events_buffered_bytes")
        hog = ReplayHog(replay, peers=args.peers, requests_per_peer=args.requests)
        figures = hog.attack_for(node.pid, args.hold)  # type: ignore[arg-type]
        threading.Event().wait(args.after)  # the issue read RSS again 5 s after the peers left
        row = figures.row()
        row["rss_after_mib"] = round(rss_bytes(node.pid) / MiB, 1)  # type: ignore[arg-type]
        row["attack"] = f"burst: {args.peers} peers x {args.requests} requests, held {args.hold:g} s, never read"
        rows.append(row)
        if args.steady > 0:
            rows.append(steady(replay, node.pid, args.steady, args.after))  # type: ignore[arg-type]
        counts = metrics(url)
    load_after = os.getloadavg()
    for row in rows:
        row["growth_mib"] = round(float(row["rss_peak_mib"]) - float(row["rss_before_mib"]), 1)  # type: ignore
        row["left_mib"] = round(float(row["rss_after_mib"]) - float(row["rss_before_mib"]), 1)  # type: ignore
        row["goal_met"] = row["growth_mib"] < 64 and row["left_mib"] < 64  # type: ignore[operator]
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    result = {"label": args.label, "command": command, "cpus": os.cpu_count(), "python": platform.python_version(),
              "load_before": load_before, "load_after": load_after, "batches": args.batches,
              "rss_at_start_mib": round(started_rss / MiB, 1),
              "buffered_bytes": buffered, "rows": rows, "node_counts": counts}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
