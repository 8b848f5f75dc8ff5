"""Write deploy/kubernetes/monitoring's copies of the shipped monitoring: the PrometheusRule holding
deploy/prometheus/alerts.yml's groups, and the dashboard JSON its ConfigMap is made from.

Run after changing alerts.yml or deploy/grafana/dashboards/kvstore.json: ``python scripts/gen_monitoring_k8s.py``
(``tests/deploy/test_monitoring.py`` checks that the copies agree).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("# For the Prometheus Operator: deploy/prometheus/alerts.yml's rules, as they are (tests/deploy/\n"
          "# test_monitoring.py checks that the two agree; scripts/gen_monitoring_k8s.py writes this file).\n")


def main() -> None:
    """Write ``prometheusrule.yaml`` and ``kvstore.json`` under ``deploy/kubernetes/monitoring``."""
    monitoring = ROOT / "deploy" / "kubernetes" / "monitoring"
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "kvstore", "labels": {"app.kubernetes.io/name": "kvstore"}},
            "spec": {"groups": groups}}
    (monitoring / "prometheusrule.yaml").write_text(HEADER + yaml.safe_dump(rule, sort_keys=False, width=120))
    shutil.copy(ROOT / "deploy" / "grafana" / "dashboards" / "kvstore.json", monitoring / "kvstore.json")


if __name__ == "__main__":
    main()
