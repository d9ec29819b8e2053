"""The Grafana dashboard queries only metrics the workers and the operator export, and has the panels
operators need."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import promql_parser
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shard_operator.metrics import ControllerCollector
from shard_worker.telemetry.metrics import FAMILIES, LABELS, WorkerMetrics

from .chart import CHART, one

DASHBOARD = CHART / "dashboards" / "shard-operator.json"
# Grafana's interval macros are not PromQL: a duration stands in for them before parsing.
MACROS = re.compile(r"\$__(rate_interval|interval|range)\b")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
# Labels a series may carry: the worker's own, the operator's, histogram buckets', and those
# Prometheus adds to every target scraped through the PodMonitor.
KNOWN_LABELS = {*LABELS, *(label for _, _, extra in FAMILIES.values() for label in extra), "le",
                "namespace", "pod", "container", "job", "instance", "phase", "verb", "reason"}
# Panels the operations guide promises (issue: packaging).
REQUIRED_PANELS = [
    "Resident vs predicted memory per partition", "Communication throughput per rank",
    "Communication time per rank", "Compute and idle time per stage", "Request latency p50 / p99",
    "Time to first token p50 / p99", "Tokens/s", "Ready groups", "Models by phase", "Reconciles/s and failures/s",
]


class StubController:
    """What the operator's collector reads, with one model and one request of each verb."""

    reconciles, failures = 3, 1
    kube = type("Kube", (), {"calls": {"list": 3, "create": 1, "patch": 1, "delete": 1}})()
    @staticmethod
    def statuses():
        return {("ns", "m"): {"phase": "Degraded", "replicas": 1, "readyReplicas": 1,
                              "groups": [{"replica": 0, "restarts": 3}],
                              "conditions": [{"type": "Degraded", "status": "True",
                                              "reason": "RestartBudgetExhausted"}]}}

    def __init__(self):
        self.reconcile_seconds = Histogram("shard_operator_reconcile_seconds", "t", registry=None)
        self.reconcile_seconds.observe(0.1)


def operator_names() -> set[str]:
    """Every sample name the operator's /metrics carries."""
    registry = CollectorRegistry()
    registry.register(ControllerCollector(StubController()))
    text = generate_latest(registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def exported_names() -> set[str]:
    """Every sample name a worker's /metrics really carries, read back from the exposition."""
    metrics = WorkerMetrics.create(model="m", group=0, rank=0, stage=0, tp_rank=0)
    for name, (_, _, extra) in FAMILIES.items():
        metrics.get(name, **{label: "x" for label in extra})  # a child per family, so it is exposed
    text = generate_latest(metrics.registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    flat = []
    for panel in dash["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return flat


def queries(dash: dict) -> list[str]:
    """Every PromQL expression: panel targets and template variables (label_values' selector)."""
    found = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = LABEL_VALUES.match(query)
            assert match, f"variable {var['name']}: unsupported query {query!r}"
            assert match["label"] in KNOWN_LABELS, f"variable {var['name']}: no series has label {match['label']}"
            found.append(match["selector"])
    return found


def references(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to, from its parsed syntax tree."""
    ast = promql_parser.parse(MACROS.sub("5m", expr))
    names: set[str] = set()
    labels: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)
            labels.update(m.name for m in node.matchers.matchers)
        modifier = getattr(node, "modifier", None)
        if isinstance(modifier, promql_parser.AggModifier):
            labels.update(modifier.labels)
        elif modifier is not None and modifier.matching is not None:  # on (...) / ignoring (...)
            labels.update(modifier.matching.labels)
        for attr in ("expr", "lhs", "rhs", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                visit(child)
        for arg in getattr(node, "args", None) or []:
            visit(arg)

    visit(ast)
    return names, labels


def metric_names(expr: str) -> set[str]:
    return references(expr)[0]


def test_exported_names_follow_prometheus_conventions():
    names = exported_names()
    assert "shard_tokens_generated_total" in names and "shard_request_latency_seconds_bucket" in names
    assert "shard_group_ready" in names


@pytest.mark.parametrize("module", ["shard_worker.telemetry.metrics", "shard_operator.metrics"])
def test_neither_plane_exposes_created_series(module):
    """Each in a process of its own (the setting is process-wide): once a plane's metrics module is
    imported, its counters and histograms have no `_created` series."""
    script = (f"import {module}\n"
              "from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest\n"
              "registry = CollectorRegistry()\n"
              "Counter('c', 'c', registry=registry).inc()\n"
              "Histogram('h', 'h', registry=registry).observe(1)\n"
              "print(generate_latest(registry).decode())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "c_total 1.0" in out and "h_count 1.0" in out and "_created" not in out


def test_every_query_names_only_exported_metrics():
    operator = operator_names()
    exported = exported_names() | operator
    exprs = queries(dashboard())
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        names, labels = references(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} queries {sorted(unknown)}, which neither workers nor the operator export"
        assert labels <= KNOWN_LABELS, f"{expr!r} uses labels {sorted(labels - KNOWN_LABELS)} no series has"
        used |= names
    # Every family is on the dashboard somewhere (histograms through any of their series).
    families = {n.removesuffix(s) for n in used for s in ("_bucket", "_sum", "_count", "_total")
                if n.endswith(s)} | used
    assert set(FAMILIES) <= families, f"not on the dashboard: {sorted(set(FAMILIES) - families)}"
    assert operator <= used | {n for n in operator if n.endswith(("_sum", "_count"))}, \
        f"operator metrics not on the dashboard: {sorted(operator - used)}"


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="1"}[$__rate_interval])))', {"a_bucket"}),
    ("sum(rate(b_total[5m])) / sum(c) * 100", {"b_total", "c"}),
    ("-max_over_time((d offset 1m)[1h:5m]) > bool 0", {"d"}),
])
def test_metric_names_are_found_anywhere_in_an_expression(expr, names):
    assert metric_names(expr) == names


def test_labels_are_found_in_matchers_groupings_and_vector_matching():
    expr = 'sum by (le, model) (rate(x{a="1", b=~"2"}[5m])) / on (rank) group_left sum without (c) (y)'
    assert references(expr)[1] == {"le", "model", "a", "b", "rank", "c"}


def test_the_panels_operators_need():
    titles = {p["title"] for p in panels(dashboard())}
    assert not set(REQUIRED_PANELS) - titles
    ids = [p["id"] for p in panels(dashboard())]
    assert len(ids) == len(set(ids))


def test_every_panel_uses_the_datasource_variable():
    dash = dashboard()
    assert dash["templating"]["list"][0] == {**dash["templating"]["list"][0], "type": "datasource",
                                             "name": "datasource"}
    for panel in panels(dash):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_configmap_carries_the_dashboard_for_the_sidecar(rendered):
    _, objects = rendered
    configmap = one(objects, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["shard-operator.json"]) == dashboard()
