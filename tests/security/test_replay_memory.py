"""Replay peers that never read cannot grow the node: replay memory is bounded per peer and in total, shared
rather than copied, and freed when a peer goes (issue 39, item 6).

A real ``kvstore serve`` process whose replay buffer holds 60 batches of about 34 KB (under pyzmq's 64 KiB copy
threshold, where every send of a ``bytes`` frame copied it), and real ZMQ peers (``tests/support/replay_hog.py``)
that ask for all of it again and again with the smallest receive buffers, reading nothing. The node's RSS is read
from ``/proc``; the waits are on the node's own counts (``/metrics``), bounded.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from kvstore.client import KVStoreClient
from kvstore.events.subscriber import EventSubscriber
from tests.support.hostile import rss_bytes
from tests.support.kvnode import KVNode, free_port
from tests.support.replay_hog import ReplayHog
from tests.support.security import sha_namespace
from tests.support.server import encoded, kv_blocks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MiB = 1 << 20
NUM_BLOCKS = 1000  # per Put: one batch of 1,000 SHA-256 hashes, about 34 KB of msgpack
NUM_CYCLES = 30  # a Put and a Delete each: 60 batches buffered
REPLAY_HWM = 64  # events.replay_hwm's default: batches queued on the node for one replay peer
RSS_BOUND = 64 * MiB  # issue 39's goal: within 64 MiB of the baseline, under the attack and after it


def metrics(node: KVNode) -> dict[str, float]:
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(kvstore_events\S*) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def count(node: KVNode, event: str) -> float:
    return metrics(node).get(f'kvstore_events_total{{event="{event}"}}', 0.0)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[KVNode, str, str]]:
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = {"KVSTORE_EVENTS__ENDPOINT": endpoint, "KVSTORE_EVENTS__REPLAY_ENDPOINT": replay,
           "KVSTORE_EVENTS__BUFFER_STEPS": "2000"}
    with KVNode(memory_capacity="64MiB", env=env, workdir=tmp_path) as kvnode:
        yield kvnode, endpoint, replay


def fill_the_buffer(kvnode: KVNode) -> None:
    """60 batches of about 34 KB: each Put and Delete of 1,000 small blocks is a batch of its own."""
    ns = sha_namespace("hog-victim")
    hashes, tensors = kv_blocks(ns, NUM_BLOCKS, num_layers=1, num_kv_heads=1, head_dim=8)
    blocks = encoded(ns, tensors)
    with KVStoreClient(kvnode.target, retries=0, shared_memory=False, bulk=False) as kv:
        for _ in range(NUM_CYCLES):
            for step in (lambda: kv.put(ns, hashes, blocks), lambda: kv.delete(ns, hashes)):
                before = count(kvnode, "batches")
                assert step() == NUM_BLOCKS
                wait_until(lambda: count(kvnode, "batches") > before and
                           metrics(kvnode).get("kvstore_events_queued", 1) == 0, 30, "the batch published")


def honest_replay(endpoint: str, replay: str) -> int:
    """Batches an honest subscriber gets by replay from 0 (it reads everything)."""
    with EventSubscriber(endpoint, replay, from_seq=None) as sub:
        return len(sub.replay(0, 10.0))


def test_replay_peers_that_never_read_leave_the_nodes_memory_flat(node: tuple[KVNode, str, str]) -> None:
    kvnode, endpoint, replay = node
    fill_the_buffer(kvnode)
    num_batches = honest_replay(endpoint, replay)  # warm: one full replay read to the end
    assert num_batches >= 2 * NUM_CYCLES
    hog = ReplayHog(replay, peers=4, requests_per_peer=40)
    taken = count(kvnode, "replays") + hog.num_requests  # every request, each a replay (restarted) or refused
    sent = count(kvnode, "replayed_batches") + hog.peers * min(num_batches, REPLAY_HWM)  # each peer's queue is full

    def stuck() -> bool:  # every request taken, and the node sent each peer what its queue holds
        samples = metrics(kvnode)  # (a node that counts no replayed batches sent them all as it took the request)
        return (samples.get('kvstore_events_total{event="replays"}', 0) +
                samples.get('kvstore_events_total{event="replays_refused"}', 0) >= taken and
                samples.get('kvstore_events_total{event="replayed_batches"}', float("inf")) >= sent)

    figures = hog.attack(kvnode.pid, until=stuck,
                         after=lambda: metrics(kvnode).get("kvstore_events_replays_pending", 0) == 0)
    assert figures.rss_peak - figures.rss_before < RSS_BOUND, figures.row()
    assert figures.rss_after - figures.rss_before < RSS_BOUND, figures.row()
    assert honest_replay(endpoint, replay) == num_batches  # an honest subscriber is served as before
    assert rss_bytes(kvnode.pid) - figures.rss_before < RSS_BOUND
