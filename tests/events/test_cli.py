"""``kvstore events``: a real subprocess subscribed to a real node's stream prints its events and a per-tier summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstore.client import KVStoreClient
from tests.support.server import ThreadedServer, encoded, kv_blocks, make_config, namespace
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def run_cli(*args: str) -> list[dict]:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "events", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_events_prints_each_event_and_a_summary_per_tier() -> None:
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0"}))
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 3)
        with KVStoreClient(server.target, retries=0) as kv:
            kv.put(ns, hashes, encoded(ns, tensors))
            kv.delete(ns, hashes[2:])
        wait_until(lambda: publisher.counters()["events"] >= 3, 20, "the events published")
        num_batches = publisher.next_seq
        follow = ("--target", publisher.endpoint, "--replay", publisher.replay_endpoint, "--from-seq", "0",
                  "--max-batches", str(num_batches))
        lines = run_cli(*follow)
        assert lines[0]["type"] == "AllBlocksCleared" and lines[0]["reason"] == "start" and lines[0]["seq"] == 0
        stored = [h for line in lines if line["type"] == "BlockStored" for h in line["block_hashes"]]
        removed = [line for line in lines if line["type"] == "BlockRemoved"]
        assert sorted(stored) == sorted(h.hex() for h in hashes)
        assert removed[0]["block_hashes"] == [hashes[2].hex()] and removed[0]["reason"] == "deleted"
        assert {line["namespace"] for line in lines if line["type"] != "AllBlocksCleared"} == {ns.tag.hex()}
        summary = run_cli(*follow, "--summary")
        assert summary == [{"tiers": {"memory": 2}, "events": {"cleared_start": 1, "stored": 3, "deleted": 1},
                            "batches": num_batches, "missed_batches": 0}]
    finally:
        server.stop()


def test_events_fails_when_the_replay_endpoint_does_not_answer() -> None:
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0"}))
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "events", "--target", publisher.endpoint,
                               "--replay", publisher.endpoint, "--from-seq", "0", "--duration", "10"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 1 and "kvstore events:" in done.stderr  # a PUB socket never answers a replay request
    finally:
        server.stop()


def test_events_subscribes_to_a_node_with_tokens_with_its_token_and_gets_its_tenants_events(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.support.security import AUTH_TOKENS, TOKEN_A, TOKEN_B, client_of, sha_namespace

    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0", "security.auth_tokens": AUTH_TOKENS}))
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        ns_a, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-b")
        hashes_a, tensors_a = kv_blocks(ns_a, 2)
        hashes_b, tensors_b = kv_blocks(ns_b, 2, first_token=100)
        with client_of(server, TOKEN_A) as a, client_of(server, TOKEN_B) as b:
            a.put(ns_a, hashes_a, tensors_a)
            b.put(ns_b, hashes_b, tensors_b)
        wait_until(lambda: publisher.counters()["queued"] == 0 and publisher.counters()["events"] >= 3, 20,
                   "the events published")
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN_A + "\n")
        stream = publisher.streams[publisher.access.stream_of_token(TOKEN_A)]  # type: ignore[union-attr]
        lines = run_cli("--target", publisher.endpoint, "--replay", publisher.replay_endpoint, "--from-seq", "0",
                        "--max-batches", str(stream.next_seq), "--token-file", str(token_file))
        assert sorted(h for line in lines if line["type"] == "BlockStored" for h in line["block_hashes"]) == \
            sorted(h.hex() for h in hashes_a)  # its own, and none of tenant B's
        assert {line["namespace"] for line in lines if line["type"] == "BlockStored"} == {ns_a.tag.hex()}
    finally:
        server.stop()
