"""What security costs: the token check alone, and Lookup latency with tokens and TLS, as ratios to a plain node.

Four in-process nodes (memory tier, ``grpc.aio`` on a private event-loop
thread, loopback) are measured from this process with a synchronous
``KVStoreClient``, one call at a time, in turn (plain, tokens, 1,000 tokens,
TLS + tokens, plain, ...), so each sees the same background load:

* plain: no TLS, no tokens;
* tokens: ``security.auth_tokens`` with 1 token, SHA-256 namespace;
* 1,000 tokens: the same with 1,000 configured tokens (the check compares
  the presented token's digest with every one of them);
* TLS + tokens: the same as "tokens" over TLS (a throw-away CA from ``openssl``).

Each call is a Lookup of 1 cached block hash (the smallest call, where a
fixed per-call cost shows most). Latency is the median of ``--calls`` calls.
The token check alone (``Authenticator.authenticate``) is timed for 1, 100
and 1,000 tokens.

Usage::

    python benchmarks/bench_security.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


class _Node:
    """A ``KVStoreServer`` on a private event-loop thread."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        from kvstore.config import load_config
        from kvstore.server.app import KVStoreServer

        config = load_config(env={}, overrides={"server.port": 0, "server.metrics_port": -1,
                                                "store.memory.capacity_bytes": 64 << 20, **overrides})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = KVStoreServer(config)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _time_check(num_tokens: int, num_calls: int) -> float:
    """Median microseconds of one ``Authenticator.authenticate`` with ``num_tokens`` configured."""
    from kvstore.config import SecurityConfig
    from kvstore.security import bearer_metadata
    from kvstore.server.auth import Authenticator

    tokens = [f"bench-token-{i:06d}-0123456789" for i in range(num_tokens)]
    auth = Authenticator.from_config(SecurityConfig(auth_tokens=";".join(f"{t}=t{i}" for i, t in enumerate(tokens))))
    assert auth is not None
    metadata = bearer_metadata(tokens[-1])
    samples = []
    for _ in range(num_calls):
        start = time.perf_counter()
        auth.authenticate(metadata)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="Lookup calls per node")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_security"),
                        help="results path without suffix (.json and .md are written)")
    args = parser.parse_args()

    import torch

    from kvstore.client import KVStoreClient
    from kvstore.blocks.tensors import encode_block
    from kvstore.keys import HashAlgorithm, Namespace, hash_blocks
    from kvstore.security import bearer_metadata, channel_credentials
    from tests.support.redis import make_tls_files

    checks = {n: _time_check(n, 2000) for n in (1, 100, 1000)}
    for n, us in checks.items():
        print(f"token check, {n:5d} tokens: {us:8.2f} us")

    token = "bench-client-token-0123456789abcdef"
    many = ";".join(f"other-token-{i:06d}-0123456789={i}" for i in range(999))
    tls = make_tls_files(tempfile.mkdtemp(prefix="kvstore-bench-tls-"))
    setups = {
        "plain": ({}, None, ()),
        "tokens": ({"security.auth_tokens": f"{token}=bench"}, None, bearer_metadata(token)),
        "1000 tokens": ({"security.auth_tokens": f"{many};{token}=bench"}, None, bearer_metadata(token)),
        "TLS + tokens": ({"security.auth_tokens": f"{token}=bench", "security.tls_cert_file": tls.server_cert,
                          "security.tls_key_file": tls.server_key}, channel_credentials(tls.ca_cert),
                         bearer_metadata(token)),
    }
    ns = Namespace("bench-model", cache_salt="bench", hash_algorithm=HashAlgorithm.SHA256)
    hashes = hash_blocks(ns, list(range(16)))
    block = encode_block(torch.zeros(2, 2, 2, 16, 64, dtype=torch.float16), "kv")
    nodes, clients = {}, {}
    try:
        for name, (overrides, credentials, metadata) in setups.items():
            nodes[name] = _Node(overrides)
            clients[name] = KVStoreClient(nodes[name].server.target, retries=0, credentials=credentials,
                                          metadata=metadata)
            clients[name].put(ns, hashes, [block])
            for _ in range(50):
                clients[name].lookup(ns, hashes)
        samples: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(args.calls):
            for name, client in clients.items():
                start = time.perf_counter()
                result = client.lookup(ns, hashes)
                samples[name].append(time.perf_counter() - start)
                assert result.num_blocks == 1
    finally:
        for client in clients.values():
            client.close()
        for node in nodes.values():
            node.close()

    base_us = statistics.median(samples["plain"]) * 1e6
    rows = []
    for name, values in samples.items():
        median_us = statistics.median(values) * 1e6
        rows.append({"setup": name, "lookup_median_us": round(median_us, 1),
                     "ratio_to_plain": round(median_us / base_us, 3)})
        print(f"Lookup(1 hash) {name:14s}: {median_us:8.1f} us  ({median_us / base_us:.2f}x plain)")

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO_ROOT), *sys.argv[1:]])
    meta = {"command": command, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "calls": args.calls}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "token_check_us": {str(k): round(v, 2) for k, v in checks.items()}, "lookup": rows}, indent=2))
    lines = [
        "# What security costs: token check and Lookup latency",
        "",
        f"Command: `{command}` ({meta['cpus']} CPUs, Python {meta['python']}). In-process nodes on loopback,",
        "one synchronous call at a time, setups interleaved; medians.",
        "",
        "| configured tokens | one token check (us) |",
        "|---:|---:|",
        *[f"| {n} | {us:.2f} |" for n, us in checks.items()],
        "",
        "| setup | Lookup(1 hash) median (us) | ratio to plain |",
        "|---|---:|---:|",
        *[f"| {r['setup']} | {r['lookup_median_us']:.1f} | {r['ratio_to_plain']:.2f}x |" for r in rows],
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
