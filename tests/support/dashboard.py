"""The shipped Grafana dashboard and Prometheus alert rules, and the metric names their PromQL queries read.

``tests/deploy/test_monitoring.py`` checks the node's names against a live node's
``/metrics``; ``tests/connectors/vllm/test_dashboard_metrics.py`` the engine's
(``vllm:kvstore_*``) against the connector's Prometheus metrics in a real vLLM
registry. Neither keeps a list of names: both read what the code exports.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import yaml

from tests.support.deploy import REPO_ROOT

DASHBOARD_FILE = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "kvstore.json"
ALERTS_FILE = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"

PROMETHEUS_OWN = frozenset({"up"})
"""Series Prometheus makes itself, for every target: no exporter has them."""

_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
})
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON."""
    return json.loads(DASHBOARD_FILE.read_text())


def panels(board: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel of the dashboard, rows' nested panels included."""
    for panel in (board or dashboard())["panels"]:
        yield panel
        yield from panel.get("panels", ())


def dashboard_queries(board: dict[str, Any] | None = None) -> Iterator[tuple[str, str]]:
    """``(panel title, PromQL)`` of every query of the dashboard."""
    for panel in panels(board):
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]


def alert_queries() -> Iterator[tuple[str, str]]:
    """``(alert name, PromQL)`` of every rule of ``alerts.yml``."""
    for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule["record"], rule["expr"]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, label names
    (in ``{...}`` or a grouping), label values, durations or Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations ($__rate_interval, 5m)
    text = _GROUPING.sub("", text)  # by (tier), on (instance), ...
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name, rest = match.group(0), text[match.end():].lstrip()
        if rest.startswith("(") or name in _KEYWORDS or text[max(0, match.start() - 1)] in "$.0123456789":
            continue  # a function, a keyword, a variable or part of a number (1e3)
        names.add(name)
    return names


def exported_names(exposition: str) -> set[str]:
    """Every series name an exposition in Prometheus' text format offers, samples or not: each family's
    name, and its ``_total`` (counters) or ``_bucket``, ``_sum`` and ``_count`` (histograms)."""
    names = set()
    for line in exposition.splitlines():
        match = re.match(r"# TYPE (\S+) (\S+)", line)
        if match:
            name, kind = match.groups()
            base = name.removesuffix("_total")
            names |= {name, base}
            if kind == "counter":
                names.add(f"{base}_total")
            elif kind in ("histogram", "gaugehistogram"):
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", line)
        if match:
            names.add(match.group(1))
    return names


def unexported(queries: Iterator[tuple[str, str]], exported: set[str], prefix: str) -> list[str]:
    """``"<title>: <name>"`` for each name starting with ``prefix`` that a query reads and nobody exports."""
    return [f"{title}: {name}" for title, expr in queries for name in sorted(metric_names(expr))
            if name.startswith(prefix) and name not in exported]
