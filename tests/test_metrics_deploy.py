"""The Grafana dashboard and the Prometheus alert rules under deploy/, against what the code
exports: promtool checks and unit-tests the rules, every query names only metrics the code
exports and parses as PromQL, and docs/metrics.md explains every metric and every alert."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuhedge_celery.metrics.definitions import ALL_METRICS, sample_names
from tests.support.prometheus_server import binary

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "gpuhedge-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "gpuhedge-alerts_test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "gpuhedge-dashboard.json"
DOC = REPO / "docs" / "metrics.md"
METRIC = re.compile(r"\bgpuhedge_[a-z0-9_]+\b")
# Grafana's macros and the dashboard's variables, as Grafana would substitute them
GRAFANA_VARS = {"$__rate_interval": "5m", "$pool": ".*"}


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=30)  # fmt: skip


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, variables substituted."""
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARS.items():
                expr = expr.replace(name, value)
            found.append((panel["title"], expr))
    return found


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_alert_rules_pass_their_unit_tests():
    out = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {rule["alert"] for rule in alert_rules()}  # each alert has a test


def test_alert_rules_use_only_exported_metrics():
    exported = sample_names()
    for rule in alert_rules():
        names = set(METRIC.findall(rule["expr"]))
        assert names and names <= exported, (rule["alert"], names - exported)


def test_every_dashboard_query_names_exported_metrics_and_parses(tmp_path):
    exported = sample_names()
    queries = dashboard_queries()
    used = set()
    for title, expr in queries:
        names = set(METRIC.findall(expr))
        assert names, (title, expr)
        assert names <= exported, (title, sorted(names - exported))
        used |= names
    # what an on-call engineer needs on it
    for needed in ("gpuhedge_races_hedged_total", "gpuhedge_race_e2e_seconds_bucket",
                   "gpuhedge_race_billed_usd_total", "gpuhedge_race_wasted_usd_total",
                   "gpuhedge_race_leaks_total", "gpuhedge_timer_lag_seconds_bucket",
                   "gpuhedge_pool_gpus", "gpuhedge_pool_waiters"):  # fmt: skip
        assert needed in used, needed
    # PromQL syntax: promtool parses each query as a recording rule
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


def test_docs_explain_every_metric_and_every_alert():
    doc = DOC.read_text()
    for spec in ALL_METRICS:
        assert f"`{spec.samples()[0] if spec.kind == 'counter' else spec.name}`" in doc, spec.name
    for rule in alert_rules():
        assert f"### {rule['alert']}" in doc, rule["alert"]
        assert rule["annotations"]["runbook"] == f"docs/metrics.md#{rule['alert'].lower()}"
