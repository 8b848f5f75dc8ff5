"""KV events' cost: store Put and Get throughput with events on against off, and a stalled subscriber's effect.

One process, one asyncio loop, a heap memory tier (``kvstore serve``'s) sized to
hold half of what each round puts, so puts also evict. Three configurations run
interleaved, round after round, each on a fresh store:

* ``off``: no event log (the default);
* ``on``: an event log and a ZMQ publisher on 127.0.0.1 with one subscriber that reads everything;
* ``stalled``: the same with a subscriber that never reads (ZMQ drops its batches past its HWM).

Each round puts ``--blocks`` blocks in batches of ``--batch`` (each put's blocks
get their events), then gets them back in batches (reads have no events, but
the publisher's thread competes for the GIL). Figures: medians over rounds,
blocks per second; goals: on/off >= 0.95 for Put and Get, stalled/on >= 0.95.

Run: python benchmarks/bench_events.py [--rounds 9] [--blocks 20000] [--batch 32]
Writes benchmarks/results/bench_events.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

from kvstore.codec import encode_block
from kvstore.config import StoreConfig
from kvstore.events.log import EventLog
from kvstore.events.publisher import EventPublisher, PublisherSettings
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tiers.heap import BLOCK_OVERHEAD_BYTES, HeapTier

RESULTS = Path(__file__).parent / "results"
GOAL = 0.95
NS = Namespace(model="bench-events", dtype="float16", block_size=16)


class Reader:
    """A subscriber thread that reads (and counts) every batch, or a socket that never reads (``stalled``)."""

    def __init__(self, endpoint: str, *, stalled: bool) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 16)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.num_batches = 0
        self._stop = threading.Event()
        self._thread = None if stalled else threading.Thread(target=self._read, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                self.sock.recv_multipart()
                self.num_batches += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sock.close()


async def one_round(mode: str, hashes: list[bytes], blocks: list[bytes], batch: int) -> dict[str, float]:
    capacity = len(blocks) // 2 * (len(blocks[0]) + BLOCK_OVERHEAD_BYTES)
    log = EventLog() if mode != "off" else None
    publisher = reader = None
    if log is not None:
        publisher = EventPublisher(log, PublisherSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint="off",
                                                          hwm=1000))
        reader = Reader(publisher.endpoint, stalled=mode == "stalled")
        while publisher.next_seq == 0 or (reader.num_batches == 0 and mode == "on"):  # the subscription is in
            log.cleared(b"warm-up-")
            await asyncio.sleep(0.01)
            if mode == "stalled" and publisher.next_seq > 10:
                break
    store = TieredStore([HeapTier(capacity)], StoreConfig(), events=log)
    await store.start()
    try:
        started = time.perf_counter()
        for i in range(0, len(blocks), batch):
            await store.put(NS, hashes[i:i + batch], blocks[i:i + batch])
        put_s = time.perf_counter() - started
        half = len(blocks) // 2  # the last half is resident (the first was evicted)
        started = time.perf_counter()
        got = 0
        for i in range(half, len(blocks), batch):
            got += len(await store.get(NS, hashes[i:i + batch]))
        get_s = time.perf_counter() - started
        events = publisher.counters() if publisher is not None else {}
    finally:
        await store.close()
        if publisher is not None:
            publisher.close()
        if reader is not None:
            reader.close()
    return {"put_blocks_per_s": len(blocks) / put_s, "get_blocks_per_s": got / get_s, "got": got,
            "batches": events.get("batches", 0), "dropped_events": events.get("dropped_events", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
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
        f"Events the node's log dropped: {result['dropped_events']} (a stalled subscriber's batches are dropped by "
        "ZMQ at its HWM, not by the node).",
    ]
    (RESULTS / "bench_events.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
