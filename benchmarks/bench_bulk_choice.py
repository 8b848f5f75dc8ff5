"""What carries kvstore's bulk path here: Mooncake's Transfer Engine (TCP) against a plain socket (issue 40's choice).

Two processes over loopback move the same bytes, interleaved in a fresh random
order each round: a 24 MiB prefix as 96 reads of 256 KiB, and one 2 MiB block.

* Transfer Engine: ``mooncake.engine.TransferEngine`` (the pip wheel
  ``mooncake-transfer-engine-non-cuda``), ``initialize(..., "P2PHANDSHAKE",
  "tcp", "")`` on both sides, each registering its buffer; the reader calls
  ``batch_transfer_sync_read`` (one request of 96) or ``transfer_sync_read``.
  This is the engine API whose protocol setting is ``rdma`` on a cluster.
* Socket: the server ``sendmsg`` s its 96 views at once, the reader
  ``recv_into`` s its buffer (what ``kvstore.bulk`` does).

Figures are medians as multiples of one ``np.copyto`` of the same bytes in the
reader's process, timed in the same rounds. Needs the Mooncake venv
(``make bench-peers`` builds ``.venv-peers-mooncake``); without it, says so and exits 0.

Usage::

    python benchmarks/bench_bulk_choice.py [--mooncake-venv DIR] [--rounds 40] [--out benchmarks/results/bench_bulk_choice]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_BLOCKS, BLOCK_BYTES, ONE_BYTES = 96, 256 << 10, 2 << 20
PREFIX_BYTES = NUM_BLOCKS * BLOCK_BYTES


def serve_engine(info_path: str) -> None:
    """The Transfer Engine's far end: a registered buffer of the bytes; it answers reads itself."""
    import numpy as np
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("TransferEngine.initialize failed")
    buffer = np.random.default_rng(0).integers(0, 255, PREFIX_BYTES, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise SystemExit("register_memory failed")
    Path(info_path).write_text(json.dumps({"rpc_port": engine.get_rpc_port(), "address": buffer.ctypes.data}))
    time.sleep(1e6)


def serve_socket(info_path: str) -> None:
    """The socket's far end: ``G`` sends the prefix (one ``sendmsg`` of 96 views), ``B`` the 2 MiB block."""
    import numpy as np

    buffer = np.random.default_rng(0).integers(0, 255, PREFIX_BYTES, dtype=np.uint8)
    views = [memoryview(buffer)[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] for i in range(NUM_BLOCKS)]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    Path(info_path).write_text(json.dumps({"port": listener.getsockname()[1]}))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (op := conn.recv(1)):
        pending = list(views) if op == b"G" else [memoryview(buffer)[:ONE_BYTES]]
        while pending:
            sent = conn.sendmsg(pending)
            while sent:
                if sent >= pending[0].nbytes:
                    sent -= pending[0].nbytes
                    pending.pop(0)
                else:
                    pending[0], sent = pending[0][sent:], 0


def read(rounds: int, engine_info: dict, socket_info: dict) -> dict[str, list[float]]:
    """The reader: each round, every way in a fresh random order; ms per call."""
    import numpy as np
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("TransferEngine.initialize failed")
    target = np.zeros(PREFIX_BYTES, dtype=np.uint8)
    source = np.random.default_rng(1).integers(0, 255, PREFIX_BYTES, dtype=np.uint8)
    engine.register_memory(target.ctypes.data, target.nbytes)
    peer = f"127.0.0.1:{engine_info['rpc_port']}"
    mine = [target.ctypes.data + i * BLOCK_BYTES for i in range(NUM_BLOCKS)]
    theirs = [engine_info["address"] + i * BLOCK_BYTES for i in range(NUM_BLOCKS)]
    sock = socket.create_connection(("127.0.0.1", socket_info["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(target)

    def receive(op: bytes, nbytes: int) -> None:
        sock.sendall(op)
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:nbytes])
            assert n, "the socket server went away"
            got += n

    def engine_prefix() -> None:
        assert engine.batch_transfer_sync_read(peer, mine, theirs, [BLOCK_BYTES] * NUM_BLOCKS) == 0

    def engine_block() -> None:
        assert engine.transfer_sync_read(peer, target.ctypes.data, engine_info["address"], ONE_BYTES) == 0

    ways = {"engine-prefix": engine_prefix, "engine-block": engine_block,
            "socket-prefix": lambda: receive(b"G", PREFIX_BYTES), "socket-block": lambda: receive(b"B", ONE_BYTES),
            "copy-prefix": lambda: np.copyto(target, source), "copy-block": lambda: np.copyto(target[:ONE_BYTES],
                                                                                            source[:ONE_BYTES])}
    samples: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for number in range(rounds + 3):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            ways[name]()
            if number >= 3:  # three rounds of warm-up
                samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def main() -> int:
    """Start both far ends, run the reader, write ``<out>.json`` and ``<out>.md``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mooncake-venv", default=str(REPO_ROOT / ".venv-peers-mooncake"))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "bench_bulk_choice"))
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--info", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "engine":
        serve_engine(args.info[0])
        return 0
    if args.role == "socket":
        serve_socket(args.info[0])
        return 0
    if args.role == "reader":
        print(json.dumps(read(args.rounds, json.loads(args.info[0]), json.loads(args.info[1]))))
        return 0
    python = Path(args.mooncake_venv) / "bin" / "python"
    if not python.exists():
        print(f"bench_bulk_choice: skipped: no {python} (make bench-peers builds it)", file=sys.stderr)
        return 0
    load_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-bulk-choice-"))
    engine_info, socket_info = workdir / "engine.json", workdir / "socket.json"
    quiet = {**os.environ, "GLOG_minloglevel": "2"}
    servers = [subprocess.Popen([str(python), __file__, "--role", "engine", "--info", str(engine_info)], env=quiet,
                                stderr=subprocess.DEVNULL),
               subprocess.Popen([str(python), __file__, "--role", "socket", "--info", str(socket_info)])]
    try:
        deadline = time.monotonic() + 60
        while not (engine_info.exists() and socket_info.exists()):
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                raise SystemExit("a far end did not start")
            time.sleep(0.1)
        time.sleep(0.5)  # the files are written whole only after the listeners are up
        reader = subprocess.run([str(python), __file__, "--role", "reader", "--rounds", str(args.rounds), "--info",
                                 engine_info.read_text(), socket_info.read_text()], env=quiet, capture_output=True,
                                text=True, check=True)
    finally:
        for server in servers:
            server.kill()
            server.wait()
    samples = json.loads(reader.stdout.strip().splitlines()[-1])
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    for kind, label in (("prefix", "24 MiB as 96 × 256 KiB"), ("block", "one 2 MiB block")):
        base = medians[f"copy-{kind}"]
        rows.append(f"| {label} | {medians[f'engine-{kind}']:.2f} ({medians[f'engine-{kind}'] / base:.1f}×) | "
                    f"{medians[f'socket-{kind}']:.2f} ({medians[f'socket-{kind}'] / base:.1f}×) | "
                    f"{medians[f'engine-{kind}'] / medians[f'socket-{kind}']:.2f} |")
    load = ", ".join(f"{x:.2f}" for x in load_start)
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n".join([
        "# bench_bulk_choice: Mooncake's Transfer Engine (TCP) against a plain socket, between two processes", "",
        f"Command: `python benchmarks/bench_bulk_choice.py --rounds {args.rounds}`; {time.strftime('%Y-%m-%d %H:%M:%S')}; "
        f"{os.cpu_count()} CPUs shared with other work, load average {load} at the start, {load_end} at the end. "
        "mooncake-transfer-engine-non-cuda 0.3.13.post1; loopback.", "",
        "Median ms per read (× one `np.copyto` of the same bytes in the reader, the same rounds); lower is better.", "",
        "| read | Transfer Engine, `tcp` | socket: `sendmsg` / `recv_into` | engine / socket |",
        "|---|---:|---:|---:|", *rows, "",
        "Engine / socket above 1 means the socket was faster. The socket carries kvstore's bulk path "
        "(`kvstore.bulk`, docs/scaleout.md says why); the engine is what gives RDMA on a cluster, through the same "
        "API with `protocol=\"rdma\"`. On a loaded 2-core host both swing with the load (the engine runs threads "
        "of its own): compare runs by their load average.", ""])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"samples_ms": samples, "medians_ms": medians,
                                                    "load_avg_start": load_start}, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
