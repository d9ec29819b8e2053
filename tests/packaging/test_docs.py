"""docs/operations.md says what the chart, the operator and the workers really do."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import yaml

from shard_operator.reconcile.handlers import kopf_settings
from shard_operator.settings import Settings
from shard_worker.telemetry.metrics import FAMILIES

from .chart import CHART, REPO, SIZING_COMMAND

GUIDE = (REPO / "docs" / "operations.md").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def section(title: str) -> str:
    start = GUIDE.index(title)
    end = GUIDE.find("\n#", start + len(title))
    return GUIDE[start:end if end > 0 else None]


def values_table_keys() -> list[str]:
    """Dotted keys of the first column of the Values table (`a.b` / `.c` means a.b and a.c)."""
    keys = []
    for line in section("### Values").splitlines():
        if not line.startswith("| `"):
            continue
        base = ""
        for token in re.findall(r"`([\w.*]+)`", line.split("|")[1]):
            if token.startswith("."):
                keys.append(base + token)
            else:
                keys.append(token)
                base = token.rsplit(".", 1)[0] if "." in token else token
    return keys


def test_every_top_level_value_is_documented():
    documented = {key.split(".")[0] for key in values_table_keys()}
    assert set(VALUES) <= documented, sorted(set(VALUES) - documented)


def test_documented_values_exist():
    for key in values_table_keys():
        node = VALUES
        for part in key.removesuffix(".*").split("."):
            assert isinstance(node, dict) and part in node, f"docs name value {key!r}, values.yaml has no such key"
            node = node[part]


def test_documented_settings_are_operator_settings():
    row = next(line for line in section("### Values").splitlines() if line.startswith("| `settings`"))
    named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", row))
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert len(named) >= 5 and named <= fields, sorted(named - fields)


def test_paths_in_the_guide_exist():
    paths = set(re.findall(r"(?<![\w/.-])((?:helm|crds|examples|operator|worker|docs|tests)/[\w./-]+\w)", GUIDE))
    assert len(paths) >= 5
    for path in paths:
        assert (REPO / path).exists(), path
    for dockerfile in re.findall(r"Dockerfile\.\w+", GUIDE):
        assert (REPO / dockerfile).exists(), dockerfile


def test_the_guide_names_the_real_finalizer_reasons_and_metrics():
    assert f"`{kopf_settings(Settings()).persistence.finalizer}`" in GUIDE
    operator_code = "".join(p.read_text() for p in (REPO / "operator" / "shard_operator").rglob("*.py"))
    for reason in ("RestartBudgetExhausted", "GroupFailed", "NodeLost", "InsufficientCapacity"):
        assert reason in GUIDE and f'"{reason}"' in operator_code, reason
    for name, (kind, _, _) in FAMILIES.items():
        assert f"`{name}_total" in GUIDE if kind == "counter" else f"`{name}" in GUIDE, name


def test_the_sizing_command_is_the_one_the_tests_run():
    # tests/packaging/test_kubectl.py runs it with an example file against the emulated API.
    assert SIZING_COMMAND in GUIDE


def test_the_log_levels_agree_in_the_operator_the_chart_and_the_guide():
    def accepted(level: str) -> bool:
        try:
            Settings.from_env({"SHARD_OPERATOR_LOG_LEVEL": level})
        except ValueError:
            return False
        return True

    operator = {name.lower() for name in logging.getLevelNamesMapping() if accepted(name)}
    schema = set(json.loads((CHART / "values.schema.json").read_text())["properties"]["logLevel"]["enum"])
    row = next(line for line in section("### Values").splitlines() if line.startswith("| `logLevel`"))
    assert operator == schema == set(re.findall(r"`(\w+)`", row.split("|")[3])) and VALUES["logLevel"] in schema


def code_lines(text: str) -> list[str]:
    """The commands of the indented code blocks: continuation lines joined, comments and
    repeated spaces dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [line.split("  #")[0].strip() for line in joined.splitlines() if line.startswith("    ")]
    return [" ".join(line.split()) for line in lines if line]


def test_the_walkthrough_names_what_the_examples_define():
    from shard_operator.api import load_sharded_models
    from shard_operator.objects.manifests import endpoint_name

    steps = code_lines(section("## From an empty cluster to a served request"))
    (model,) = load_sharded_models(REPO / "examples" / "llama-70b.yaml")
    (job,) = yaml.safe_load_all((REPO / "examples" / "model-store" / "download-llama-70b.yaml").read_text())
    (secret,) = [v["secret"] for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    namespace = model.metadata.namespace
    assert f"kubectl create namespace {namespace}" in steps and job["metadata"]["namespace"] == namespace
    ((label, value),) = model.spec.placement.node_selector.items()
    assert any(s.startswith("kubectl label node") and s.endswith(f" {label}={value}") for s in steps)
    assert any(s.startswith(f"kubectl -n {namespace} create secret generic {secret['secretName']} "
                            f"--from-file={secret['items'][0]['key']}=") for s in steps)
    assert f"kubectl -n {namespace} wait --for=condition=complete job/{job['metadata']['name']} --timeout=4h" in steps
    # The planning step is the one test_kubectl runs against nodes read through the real kubectl.
    assert SIZING_COMMAND.replace("my-model.yaml", "examples/llama-70b.yaml") in steps
    port = model.spec.worker.port
    assert f"kubectl -n {namespace} port-forward svc/{endpoint_name(model.metadata.name)} {port}:{port} &" in steps


def test_the_readme_cluster_commands_are_the_guides():
    readme = (REPO / "README.md").read_text()
    start = readme.index("## On a Kubernetes GPU cluster")
    commands = code_lines(readme[start:readme.index("\n## ", start)])
    assert len(commands) >= 10
    guide = set(code_lines(GUIDE))
    assert [c for c in commands if c not in guide] == []


def test_the_guide_says_how_grafana_finds_the_dashboard():
    grafana = section("### Grafana")
    (label, value), = VALUES["dashboard"]["labels"].items()
    assert f'`{label}: "{value}"`' in grafana
    assert "grafana.sidecar.dashboards.searchNamespace=ALL" in grafana and "dashboard.namespace" in grafana
