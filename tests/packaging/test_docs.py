"""docs/operations.md says what the chart, the operator and the workers really do."""

from __future__ import annotations

import dataclasses
import re

import yaml

from shard_operator.handlers import kopf_settings
from shard_operator.settings import Settings
from shard_worker.metrics import FAMILIES

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
    operator_code = "".join(p.read_text() for p in (REPO / "operator" / "shard_operator").glob("*.py"))
    for reason in ("RestartBudgetExhausted", "GroupFailed", "NodeLost", "InsufficientCapacity"):
        assert reason in GUIDE and f'"{reason}"' in operator_code, reason
    for name, (kind, _, _) in FAMILIES.items():
        assert f"`{name}_total" in GUIDE if kind == "counter" else f"`{name}" in GUIDE, name


def test_the_sizing_command_is_the_one_the_tests_run():
    # tests/packaging/test_kubectl.py runs it with an example file against the emulated API.
    assert SIZING_COMMAND in GUIDE
