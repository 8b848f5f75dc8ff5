"""KV events' cost: store Put and Get throughput with events on against off, and a stalled subscriber's effect.

One process, one asyncio loop, a heap memory tier (``kvstore serve``'s) sized to
hold half of what each round puts, so puts also evict. Three configurations run
interleaved, round after round, each on a fresh store:

* ``off``: no event log (the default);
* ``on``: an event log and a ZMQ publisher on 127.0.0.1 with one subscriber that reads everything;
* ``stalled``: the same with a subscriber that never reads (ZMQ drops its batches past its HWM).

The subscriber runs in a process of its own (``--reader``), as a router would:
it never competes with the store for this process's GIL. The publisher's
thread's CPU time per round is recorded (``/proc``), so the cost of events
shows where it goes: the store's loop (appends to the log) against the
publisher's thread (encoding and sending).

Each round puts ``--blocks`` blocks in batches of ``--batch`` (each put's blocks
get their events; the Put phase ends once the publisher has sent them all, so
it pays for its events), then gets them back in batches (reads have no events,
but the publisher's thread competes for the GIL). Figures: medians over rounds,
blocks per second; goals: on/off >= 0.95 for Put and Get, stalled/on >= 0.95.

Run: python benchmarks/bench_events.py [--rounds 9] [--blocks 20000] [--batch 32] [--profile]
Writes benchmarks/results/bench_events.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq

from kvstore.blocks.tensors import encode_block
from kvstore.config import StoreConfig
from kvstore.events.log import EventLog
from kvstore.events.publisher import EventPublisher, PublisherSettings
from kvstore.keys import Namespace, hash_blocks
from kvstore.store.tiered import TieredStore
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES, HeapTier

RESULTS = Path(__file__).parent / "results"
GOAL = 0.95
NS = Namespace(model="bench-events", dtype="float16", block_size=16)


class Reader:
    """A subscriber process (``--reader``) that reads (and counts) every batch, or never reads (``stalled``)."""

    def __init__(self, endpoint: str, *, stalled: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--reader", endpoint, *(["--stalled"] if stalled else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "connected"

    def ready(self) -> bool:
        """Whether the reader has received a batch (it prints ``ready`` then), without waiting."""
        import select

        assert self.proc.stdout is not None
        return bool(select.select([self.proc.stdout], [], [], 0)[0]) and self.proc.stdout.readline() == "ready\n"

    def close(self) -> int:
        """Stop the reader; the batches it read."""
        out, _ = self.proc.communicate("", timeout=60)
        return int(out.split()[-1]) if out.split() else 0


def reader_main(endpoint: str, stalled: bool) -> int:
    """The reader process: prints ``connected``, then ``ready`` on its first batch; at EOF on stdin its count."""
    import select

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 16)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    print("connected", flush=True)
    count = 0
    poller = zmq.Poller()
    poller.register(sys.stdin, zmq.POLLIN)
    if not stalled:
        poller.register(sock, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if sock in ready:
            while sock.poll(0):
                sock.recv_multipart()
                count += 1
                if count == 1:
                    print("ready", flush=True)
        if sys.stdin.fileno() in ready or sys.stdin in ready:
            if not select.select([sys.stdin], [], [], 0)[0] or not sys.stdin.read(1):
                break
    print(count, flush=True)
    sock.close()
    return 0


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used, from ``/proc`` (0 where there is none)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(mode: str, hashes: list[bytes], blocks: list[bytes], batch: int,
                    profiler: object = None) -> dict[str, float]:
    capacity = len(blocks) // 2 * (len(blocks[0]) + BLOCK_OVERHEAD_BYTES)
    log = EventLog() if mode != "off" else None
    publisher = reader = None
    if log is not None:
        publisher = EventPublisher(log, PublisherSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint="off",
                                                          hwm=1000))
        reader = Reader(publisher.endpoint, stalled=mode == "stalled")
        while publisher.next_seq == 0 or (mode == "on" and not reader.ready()):  # the subscription is in
            log.cleared(b"warm-up-")
            await asyncio.sleep(0.01)
            if mode == "stalled" and publisher.next_seq > 10:
                break
    publisher_thread = publisher._thread.native_id if publisher is not None else None  # noqa: SLF001
    cpu_before = thread_cpu_s(publisher_thread) if publisher_thread else 0.0
    store = TieredStore([HeapTier(capacity)], StoreConfig(), events=log)
    await store.start()
    try:
        if profiler is not None:
            profiler.enable()  # type: ignore[attr-defined]
        started = time.perf_counter()
        for i in range(0, len(blocks), batch):
            await store.put(NS, hashes[i:i + batch], blocks[i:i + batch])
        last_seq = -1
        if publisher is not None:  # the Put phase pays for its own events: until the publisher has sent them
            while len(log) or publisher.next_seq != last_seq:  # type: ignore[arg-type]
                last_seq = publisher.next_seq
                await asyncio.sleep(0.005)
        put_s = time.perf_counter() - started
        half = len(blocks) // 2  # the last half is resident (the first was evicted)
        started = time.perf_counter()
        got = 0
        for i in range(half, len(blocks), batch):
            got += len(await store.get(NS, hashes[i:i + batch]))
        get_s = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()  # type: ignore[attr-defined]
        events = publisher.counters() if publisher is not None else {}
        publisher_cpu_s = thread_cpu_s(publisher_thread) - cpu_before if publisher_thread else 0.0
    finally:
        await store.close()
        if publisher is not None:
            publisher.close()
        read = reader.close() if reader is not None else 0
    return {"put_blocks_per_s": len(blocks) / put_s, "get_blocks_per_s": got / get_s, "got": got,
            "batches": events.get("batches", 0), "dropped_events": events.get("dropped_events", 0),
            "subscriber_overruns": events.get("subscriber_overruns", 0), "batches_read": read,
            "publisher_cpu_s": publisher_cpu_s, "round_s": put_s + get_s}


def profile_round(hashes: list[bytes], blocks: list[bytes], batch: int) -> list[str]:
    """cProfile of the store's loop (this thread) in one ``on`` round's Puts and Gets: the top functions by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    asyncio.run(one_round("on", hashes, blocks, batch, profiler))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
    return [line for line in out.getvalue().splitlines() if line.strip()][-22:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="also profile the store's loop in one 'on' round")
    parser.add_argument("--reader", metavar="ZMQ", help=argparse.SUPPRESS)
    parser.add_argument("--stalled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        return reader_main(args.reader, args.stalled)
    load_before = os.getloadavg()
    generator = torch.Generator().manual_seed(0)
    block = encode_block(torch.randn(2, 2, 2, NS.block_size, 8, generator=generator).to(torch.float16))
    modes = ("off", "on", "stalled")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:  # rotate the order: no mode always runs first
            hashes = hash_blocks(NS, list(range((r * 3 + modes.index(mode)) * 10**7,
                                                (r * 3 + modes.index(mode)) * 10**7 + args.blocks * NS.block_size)))
            runs[mode].append(asyncio.run(one_round(mode, list(hashes), [block] * args.blocks, args.batch)))
    load_after = os.getloadavg()
    med = {m: {k: statistics.median(run[k] for run in runs[m]) for k in ("put_blocks_per_s", "get_blocks_per_s")}
           for m in modes}
    ratios = {
        "put_on_over_off": med["on"]["put_blocks_per_s"] / med["off"]["put_blocks_per_s"],
        "get_on_over_off": med["on"]["get_blocks_per_s"] / med["off"]["get_blocks_per_s"],
        "put_stalled_over_on": med["stalled"]["put_blocks_per_s"] / med["on"]["put_blocks_per_s"],
        "get_stalled_over_on": med["stalled"]["get_blocks_per_s"] / med["on"]["get_blocks_per_s"],
    }
    command = "python benchmarks/bench_events.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "rounds": args.rounds, "blocks": args.blocks, "batch": args.batch,
              "block_bytes": len(block), "load_before": load_before, "load_after": load_after,
              "medians": med, "ratios": ratios, "goal": GOAL,
              "dropped_events": {m: sum(run["dropped_events"] for run in runs[m]) for m in modes},
              "subscriber_overruns": {m: sum(run["subscriber_overruns"] for run in runs[m]) for m in modes},
              "publisher_cpu_share": {m: statistics.median(run["publisher_cpu_s"] / run["round_s"] for run in runs[m])
                                      for m in modes},
              "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_events.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# bench_events: KV events on against off (store Put and Get), and a stalled subscriber",
        "",
        f"Command: `{result['command']}` (under `flock /tmp/heavy.lock nice -n 10`)",
        f"Load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
        f"after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}",
        f"{args.rounds} rounds, interleaved; each puts {args.blocks} blocks of {len(block)} bytes in batches of "
        f"{args.batch} into a heap tier holding half of them, then gets the resident half. Medians, blocks/s.",
        "",
        "| mode | Put blocks/s | Get blocks/s |",
        "|---|---|---|",
        *[f"| {m} | {med[m]['put_blocks_per_s']:,.0f} | {med[m]['get_blocks_per_s']:,.0f} |" for m in modes],
        "",
        "| ratio | value | goal |",
        "|---|---|---|",
        *[f"| {name} | {value:.4f} | >= {GOAL} {'met' if value >= GOAL else 'MISSED'} |"
          for name, value in ratios.items()],
        "",
        f"Events the node's log dropped: {result['dropped_events']}; subscriber overruns (sends that found the "
        f"subscriber's queue full, ZMQ dropped batches for it): {result['subscriber_overruns']}.",
        "The subscriber is a separate process. The publisher thread's CPU time, as a share of the round's time "
        f"(median): {', '.join(f'{m} {v:.3f}' for m, v in result['publisher_cpu_share'].items())}.",
    ]
    if args.profile:
        hashes = hash_blocks(NS, list(range(10**9, 10**9 + args.blocks * NS.block_size)))
        result["profile"] = profile_round(list(hashes), [block] * args.blocks, args.batch)
        lines += ["", "Profile of the store's loop (this thread) in one `on` round, by own time:", "", "```",
                  *result["profile"], "```"]
        (RESULTS / "bench_events.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_events.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
