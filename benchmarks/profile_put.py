"""Where one same-host Put of 64 x 256 KiB goes, step by step, on the client and on the node (issue 33).

A ``kvstore serve`` node (memory tier of ``--capacity``) runs as a subprocess
of this script in its ``--serve-timed`` mode: ``kvstore serve`` with
``time.perf_counter_ns`` timers wrapped around the Put's steps (the control
frame's handling, ``PutShared``, the copy out of the segment and its checks,
the store's admission, placement, the heap tier's put, the index's
``prepare_put``/``complete_put``, eviction), reset by ``SIGUSR1`` after the
warm-up and written out as JSON when the node exits. This process is the
client; its own steps (the argument checks, the staging, the control round
trip) are timed the same way. ``--warm`` puts first fill the memory tier, so
the measured puts evict as in service; every put names new keys.

Usage::

    python benchmarks/profile_put.py [--puts 100] [--warm 100] [--capacity 1GiB] [--out benchmarks/results/put_profile.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

NUM_BLOCKS = 64
BATCH_SHAPE = (8, 2, 4, 16, 128)  # 256 KiB of float16, as bench_shm.py's Put batch


class Timers:
    """Total nanoseconds and calls per step, of functions wrapped with :meth:`wrap`."""

    def __init__(self) -> None:
        self.totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time every call of ``owner.name`` (a function, method, static method or coroutine function) as ``label``;
        nothing if there is none (an older build, profiled for the "before" figures)."""
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None:
            return
        static = isinstance(raw, staticmethod)
        func: Callable[..., Any] = raw.__func__ if static else raw
        totals = self.totals

        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter_ns()
                try:
                    return await func(*args, **kwargs)
                finally:
                    entry = totals[label]
                    entry[0] += time.perf_counter_ns() - start
                    entry[1] += 1
        else:
            @functools.wraps(func)
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter_ns()
                try:
                    return func(*args, **kwargs)
                finally:
                    entry = totals[label]
                    entry[0] += time.perf_counter_ns() - start
                    entry[1] += 1
        setattr(owner, name, staticmethod(timed) if static else timed)

    def per_put(self, puts: int) -> dict[str, dict[str, float]]:
        """Each step's milliseconds per put and calls per put."""
        return {label: {"ms": ns / 1e6 / puts, "calls": calls / puts} for label, (ns, calls) in sorted(self.totals.items())}


def _serve_timed(argv: list[str]) -> int:
    """``kvstore serve`` with the Put's node-side steps timed (see the module docstring)."""
    from kvstore.shm.node.operations import SameHostOperations
    from kvstore.shm.node.plane import SharedMemoryNode
    from kvstore.shm.node.pool import SharedPool
    from kvstore.store.tiered import TieredStore
    import kvstore.store.index as index
    import kvstore.store.mover as mover
    import kvstore.store.placement as placement
    import kvstore.tiers.heap as heap
    import kvstore.validation as validation

    timers = Timers()
    timers.wrap(SameHostOperations, "dispatch", "node: control frame handled (all below)")
    timers.wrap(SameHostOperations, "put_shared", "node: PutShared")
    timers.wrap(SharedMemoryNode, "copy_in", "node: copy_in (copy + check of each block)")
    timers.wrap(getattr(validation, "BlockChecker", validation), "check", "node: check (one block, in copy_in)")
    timers.wrap(placement, "check_block", "node: check_block (one block, in admit; before this change)")
    timers.wrap(TieredStore, "put", "node: store.put")
    timers.wrap(placement.Placement, "admit", "node: placement.admit")
    timers.wrap(placement.Placement, "put", "node: placement.put")
    timers.wrap(heap.HeapTier, "put", "node: heap tier put")
    timers.wrap(SharedPool, "put", "node: shared pool put")
    timers.wrap(SharedPool, "stage", "node: shared pool stage")
    timers.wrap(index.Index, "prepare_put", "node: index.prepare_put")
    timers.wrap(index.Index, "complete_put", "node: index.complete_put")
    for name in ("place", "make_room", "_write", "settle"):
        timers.wrap(mover.Mover, name, f"node: mover.{name}")
    out = os.environ["PROFILE_PUT_OUT"]

    def dump() -> None:
        puts = int(os.environ.get("PROFILE_PUT_PUTS", "1"))
        with open(out, "w") as f:
            json.dump({"steps": timers.per_put(puts),
                       "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}, f)

    import atexit

    atexit.register(dump)
    signal.signal(signal.SIGUSR1, lambda *_: timers.totals.clear())
    from kvstore.cli import main as cli_main

    sys.argv = ["kvstore", *argv]
    return cli_main()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-timed":
        return _serve_timed(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, default=100, help="puts timed")
    parser.add_argument("--warm", type=int, default=100, help="puts before (they fill the memory tier)")
    parser.add_argument("--capacity", default="1GiB", help="the node's --memory-capacity")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "put_profile.json"))
    args = parser.parse_args()

    import torch

    from kvstore.client import KVStoreClient
    from kvstore.client import core as client_core
    from kvstore.keys import Namespace
    from kvstore.server.process import tune_malloc
    from kvstore.shm.client.control import ControlChannels
    from kvstore.shm.client.link import SharedSession
    from tests.support.kvnode import KVNode

    tune_malloc()
    torch.set_num_threads(1)
    node_out = Path(tempfile.mkdtemp(prefix="profile-put-")) / "node.json"
    os.environ["PROFILE_PUT_OUT"] = str(node_out)
    os.environ["PROFILE_PUT_PUTS"] = str(args.puts)

    class TimedNode(KVNode):
        def command_line(self) -> list[str]:
            line = super().command_line()
            at = line.index("-m")  # [python, -m, kvstore.cli, serve, ...] -> [python, this, --serve-timed, serve, ...]
            return [*line[:at], str(Path(__file__).resolve()), "--serve-timed", *line[at + 2:]]

    client_timers = Timers()
    client_timers.wrap(client_core.ClientCore, "put", "client: put (all below, and the node)")
    client_timers.wrap(client_core, "blocks_for_put", "client: blocks_for_put (type, dtype, shape checks)")
    client_timers.wrap(client_core, "check_put", "client: check_put (hashes, priority)")
    client_timers.wrap(SharedSession, "stage", "client: stage (copy + header + checksum)")
    client_timers.wrap(SharedSession, "unstage", "client: unstage")
    client_timers.wrap(ControlChannels, "call", "client: control round trip (node included)")

    load_start = os.getloadavg()
    node = TimedNode(memory_capacity=args.capacity, metrics=False, extra_args=["--log-level", "WARNING"])
    node.start()
    try:
        client = KVStoreClient(node.target, timeout_s=120)
        namespace = Namespace(model="profile-put", dtype="float16", block_size=BATCH_SHAPE[3])
        generator = torch.Generator().manual_seed(0)
        batch = [torch.randn(BATCH_SHAPE, generator=generator).to(torch.float16) for _ in range(NUM_BLOCKS)]
        counter = iter(range(1 << 40))

        def put() -> None:
            hashes = [next(counter).to_bytes(8, "little") * 2 for _ in range(NUM_BLOCKS)]
            assert client.put(namespace, hashes, batch) == NUM_BLOCKS

        for _ in range(args.warm):
            put()
        assert client.shared_memory() == ("attached",), client.shared_memory()
        os.kill(node.pid, signal.SIGUSR1)  # type: ignore[arg-type]
        time.sleep(0.5)
        client_timers.totals.clear()
        walls = []
        for _ in range(args.puts):
            start = time.perf_counter_ns()
            put()
            walls.append((time.perf_counter_ns() - start) / 1e6)
        client.close()
    finally:
        node.stop()
        node.close()
    node_steps = json.loads(node_out.read_text())
    walls.sort()
    result = {"command": " ".join(["python", "benchmarks/profile_put.py", *sys.argv[1:]]),
              "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
              "put_ms_median": walls[len(walls) // 2], "put_ms_min": walls[0],
              "client_steps": client_timers.per_put(args.puts), "node_steps": node_steps["steps"],
              "node_minor_faults_total": node_steps["minor_faults"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"put: median {result['put_ms_median']:.3f} ms, min {result['put_ms_min']:.3f} ms (wall, {args.puts} puts)")
    for side in ("client_steps", "node_steps"):
        for label, step in result[side].items():
            print(f"  {label:60s} {step['ms']:7.3f} ms/put  ({step['calls']:.0f} calls/put)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
