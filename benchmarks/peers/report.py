"""bench_peers' figures from its samples: medians, ratios to ``copy_``, the goals of issues 38 and 40, the tables.

Pure logic over plain data (standard library only), so a test checks it
without any peer. Samples are milliseconds per call, keyed by system and by
``"<op>-<kind>"`` (``get-prefix``, ``put-block``, ...); the ``copy_`` system has
``get-prefix`` and ``get-block`` only, the unit of both Get and Put of that kind.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

COLUMNS = (("get-prefix", "Get 24 MiB"), ("put-prefix", "Put 24 MiB"), ("get-block", "Get 2 MiB"),
           ("put-block", "Put 2 MiB"))
"""The table's columns: the op and kind of each, and its heading."""
BASELINE = "copy_"

SAME_HOST_PEERS = ("mooncake-shm", "mooncake-local", "lmcache-local")
"""Issue 38: kvstore serve on its host must beat the fastest of these."""
REMOTE_PEERS = ("mooncake-tcp", "lmcache-server", "redis")
"""Issue 40: kvstore serve over loopback TCP must beat the fastest of these."""


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per system and column: the median, minimum and maximum ms, the count, and the median / ``copy_``'s median.

    Args:
        samples: ms per call, ``samples[system]["get-prefix"]``; must hold ``copy_``'s ``get-<kind>``.

    Returns:
        ``summary[system][column]`` with ``median_ms``, ``min_ms``, ``max_ms``, ``n`` and ``x_copy``
        (``None`` where the kind's ``copy_`` was not measured).
    """
    copy_ms = {kind: statistics.median(samples[BASELINE][f"get-{kind}"])
               for kind in ("prefix", "block") if samples.get(BASELINE, {}).get(f"get-{kind}")}
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for system, columns in samples.items():
        summary[system] = {}
        for column, values in columns.items():
            if not values:
                continue
            median = statistics.median(values)
            base = copy_ms.get(column.split("-", 1)[1])
            summary[system][column] = {"median_ms": median, "min_ms": min(values), "max_ms": max(values),
                                       "n": len(values), "x_copy": None if base is None else median / base}
    if BASELINE in summary:  # copy_ is the unit of Puts too
        for kind in ("prefix", "block"):
            if f"get-{kind}" in summary[BASELINE]:
                summary[BASELINE][f"put-{kind}"] = summary[BASELINE][f"get-{kind}"]
    return summary


def median_of(summary: dict[str, Any], system: str, column: str) -> float | None:
    """A system's median ms for a column, ``None`` if it was not measured."""
    return summary.get(system, {}).get(column, {}).get("median_ms")


def goal(name: str, value: float | None, limit: float, at_most: bool = True, detail: str = "") -> dict[str, Any]:
    """One goal: ``value`` against ``limit`` (``<=`` when ``at_most``, else ``>=``); unmet when not measured."""
    met = value is not None and (value <= limit if at_most else value >= limit)
    return {"name": name, "value": value, "limit": limit, "at_most": at_most, "met": met, "detail": detail}


def _versus(summary: dict[str, Any], system: str, peers: Iterable[str], column: str) -> tuple[float | None, str]:
    mine = median_of(summary, system, column)
    theirs = {peer: median_of(summary, peer, column) for peer in peers}
    theirs = {peer: ms for peer, ms in theirs.items() if ms is not None}
    if mine is None or not theirs:
        return None, "not measured"
    best = min(theirs, key=lambda peer: theirs[peer])
    return mine / theirs[best], f"fastest peer: {best}" if len(theirs) > 1 else f"against {best}"


def goals(summary: dict[str, Any], series: dict[str, list[float]], cpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 38's and 40's goals, each a ratio measured in this run.

    Args:
        summary: from :func:`summarize`.
        series: ms of consecutive Gets of the prefix, per system.
        cpu: the node-CPU phase's figures (``node_cpu_x_copy``, ``two_vs_one``), empty if not run.
    """
    out = []
    for column, heading in COLUMNS:
        value, detail = _versus(summary, "kvstore-shm", SAME_HOST_PEERS, column)
        out.append(goal(f"kvstore serve same host / fastest same-host peer, {heading}", value, 1.0, detail=detail))
    moonshot = summary.get("kvstore-shm", {}).get("get-prefix", {}).get("x_copy")
    out.append(goal("kvstore serve same host Get 24 MiB / copy_ (moonshot)", moonshot, 1.2))
    out.append(goal("node CPU per GiB of same-host hits / one single-threaded copy_ of a GiB",
                    cpu.get("node_cpu_x_copy"), 0.1))
    out.append(goal("aggregate same-host hit throughput, 2 clients / 1", cpu.get("two_vs_one"), 1.6, at_most=False))
    for column, heading in COLUMNS:
        value, detail = _versus(summary, "kvstore-embedded", ("lmcache-local",), column)
        out.append(goal(f"kvstore embedded / LMCache LocalCPUBackend, {heading}", value, 1.0, detail=detail))
    for column, heading in COLUMNS:
        value, detail = _versus(summary, "kvstore-grpc", REMOTE_PEERS, column)
        out.append(goal(f"kvstore serve over gRPC / fastest loopback-TCP peer, {heading}", value, 1.0, detail=detail))
    for column, heading in COLUMNS[:2]:
        value, detail = _versus(summary, "kvstore-grpc", ("raw-socket",), column)
        out.append(goal(f"kvstore serve over gRPC / raw socket, {heading} (moonshot)", value, 1.5, detail=detail))
    grpc_series = series.get("kvstore-grpc")
    spread = max(grpc_series) / statistics.median(grpc_series) if grpc_series else None
    out.append(goal(f"kvstore get_into over gRPC: slowest of {len(grpc_series or [])} consecutive / their median",
                    spread, 2.0))
    for column, heading in COLUMNS:  # issue 40's path: what a client on another host uses by default
        value, detail = _versus(summary, "kvstore-bulk", REMOTE_PEERS, column)
        out.append(goal(f"kvstore serve across hosts (bulk path) / fastest loopback-TCP peer, {heading}", value, 1.0,
                        detail=detail))
    for column, heading in COLUMNS[:2]:
        value, detail = _versus(summary, "kvstore-bulk", ("raw-socket",), column)
        out.append(goal(f"kvstore serve across hosts (bulk path) / raw socket, {heading} (moonshot)", value, 1.5,
                        detail=detail))
    bulk_series = series.get("kvstore-bulk")
    spread = max(bulk_series) / statistics.median(bulk_series) if bulk_series else None
    out.append(goal(f"kvstore get_into across hosts (bulk path): slowest of {len(bulk_series or [])} consecutive / "
                    "their median", spread, 2.0))
    out.append(goal("node CPU per GiB of remote Gets, bulk path / gRPC path (the same run)", cpu.get("bulk_x_grpc"),
                    0.5))
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def ratio_table(summary: dict[str, Any], systems: list[tuple[str, str]]) -> list[str]:
    """Markdown rows: each system's median as a multiple of ``copy_`` (lower is better), in the four columns."""
    lines = ["| system | " + " | ".join(heading for _, heading in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for key, label in systems:
        if key in summary:
            cells = [_fmt(summary[key].get(column, {}).get("x_copy")) for column, _ in COLUMNS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def ms_table(summary: dict[str, Any], systems: list[tuple[str, str]]) -> list[str]:
    """Markdown rows: each system's median ms (and its minimum) in the four columns."""
    lines = ["| system | " + " | ".join(f"{heading} ms (min)" for _, heading in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for key, label in systems:
        if key in summary:
            cells = []
            for column, _ in COLUMNS:
                figures = summary[key].get(column)
                cells.append("—" if figures is None else f"{figures['median_ms']:.2f} ({figures['min_ms']:.2f})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def goal_lines(items: list[dict[str, Any]]) -> list[str]:
    """Markdown list items, one per goal: value, limit, met or not."""
    lines = []
    for item in items:
        sign = "<=" if item["at_most"] else ">="
        state = "not measured" if item["value"] is None else ("met" if item["met"] else "**missed**")
        detail = f"; {item['detail']}" if item["detail"] and item["value"] is not None else ""
        lines.append(f"- {item['name']}: **{_fmt(item['value'])}** (goal {sign} {item['limit']}: {state}{detail})")
    return lines
