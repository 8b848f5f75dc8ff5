"""``kvstore stats`` for people: a table with human units and hit ratios, JSON when piped, and ``--watch``."""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from kvstore.cli import main
from kvstore.client import KVStoreClient
from kvstore.tools.stats_view import human_bytes, percent
from tests.support.server import ThreadedServer, kv_blocks, make_config, namespace


@pytest.fixture(scope="module")
def node() -> Iterator[ThreadedServer]:
    """A node of 64 MiB, 2 of 8 looked-up blocks cached, the prefix fetched: a prefix hit ratio of 25 %."""
    server = ThreadedServer(make_config(**{"store.memory.capacity_bytes": 64 << 20}))
    try:
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 8)
        with KVStoreClient(server.target, retries=0) as client:
            client.put(ns, hashes[:2], tensors[:2])
            found = client.lookup(ns, hashes).num_blocks
            assert len(client.get(ns, hashes[:found])) == found == 2
        yield server
    finally:
        server.stop()


def test_human_units() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 64 << 20, 10 << 40, -1)] == \
        ["0 B", "1023 B", "1.5 KiB", "64 MiB", "10 TiB", "-"]
    assert [percent(v) for v in (None, 0.25, 0.0001, 0.0)] == ["-", "25.0%", "<0.1%", "0.0%"]


def test_the_table_shows_the_hit_ratio_and_the_fill_in_human_units(node: ThreadedServer,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", node.target, "--table"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"node {node.target}: prefix hit ratio 25.0% (2 of 8 blocks looked up were cached)"
    assert lines[1].split() == ["tier", "state", "blocks", "stored", "capacity", "fill", "hits", "misses", "hit",
                                "ratio", "evictions", "demotions", "promotions", "errors"]
    memory = lines[2].split()
    assert memory[:3] == ["memory", "up", "2"] and memory[5:7] == ["64", "MiB"]
    assert memory[8:11] == ["2", "6", "25.0%"]  # hits, misses (the lookup's 6 blocks past the prefix), hit ratio
    assert "hit ratio = hits / (hits + misses)" in out  # every derived column explained


def test_piped_it_prints_json_with_the_ratios(node: ThreadedServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", node.target]) == 0  # capsys: stdout is not a terminal
    report = json.loads(capsys.readouterr().out)
    (memory,) = report["tiers"]
    assert (memory["hits"], memory["misses"], memory["hit_ratio"], memory["state"]) == (2, 6, 0.25, "up")
    assert report["lookup_hit_ratio"] == 0.25 and 0 < memory["fill"] < 0.01
    assert main(["stats", "--target", node.target, "--target", node.target, "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["target"] for n in nodes] == [node.target] * 2 and nodes[0]["lookup_hit_ratio"] == 0.25


def test_watch_refreshes_with_the_rates_since_the_last_frame(node: ThreadedServer,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", node.target, "--table", "--watch", "0.1", "--count", "2"]) == 0
    frames = capsys.readouterr().out.split("\x1b[H\x1b[2J")[1:]  # each frame clears the screen first
    assert len(frames) == 2
    assert "rates: from the next refresh on" in frames[0]
    assert "blocks looked up/s" in frames[1] and "memory 0 served/s" in frames[1]
    assert main(["stats", "--target", node.target, "--watch", "0.1", "--count", "2"]) == 0  # piped: JSON lines
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["nodes"][0]["lookup_hit_ratio"] == 0.25


def test_count_without_watch_is_a_usage_error(node: ThreadedServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", node.target, "--count", "2"]) == 2
    assert "--count needs --watch" in capsys.readouterr().err
