"""``kvstore simulate`` end to end: table, JSON and PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstore.tools.sim.cli import main, parse_capacity, register
from kvstore.tools.trace import TraceRequest, write_trace

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"


def test_cli_writes_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["--trace", str(TRACES / "mooncake_synthetic_trace.jsonl"), "--policy", "lru,default,belady",
                 "--capacity", "1000,3GiB,inf", "--block-bytes", "512KiB", "--json", str(out_json),
                 "--plot", str(out_png)])
    assert code == 0
    table = capsys.readouterr().out
    assert "mooncake_synthetic_trace" in table and "infinite" in table and "6144" in table
    data = json.loads(out_json.read_text())
    rows = data["results"]
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("lru", 1000), ("adaptive", 1000), ("belady", 1000), ("lru", 6144), ("adaptive", 6144), ("belady", 6144),
        ("infinite", None)]
    assert rows[2]["bound_exact"] is True and rows[2]["hit_ratio"] >= rows[1]["hit_ratio"]
    assert rows[-1]["hit_ratio"] == pytest.approx(0.6396, abs=0.002)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_tiers_and_generic_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.jsonl"
    write_trace(path, [TraceRequest(i, 1024, 0, (1, 2)) for i in range(3)])
    assert main(["--trace", str(path), "--format", "generic", "--policy", "lru", "--capacity", "1",
                 "--disk-capacity", "4", "--json", str(tmp_path / "g.json")]) == 0
    row = json.loads((tmp_path / "g.json").read_text())["results"][0]
    assert row["disk_capacity_blocks"] == 4 and row["hit_blocks"] == 4


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t_s": 0, "tokens": 1, "blocks": [-1]}\n')
    assert main(["--trace", str(bad), "--capacity", "10"]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err
    assert main(["--policy", "fifo", "--capacity", "10"]) == 2
    assert main(["--capacity", "3GiB"]) == 2  # a size needs --block-bytes
    capsys.readouterr()
    assert main(["--capacity", "-5"]) == 2
    assert "bad capacity '-5'" in capsys.readouterr().err  # observed: "is a size: give --block-bytes"
    assert main(["--capacity", "10", "--plot", str(tmp_path / "no" / "such" / "dir.png")]) == 2
    assert "cannot write" in capsys.readouterr().err  # observed: a traceback after the whole run


def test_register_adds_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--capacity", "inf"])
    assert callable(args.func) and args.capacity == "inf"
    assert parse_capacity("inf", None) is None
    assert parse_capacity("3GiB", 512 * 1024) == 6144
    assert parse_capacity("5%", None, 43924) == 2196


def test_the_node_takes_the_same_policy_names() -> None:
    from kvstore.cli import build_parser
    from kvstore.config import StoreConfig, load_config
    from kvstore.errors import ConfigError
    from kvstore.policy import DEFAULT_POLICY, AdaptivePolicy, SegmentedLRUPolicy
    from kvstore.store.tiered import TieredStore
    from kvstore.tiers.memory import MemoryTier

    assert StoreConfig().policy == "default" and DEFAULT_POLICY == "adaptive"
    args = build_parser().parse_args(["serve", "--policy", "slru"])
    assert load_config(env={}, overrides={"store.policy": args.policy}).store.policy == "slru"
    assert load_config(env={"KVSTORE_POLICY": "lru"}).store.policy == "lru"
    with pytest.raises(ConfigError, match="unknown policy 'fifo'"):
        load_config(env={}, overrides={"store.policy": "fifo"})
    for name, kind in (("default", AdaptivePolicy), ("slru", SegmentedLRUPolicy)):
        store = TieredStore([MemoryTier(1 << 20)], StoreConfig(policy=name))
        assert type(store.index.policies[0]) is kind and store.index.policies[0].capacity_bytes == 1 << 20


def test_the_table_shows_capacities_as_given_explains_its_columns_and_progress_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.tools.sim.cli import COLUMNS

    code = main(["--trace", str(TRACES / "mooncake_synthetic_trace.jsonl"), "--policy", "lru",
                 "--capacity", "5%,3GiB", "--disk-capacity", "25%", "--block-bytes", "512KiB", "--progress",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = lines[0].split()
    assert header[:5] == ["trace", "policy", "capacity", "blocks", "disk"]
    rows = [line.split() for line in lines[1:3]]
    assert [r[2] for r in rows] == ["5%", "3GiB"] and rows[1][3] == "6144"  # as given, then in blocks
    assert rows[0][4].startswith("25%") and rows[0][5].startswith("(")  # the disk: as given (blocks)
    for column, meaning in COLUMNS.items():  # every column explained under the table
        assert any(line.strip().startswith(column) and meaning in line for line in lines[3:]), column
    assert "simulate" in captured.err and "2/2" in captured.err  # the progress bar, on stderr
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["capacity"], r["disk_capacity"]) for r in results] == [("5%", "25%"), ("3GiB", "25%")]
    assert main(["--trace", str(TRACES / "mooncake_synthetic_trace.jsonl"), "--policy", "lru", "--capacity", "5%",
                 "--no-legend"]) == 0
    assert "gap_closed  (" not in capsys.readouterr().out
