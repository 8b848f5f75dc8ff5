"""The monitoring that ships with the deployment: Prometheus' scrape config and alert rules, Grafana's dashboard.

Prometheus' own ``promtool`` (Debian's ``prometheus`` package, installed by ``make
system-deps``) checks the config and the rules and runs the rules' unit tests
(``tests/deploy/alerts_test.yml``: each alert fires on the series that should fire
it, and not on healthy ones). Every ``kvstore_*`` series a dashboard panel or an
alert reads must be one a live node exports (its ``/metrics``, with a disk tier,
Redis and the same-host plane on, so every family is there); the engine's
``vllm:kvstore_*`` series are checked in the vLLM half
(``tests/connectors/vllm/test_dashboard_metrics.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.dashboard import (
    ALERTS_FILE,
    PROMETHEUS_OWN,
    alert_queries,
    dashboard,
    dashboard_queries,
    exported_names,
    metric_names,
    panels,
    unexported,
)
from tests.support.deploy import COMPOSE_FILE, KUBERNETES_DIR, PROMETHEUS_FILE, REPO_ROOT
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.server import ThreadedServer, make_config

GRAFANA_DIR = REPO_ROOT / "deploy" / "grafana"
ALERTS_TEST_FILE = Path(__file__).with_name("alerts_test.yml")


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `apt-get install prometheus` (Debian's package; `make system-deps` installs it)"
    return path


def _run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_promtool_accepts_the_config_and_the_rules(tmp_path: Path) -> None:
    shutil.copytree(PROMETHEUS_FILE.parent, tmp_path / "prometheus")
    checked = _run_promtool("check", "config", str(tmp_path / "prometheus" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "alerts.yml" in checked.stdout  # the config loads the rules
    rules = _run_promtool("check", "rules", str(ALERTS_FILE))
    assert rules.returncode == 0 and "SUCCESS" in rules.stdout, rules.stdout + rules.stderr


def test_the_alerts_fire_when_they_should_and_not_otherwise(tmp_path: Path) -> None:
    shutil.copy(ALERTS_FILE, tmp_path / "alerts.yml")
    shutil.copy(ALERTS_TEST_FILE, tmp_path / "alerts_test.yml")
    result = _run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [a for t in yaml.safe_load(ALERTS_TEST_FILE.read_text())["tests"] for a in t["alert_rule_test"]]
    assert {a["alertname"] for a in cases if a["exp_alerts"]} == {name for name, _ in alert_queries()}, \
        "every alert has a unit test in which it fires"


def test_promtool_catches_a_broken_rule(tmp_path: Path) -> None:
    """The rules check can fail: a rule with a PromQL syntax error is refused."""
    broken = yaml.safe_load(ALERTS_FILE.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "up{job=\"kvstore\" == 0"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(broken))
    assert _run_promtool("check", "rules", str(tmp_path / "alerts.yml")).returncode != 0


def test_prometheus_scrapes_every_node_and_every_vllm_worker(compose: dict) -> None:
    prometheus = yaml.safe_load(PROMETHEUS_FILE.read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    services = compose["services"]
    names = {job: {n for sd in jobs[job]["dns_sd_configs"] for n in sd["names"]} for job in jobs}
    assert names["kvstore"] == {s for s in services if s.startswith("kvstore")}
    assert names["vllm"] == {s for s in services if s.startswith("vllm")}
    assert {sd["port"] for sd in jobs["kvstore"]["dns_sd_configs"]} == {9400}
    assert {sd["port"] for sd in jobs["vllm"]["dns_sd_configs"]} == {8000}
    for name in names["vllm"]:  # vLLM serves its /metrics on the API port
        assert any(p.endswith(":8000") for p in services[name]["ports"])
    assert prometheus["rule_files"] == ["alerts.yml"]


def test_compose_runs_prometheus_with_the_rules_and_a_healthcheck_and_grafana_with_the_dashboard(
        compose: dict) -> None:
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in prometheus["volumes"]
    assert "http://127.0.0.1:9090/-/ready" in prometheus["healthcheck"]["test"]
    assert "/api/health" in " ".join(grafana["healthcheck"]["test"])
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    mounts = {m.split(":")[1]: REPO_ROOT / m.split(":")[0] for m in grafana["volumes"] if m.startswith("./")}
    assert mounts["/var/lib/grafana/dashboards"] == GRAFANA_DIR / "dashboards"
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning/dashboards"] / "kvstore.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].endswith("/kvstore.json")


def test_the_dashboard_shows_what_an_operator_asks_for() -> None:
    board = dashboard()
    assert board["uid"] == "kvstore" and {v["name"] for v in board["templating"]["list"]} == {"datasource", "instance"}
    shown = " ".join(expr for _, expr in dashboard_queries(board))
    for series in ("kvstore_lookup_blocks_total", "kvstore_tier_hits_total", "kvstore_tenant_lookup_blocks_total",
                   "kvstore_tier_bytes", "kvstore_tier_capacity_bytes", "kvstore_tier_evictions_total",
                   "kvstore_tier_demotions_total", "kvstore_request_duration_seconds_bucket",
                   "kvstore_requests_total", "kvstore_shm_sessions", "kvstore_shm_leases", "kvstore_tier_up",
                   "vllm:kvstore_hit_tokens_total", "vllm:kvstore_load_seconds_bucket",
                   "vllm:kvstore_load_failed_blocks_total"):
        assert series in shown, f"no panel shows {series}"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        if panel["type"] != "row":
            assert panel["targets"] and panel["description"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_the_metric_name_check_can_fail() -> None:
    assert metric_names('sum by (tier) (rate(kvstore_tier_hits_total{tier="memory",instance=~"$instance"}'
                        '[$__rate_interval])) / ignoring(le) kvstore_tier_bytes > 0.5') == \
        {"kvstore_tier_hits_total", "kvstore_tier_bytes"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(vllm:kvstore_load_seconds_bucket[5m])))") == \
        {"vllm:kvstore_load_seconds_bucket"}
    assert unexported(iter([("a panel", "rate(kvstore_no_such_series_total[5m])")]), {"kvstore_tier_bytes"},
                      "kvstore_") == ["a panel: kvstore_no_such_series_total"]


@pytest.mark.slow
def test_every_node_series_a_panel_or_an_alert_reads_is_exported_by_a_live_node(
        redis_server: RedisProcess, tmp_path: Path) -> None:  # noqa: F811
    server = ThreadedServer(make_config(**{
        "store.memory.capacity_bytes": 16 << 20, "store.disk.path": str(tmp_path / "disk"),
        "store.disk.capacity_bytes": 64 << 20, "store.redis.url": redis_server.url,
    }))
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    finally:
        server.stop()
    exported = exported_names(text.decode())
    assert {"kvstore_tier_bytes", "kvstore_shm_sessions", "kvstore_requests_total"} <= exported
    missing = unexported(dashboard_queries(), exported, "kvstore_") + unexported(alert_queries(), exported, "kvstore_")
    assert not missing, f"panels or alerts read series no node exports: {missing}"
    others = {n for _, e in [*dashboard_queries(), *alert_queries()] for n in metric_names(e)
              if not n.startswith(("kvstore_", "vllm:kvstore_"))}
    assert others <= PROMETHEUS_OWN, others


def test_kubernetes_gets_the_rules_and_the_dashboard() -> None:
    """deploy/kubernetes/monitoring: a PrometheusRule holding alerts.yml's groups as they are, and a
    ServiceMonitor of the nodes' metrics port (for the Prometheus Operator; docs/deploy.md)."""
    monitoring = KUBERNETES_DIR / "monitoring"
    rule = yaml.safe_load((monitoring / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"  # scripts/gen_monitoring_k8s.py writes it and the JSON copy
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    monitor = yaml.safe_load((monitoring / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor"
    services = [d for d in yaml.safe_load_all((KUBERNETES_DIR / "service.yaml").read_text()) if d]
    named_ports = {p.get("name") for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= named_ports
    kustomization = yaml.safe_load((monitoring / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["kvstore.json"] and (monitoring / "kvstore.json").read_text() == \
        (GRAFANA_DIR / "dashboards" / "kvstore.json").read_text()
    assert json.loads((monitoring / "kvstore.json").read_text())["uid"] == "kvstore"


def test_every_panels_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel's query, its Grafana variables given values, parses as PromQL: promtool checks them as the
    expressions of recording rules."""
    rules = [{"record": f"kvstore:panel_{i}", "expr": expr.replace("$__rate_interval", "5m").replace("$instance", ".*")}
             for i, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checked = _run_promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout
    rules[0]["expr"] = "sum(rate(kvstore_tier_hits_total[5m])"  # and the check can fail
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    assert _run_promtool("check", "rules", str(path)).returncode != 0
