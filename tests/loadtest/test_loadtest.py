"""``kvstore loadtest`` against real ``kvstore serve`` nodes: hit ratios, byte checks, pacing, JSON, errors."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Iterator

import pytest

from kvstore.tools.loadtest import LoadTestConfig, client_target_keyword, compare_with_simulator, replay_loadtest
from kvstore.tools.loadtest.cli import main
from kvstore.tools.sim import simulate
from kvstore.shm.node.pool import footprint
from kvstore.tools.trace import TraceRequest, read_trace, write_trace
from tests.support.kvnode import KVNode, free_port

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = REPO / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl"
PAYLOAD_BYTES = 1024  # 1 KiB payload: 1,152 encoded bytes
FOOTPRINT_BYTES = footprint(1152)  # what one block takes in the node's memory tier (its shared pool)


def _node(capacity_blocks: int) -> KVNode:
    return KVNode(memory_capacity=str(capacity_blocks * FOOTPRINT_BYTES), metrics=False)


@pytest.fixture(scope="module")
def big_node() -> Iterator[KVNode]:
    """A node that never evicts in these tests (2,000 blocks); tests use their own namespaces (model)."""
    with _node(2000) as node:
        yield node


def _config(node: KVNode, **kwargs: object) -> LoadTestConfig:
    return LoadTestConfig(targets=(node.target,), payload_bytes=PAYLOAD_BYTES, window_s=0.5,
                          **kwargs)  # type: ignore[arg-type]


def _mooncake_line(timestamp_ms: int, ids: list[int], missing_tokens: int = 100) -> str:
    return json.dumps({"timestamp": timestamp_ms, "input_length": len(ids) * 512 - missing_tokens,
                       "output_length": 1, "hash_ids": ids})


def test_small_trace_matches_hand_count_and_simulator(tmp_path: Path) -> None:
    # capacity 4 blocks, LRU with the head of a chain most recent:
    #   [1,2,3]   miss all            resident 1,2,3
    #   [1,2,3]   hit 3
    #   [1,2,4,5] hit 2; 3 evicted    resident 1,2,4,5
    #   [1,2,3]   hit 2; 5 evicted    resident 1,2,3,4
    #   [1,2,4,5] hit 3 (1,2,4)
    chains = [[1, 2, 3], [1, 2, 3], [1, 2, 4, 5], [1, 2, 3], [1, 2, 4, 5]]
    trace = tmp_path / "small.jsonl"
    trace.write_text("".join(_mooncake_line(i * 10, ids) + "\n" for i, ids in enumerate(chains)))
    requests = read_trace(trace)
    with _node(4) as node:
        result = replay_loadtest(requests, _config(node))
    assert result.ok and result.num_requests == 5
    assert (result.hit_blocks, result.num_blocks) == (10, 17)
    assert result.hit_blocks_per_tier == {"memory": 10}
    # the partial last block counts as a block: hit tokens are capped at the prompt's length
    hit_tokens = [0, 3 * 512 - 100, 2 * 512, 2 * 512, 3 * 512]
    assert result.hit_tokens == sum(hit_tokens)
    assert result.input_tokens == sum(len(ids) * 512 - 100 for ids in chains)
    sim = simulate(requests, "lru", 4)
    assert (sim.hit_blocks, sim.hit_tokens) == (result.hit_blocks, result.hit_tokens)
    assert result.stored_blocks == 3 + 2 + 1 + 1  # 1,2,3; 4,5; 3; 5


def test_trace_prefix_agrees_with_simulator() -> None:
    requests = read_trace(CONVERSATION)[:150]
    capacity = 150
    with _node(capacity) as node:
        result = replay_loadtest(requests, _config(node))
    comparison = compare_with_simulator(requests, result, capacity)
    assert result.ok and result.num_requests == 150 and result.short_gets == 0
    assert result.server_stats is not None and result.server_stats["tiers"][0]["evictions"] > 0  # it did evict
    assert comparison["sim_hit_ratio"] > 0.01
    assert abs(comparison["hit_ratio_diff"]) <= 0.01


def test_mismatching_bytes_are_counted(big_node: KVNode, tmp_path: Path) -> None:
    args = ["--trace", str(CONVERSATION), "--requests", "20", "--target", big_node.target,
            "--block-bytes", "1KiB", "--model", "mismatch-test", "--no-progress"]
    assert main([*args, "--seed", "0", "--json", str(tmp_path / "a.json")]) == 0
    first = json.loads((tmp_path / "a.json").read_text())
    assert first["byte_mismatches"] == 0 and first["num_blocks"] > 0
    # the same blocks again, expected with another seed's bytes: every hit block mismatches
    assert main([*args, "--seed", "1", "--json", str(tmp_path / "b.json")]) == 1
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["hit_blocks"] == second["num_blocks"] == first["num_blocks"]
    assert second["byte_mismatches"] == second["hit_blocks"]
    # and with the first seed again, none do
    assert main([*args, "--seed", "0", "--json", str(tmp_path / "c.json")]) == 0
    third = json.loads((tmp_path / "c.json").read_text())
    assert third["byte_mismatches"] == 0 and third["hit_blocks"] == third["num_blocks"]


def test_json_and_plots(big_node: KVNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    plots = tmp_path / "plots"
    rc = main(["--trace", str(CONVERSATION), "--requests", "40", "--target", big_node.target,
               "--block-bytes", "2KiB", "--model", "json-test", "--window", "0.2", "--no-progress",
               "--json", str(out), "--plot-dir", str(plots), "--sim-capacity", "inf"])
    assert rc == 0
    data = json.loads(out.read_text())
    for key in ("hit_ratio", "token_hit_ratio", "hit_blocks_per_tier", "tier_hit_ratios", "requests_per_s",
                "gb_per_s", "read_gb_per_s", "write_gb_per_s", "latency_ms", "byte_mismatches", "num_errors",
                "errors", "windows", "config", "client_targets", "server_stats", "simulator", "stop_reason"):
        assert key in data, key
    assert data["num_requests"] == 40 and data["stop_reason"] == "max_requests"
    assert data["encoded_block_bytes"] == 2048 + 128
    assert data["bytes_written"] == data["put_blocks"] * 2176
    assert data["bytes_read"] == data["hit_blocks"] * 2176
    for op in ("lookup", "get", "put", "request"):
        summary = data["latency_ms"][op]
        assert summary["count"] > 0 and 0 < summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"]
    assert sum(w["num_requests"] for w in data["windows"]) == 40
    assert sum(w["hit_blocks"] for w in data["windows"]) == data["hit_blocks"]
    # an unbounded node and the simulator at infinite capacity agree exactly
    assert data["simulator"]["sim_hit_blocks"] == data["hit_blocks"]
    assert {p.name for p in plots.iterdir()} == {"loadtest_hit_ratio.png", "loadtest_latency_cdf.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots.iterdir())
    assert "block hit ratio" in capsys.readouterr().out


def test_malformed_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(_mooncake_line(0, [1, 2]) + "\n" + _mooncake_line(5, [1, 3]) + "\n"
                     + '{"timestamp": 9, "input_length": 2000, "hash_ids": [1, 2]}\n')
    rc = main(["--trace", str(trace), "--target", f"127.0.0.1:{free_port()}", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{trace}:3:" in err and "hash_ids" in err
    # not JSON at all
    trace.write_text("{not json\n")
    assert main(["--trace", str(trace), "--no-progress"]) == 2
    assert f"{trace}:1:" in capsys.readouterr().err


def test_bad_block_bytes_and_unreachable_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(CONVERSATION), "--requests", "1", "--block-bytes", "1000", "--no-progress"]) == 2
    assert "multiple of 2 * block_tokens" in capsys.readouterr().err
    rc = main(["--trace", str(CONVERSATION), "--requests", "1", "--target", f"127.0.0.1:{free_port()}",
               "--timeout", "2", "--no-progress"])
    assert rc == 1
    assert "not serving" in capsys.readouterr().err


def _generic_trace(tmp_path: Path, num_requests: int, spacing_s: float) -> list[TraceRequest]:
    path = tmp_path / "generic.jsonl"
    write_trace(path, [TraceRequest(i * spacing_s, 3 * 512, 0, (100, 200 + i % 3, 300 + i))
                       for i in range(num_requests)])
    return read_trace(path)


def test_open_loop_follows_timestamps(big_node: KVNode, tmp_path: Path) -> None:
    requests = _generic_trace(tmp_path, 30, 0.1)  # 2.9 s of trace, 0.29 s at speedup 10
    result = replay_loadtest(requests, _config(big_node, speedup=10.0, max_inflight=4, model="open-test"))
    assert result.ok and result.num_requests == 30 and result.stop_reason == "trace_end"
    assert result.config.mode == "open" and result.schedule_lag_ms["count"] == 30
    assert result.elapsed_s >= 2.9 / 10
    # requests can overlap (a lookup may run before an earlier request's put ends), so at most the simulator's
    assert 0 < result.hit_blocks <= simulate(requests, "lru", None).hit_blocks


def test_duration_stops_the_open_loop(big_node: KVNode, tmp_path: Path) -> None:
    requests = _generic_trace(tmp_path, 50, 1.0)  # 49 s of trace
    result = replay_loadtest(requests, _config(big_node, speedup=1.0, duration_s=0.5, model="duration-test"))
    assert result.stop_reason == "duration"
    assert 1 <= result.num_issued < 50 and result.num_requests == result.num_issued


def test_closed_loop_with_workers_and_several_targets(big_node: KVNode) -> None:
    requests = read_trace(CONVERSATION)[:60]
    config = LoadTestConfig(targets=(big_node.target, big_node.target), concurrency=4,
                            payload_bytes=PAYLOAD_BYTES, model="workers-test")
    bar = io.StringIO()
    result = replay_loadtest(requests, config, progress=True, progress_file=bar)
    assert result.ok and result.num_requests == 60 and result.num_issued == 60
    assert "60/60" in bar.getvalue()  # the live progress bar ran to the end
    expected = config.targets if client_target_keyword() is not None else config.targets[:1]
    assert result.client_targets == expected
    assert result.hit_blocks <= simulate(requests, "lru", None).hit_blocks


def test_sim_capacity_node_reads_the_nodes_tier_and_agrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--sim-capacity node``: the simulation gets the capacity the node's memory tier has, in its own footprint
    of these blocks (about 150 of them), so the two hit ratios agree; a count that is not the node's draws a
    warning naming the node's."""
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, read_trace(CONVERSATION)[:150])
    args = ["--trace", str(trace), "--block-bytes", str(PAYLOAD_BYTES), "--no-progress", "--json",
            str(tmp_path / "out.json")]
    with _node(150) as node:
        assert main(["--target", node.target, *args, "--sim-capacity", "node"]) == 0
        out = capsys.readouterr().out
        report = json.loads((tmp_path / "out.json").read_text())
        simulator, memory = report["simulator"], report["server_stats"]["tiers"][0]
        footprint = memory["bytes"] / memory["blocks"]  # the tier's own: the heap's or the shared pool's
        assert simulator["capacity_blocks"] == int(memory["capacity_bytes"] // footprint)
        assert 140 <= simulator["capacity_blocks"] <= 170 and simulator["disk_capacity_blocks"] == 0
        assert memory["evictions"] > 0  # the capacity mattered
        assert abs(simulator["hit_ratio_diff"]) <= 0.01 and simulator["sim_hit_ratio"] > 0.01
        assert f"memory {memory['capacity_bytes']:,} B / {footprint:,.0f} B a block = " \
               f"{simulator['capacity_blocks']:,}" in out
        assert main(["--target", node.target, *args, "--sim-capacity", "5859", "--model", "other"]) == 0
        err = capsys.readouterr().err
        assert f"--sim-capacity 5859 is not the node's memory tier, which holds " \
               f"{simulator['capacity_blocks']:,} of these blocks" in err
    assert main(["--target", "127.0.0.1:1", "--target", "127.0.0.1:2", *args, "--sim-capacity", "node"]) == 2
    assert "give one --target" in capsys.readouterr().err


def test_the_legend_explains_every_row_of_the_summary(big_node: KVNode, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.tools.loadtest.cli import SUMMARY_LEGEND

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, read_trace(CONVERSATION)[:5])
    assert main(["--target", big_node.target, "--trace", str(trace), "--block-bytes", str(PAYLOAD_BYTES),
                 "--no-progress", "--legend", "--model", "legend"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("  ")[0] for line in out.splitlines() if line and not line.startswith(" ")]
    for row in rows:  # every row of the summary is explained (a latency row by "latency")
        assert any(row == name or (name == "latency" and row.endswith(" latency")) for name in SUMMARY_LEGEND), row
    assert all(f"  {name}" in out for name in SUMMARY_LEGEND)
