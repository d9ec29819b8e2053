"""The rendered chart (default and custom values), the example manifests users apply as they are
(the model store's PVC and download Job) and both Dockerfiles pass checkov's Kubernetes and
Dockerfile policies, but for the checks skipped in checkov.yaml, each with its reason.

checkov runs with every check on, and the test applies the skips itself: that way it also sees
when a skip has become unnecessary. `checkov --config-file tests/packaging/checkov.yaml` by hand
applies the same skips.
"""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from .chart import CUSTOM_VALUES, MONITORING_API, REPO, helm, template_args, write_values
from .scanner import scan

CONFIG = REPO / "tests" / "packaging" / "checkov.yaml"
EXAMPLE_MANIFESTS = REPO / "examples" / "model-store"


def skipped_in_config() -> list[str]:
    return yaml.safe_load(CONFIG.read_text())["skip-check"]


def test_every_skip_is_justified_by_a_comment_above_it():
    lines = CONFIG.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*- CKV", line):
            assert lines[i - 1].strip().startswith("#") and len(lines[i - 1]) > 20, line


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("scan")
    custom = write_values(tmp_path_factory.mktemp("values") / "custom.yaml", CUSTOM_VALUES)
    for name, args in (("default", template_args()), ("custom", template_args(custom, MONITORING_API))):
        helm(*args, "--output-dir", str(root / name))
    shutil.copytree(EXAMPLE_MANIFESTS, root / "examples")
    for dockerfile in ("Dockerfile.operator", "Dockerfile.worker"):
        image = root / "images" / dockerfile.split(".")[1]
        image.mkdir(parents=True)
        shutil.copy(REPO / dockerfile, image / "Dockerfile")
    settings = {k: v for k, v in yaml.safe_load(CONFIG.read_text()).items() if k != "skip-check"}
    config = write_values(tmp_path_factory.mktemp("config") / "checkov.yaml", settings)
    return scan(root, config)


def failures(reports) -> set[tuple[str, str, str]]:
    return {(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"]["failed_checks"]}


@pytest.mark.slow
def test_no_check_fails_but_the_skipped_ones(reports):
    failed = sorted(f for f in failures(reports) if f[0] not in skipped_in_config())
    assert not failed, "\n".join(map(str, failed))


@pytest.mark.slow
def test_both_frameworks_ran_over_every_object(reports):
    by_type = {r["check_type"]: r["summary"] for r in reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}
    assert by_type["kubernetes"]["passed"] > 100 and by_type["dockerfile"]["passed"] > 20
    assert by_type["kubernetes"]["parsing_errors"] == 0 and by_type["dockerfile"]["parsing_errors"] == 0
    scanned = {c["resource"].split(".")[0] for r in reports if r["check_type"] == "kubernetes"
               for c in r["results"]["passed_checks"]}
    assert {"Deployment", "ClusterRole", "Role", "ServiceAccount", "Job"} <= scanned  # (no check reads a PVC)


@pytest.mark.slow
def test_every_skip_is_still_needed(reports):
    """A skip that no longer matches anything should be deleted, not kept 'just in case'."""
    needed = {check for check, _, _ in failures(reports)}
    assert set(skipped_in_config()) <= needed, sorted(set(skipped_in_config()) - needed)
