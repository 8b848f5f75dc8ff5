"""bench_peers' figures (``benchmarks/peers/report.py``): medians against ``copy_``, goals against the fastest peer.

Pure logic on made-up samples: no peer, no server. The benchmark itself runs
with ``make bench-peers`` (the peers' venvs), never in the test suite.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report() -> Any:
    spec = importlib.util.spec_from_file_location("bench_peers_report", ROOT / "benchmarks" / "peers" / "report.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


report = _report()

SAMPLES = {
    "copy_": {"get-prefix": [4.0, 5.0, 6.0], "get-block": [0.2, 0.3, 0.25]},
    "kvstore-shm": {"get-prefix": [10.0, 11.0, 12.0], "put-prefix": [20.0], "get-block": [0.5], "put-block": [1.0]},
    "mooncake-shm": {"get-prefix": [6.0], "put-prefix": [8.0], "get-block": [1.5], "put-block": [1.0]},
    "mooncake-local": {"get-prefix": [5.5], "put-prefix": [10.0], "get-block": [0.6], "put-block": [0.8]},
    "lmcache-local": {"get-prefix": [9.0], "put-prefix": [12.0], "get-block": [0.4], "put-block": [0.9]},
    "kvstore-grpc": {"get-prefix": [100.0], "put-prefix": [50.0], "get-block": [5.0], "put-block": [4.0]},
    "redis": {"get-prefix": [80.0], "put-prefix": [60.0], "get-block": [4.0], "put-block": [8.0]},
    "raw-socket": {"get-prefix": [20.0], "put-prefix": [25.0]},
}


def test_every_median_is_a_multiple_of_the_copy_of_the_same_bytes() -> None:
    summary = report.summarize(SAMPLES)
    assert summary["kvstore-shm"]["get-prefix"]["median_ms"] == 11.0
    assert summary["kvstore-shm"]["get-prefix"]["x_copy"] == pytest.approx(11.0 / 5.0)
    assert summary["kvstore-shm"]["put-prefix"]["x_copy"] == pytest.approx(20.0 / 5.0)  # Puts against the same copy_
    assert summary["kvstore-shm"]["get-block"]["x_copy"] == pytest.approx(0.5 / 0.25)
    assert summary["copy_"]["put-block"]["x_copy"] == 1.0 and summary["copy_"]["get-prefix"]["x_copy"] == 1.0
    assert (summary["kvstore-shm"]["get-prefix"]["min_ms"], summary["kvstore-shm"]["get-prefix"]["n"]) == (10.0, 3)


def test_goals_compare_kvstore_with_the_fastest_peer_of_each_column() -> None:
    goals = {g["name"]: g for g in report.goals(report.summarize(SAMPLES), {"kvstore-grpc": [10.0] * 19 + [25.0]},
                                               {"node_cpu_x_copy": 0.5, "two_vs_one": 1.7})}
    get = goals["kvstore serve same host / fastest same-host peer, Get 24 MiB"]
    assert get["value"] == pytest.approx(11.0 / 5.5) and not get["met"]
    assert get["detail"] == "fastest peer: mooncake-local"
    put_block = goals["kvstore serve same host / fastest same-host peer, Put 2 MiB"]
    assert put_block["value"] == pytest.approx(1.0 / 0.8) and "mooncake-local" in put_block["detail"]
    get_block = goals["kvstore serve same host / fastest same-host peer, Get 2 MiB"]
    assert get_block["value"] == pytest.approx(0.5 / 0.4) and "lmcache-local" in get_block["detail"]
    # the remote peers that ran (LMCache's server and Mooncake's TCP mode did not): Redis here
    remote = goals["kvstore serve over gRPC / fastest loopback-TCP peer, Put 2 MiB"]
    assert remote["value"] == pytest.approx(4.0 / 8.0) and remote["met"] and "redis" in remote["detail"]
    raw = goals["kvstore serve over gRPC / raw socket, Get 24 MiB (moonshot)"]
    assert raw["value"] == pytest.approx(5.0) and raw["detail"] == "against raw-socket"
    assert goals["aggregate same-host hit throughput, 2 clients / 1"]["met"]  # at least 1.6
    assert not goals["node CPU per GiB of same-host hits / one single-threaded copy_ of a GiB"]["met"]  # at most 0.1
    spread = goals["kvstore get_into over gRPC: slowest of 20 consecutive / their median"]
    assert spread["value"] == pytest.approx(2.5) and not spread["met"]


def test_a_goal_whose_systems_did_not_run_is_not_measured_and_not_met() -> None:
    samples = {key: SAMPLES[key] for key in ("copy_", "kvstore-shm")}
    goals = report.goals(report.summarize(samples), {}, {})
    unmeasured = [g for g in goals if g["value"] is None]
    assert len(unmeasured) == len(goals) - 1  # only the moonshot against copy_ could be measured
    assert not any(g["met"] for g in unmeasured)
    assert all("not measured" in line for line, g in zip(report.goal_lines(goals), goals) if g["value"] is None)


def test_the_tables_have_a_row_per_system_that_ran_and_a_dash_for_what_it_did_not() -> None:
    summary = report.summarize(SAMPLES)
    rows = report.ratio_table(summary, [("copy_", "copy_"), ("raw-socket", "raw"), ("absent", "never ran")])
    assert rows[0] == "| system | Get 24 MiB | Put 24 MiB | Get 2 MiB | Put 2 MiB |"
    assert rows[2] == "| copy_ | 1.00 | 1.00 | 1.00 | 1.00 |"
    assert rows[3] == "| raw | 4.00 | 5.00 | — | — |"
    assert len(rows) == 4
    row = report.ms_table(summary, [("kvstore-shm", "kv")])[2]
    assert row == "| kv | 11.00 (10.00) | 20.00 (20.00) | 0.50 (0.50) | 1.00 (1.00) |"
