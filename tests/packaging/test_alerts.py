"""The chart's alerting rules (templates/prometheusrule.yaml): rendered only when asked for and when
the Prometheus Operator's API exists, valid for the real `promtool`, querying only what the workers
and the operator export, and each alert firing exactly when it should (`promtool test rules` on
alerts_test.yaml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .chart import MONITORING_API, find, one, render
from .test_dashboard import KNOWN_LABELS, exported_names, operator_names, references

CASES = Path(__file__).with_name("alerts_test.yaml")
ALERTS = {"ShardRankDown", "ShardResidentAbovePlan", "ShardCommunicationShareHigh", "ShardRequestsFailing",
          "ShardRestartBudgetExhausted", "ShardRankFailedForGood"}
ON = ["metrics.prometheusRule.enabled=true", "metrics.podMonitor.enabled=true"]


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: `make system-tools` installs it (apt-get install prometheus)"
    return path


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    rule = one(render(sets=ON, api_versions=MONITORING_API), "PrometheusRule")
    return rule["spec"]["groups"]


def write_rules(directory: Path, groups: list[dict]) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_rules_only_when_asked_for_and_the_api_exists():
    assert not find(render(sets=ON), "PrometheusRule")
    assert not find(render(api_versions=MONITORING_API), "PrometheusRule")
    # Without the PodMonitor no series says a rank does not answer: that alert would never fire.
    groups = one(render(sets=ON[:1], api_versions=MONITORING_API), "PrometheusRule")["spec"]["groups"]
    assert {r["alert"] for g in groups for r in g["rules"]} == ALERTS - {"ShardRankDown"}


def test_every_alert_queries_only_exported_series(rules):
    names = exported_names() | operator_names() | {"up"}
    alerts = [r for g in rules for r in g["rules"]]
    assert {r["alert"] for r in alerts} == ALERTS
    for rule in alerts:
        used, labels = references(rule["expr"])
        assert used <= names, f"{rule['alert']} queries {sorted(used - names)}, which nobody exports"
        assert labels <= KNOWN_LABELS, f"{rule['alert']} uses labels {sorted(labels - KNOWN_LABELS)}"
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_promtool_checks_the_rules_and_every_alert_fires_when_it_should(rules, tmp_path):
    write_rules(tmp_path, rules)
    shutil.copy(CASES, tmp_path / CASES.name)
    check = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    cases = yaml.safe_load(CASES.read_text())
    tested = {t["alertname"] for case in cases["tests"] for t in case["alert_rule_test"]}
    assert tested == ALERTS
    result = subprocess.run([promtool(), "test", "rules", CASES.name], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_fails_a_rule_that_does_not_fire(rules, tmp_path):
    """The cases can fail: with the communication threshold raised, its case does."""
    raised = yaml.safe_load(yaml.safe_dump(rules))
    for rule in raised[0]["rules"]:
        if rule["alert"] == "ShardCommunicationShareHigh":
            rule["expr"] = rule["expr"].replace("> 0.5", "> 0.7")
    write_rules(tmp_path, raised)
    shutil.copy(CASES, tmp_path / CASES.name)
    result = subprocess.run([promtool(), "test", "rules", CASES.name], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "ShardCommunicationShareHigh" in result.stdout + result.stderr
