"""The real kubectl against an emulated Kubernetes API (shard_devcluster.apiserver) on loopback:
the rendered chart applies, re-applies without changes, the examples apply, and the guide's
sizing command works end to end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shard_devcluster.apiserver import serve
from tests.support.k8s_binaries import binary

from .chart import CHART, MONITORING_API, NAMESPACE, REPO, SIZING_COMMAND, helm, template_args

EXAMPLES = REPO / "examples"
MONITORING = [("monitoring.coreos.com/v1/podmonitors", "PodMonitor"),
              ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor"),
              ("monitoring.coreos.com/v1/prometheusrules", "PrometheusRule")]


class Kubectl:
    def __init__(self, kubeconfig: Path):
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    async def __call__(self, *args: str, stdin: str | None = None, ok: bool = True) -> str:
        proc = await asyncio.create_subprocess_exec(
            str(binary("kubectl")), *args, env=self.env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), 60)
        if ok:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
        return out.decode()


@pytest.fixture
async def cluster(tmp_path):
    """(emulator, kubectl) with the chart's CRD served and the Prometheus Operator's kinds known."""
    async with serve() as (emulator, url):
        for key, kind in MONITORING:
            emulator.add_custom_resource(key, kind=kind)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulated",
            "clusters": [{"name": "emulated", "cluster": {"server": url}}],
            "users": [{"name": "tester", "user": {"token": "unused"}}],
            "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "tester"}}]}))
        yield emulator, Kubectl(kubeconfig)


def manifest(values_file: Path | None = None) -> tuple[str, int]:
    """`helm template` output (default values, or the custom ones with the monitoring API), and
    how many objects it holds."""
    if values_file is None:
        text = helm(*template_args()).stdout
    else:
        text = helm(*template_args(values_file, api_versions=MONITORING_API)).stdout
    return text, sum(1 for doc in yaml.safe_load_all(text) if doc)


async def create_namespace(kubectl: Kubectl, name: str) -> None:
    # `kubectl create namespace` speaks protobuf, which the emulator does not; apply sends JSON.
    await kubectl("apply", "-f", "-", stdin=f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n")


@pytest.mark.parametrize("rendered", ["default", "custom"])
@pytest.mark.parametrize("dry_run", ["client", "server"])
async def test_helm_template_applies_with_dry_run(cluster, custom_values_file, rendered, dry_run):
    _, kubectl = cluster
    text, count = manifest(custom_values_file if rendered == "custom" else None)
    out = await kubectl("apply", f"--dry-run={dry_run}", "-f", "-", stdin=text)
    lines = out.strip().splitlines()
    assert len(lines) == count and all(line.endswith("(dry run)") or line.endswith("(server dry run)")
                                       for line in lines), out


async def test_install_then_upgrade_with_the_same_values_changes_nothing(cluster):
    _, kubectl = cluster
    text, count = manifest()
    await create_namespace(kubectl, NAMESPACE)
    first = await kubectl("apply", "-f", "-", stdin=text)
    assert first.count(" created") == count, first
    again = await kubectl("apply", "-f", "-", stdin=text)
    assert again.count(" unchanged") == count, again
    role = yaml.safe_load(await kubectl("get", "clusterrole", "so-shard-operator", "-o", "yaml"))
    assert {r for rule in role["rules"] for r in rule["resources"]} >= {"shardedmodels", "pods", "nodes"}


async def test_examples_apply_once_the_crd_is_installed(cluster):
    emulator, kubectl = cluster
    emulator.add_crd(yaml.safe_load((CHART / "crds" / "shardedmodels.yaml").read_text()))
    await create_namespace(kubectl, "inference")
    # The ShardedModel examples (nodes.yaml describes a node pool for `shardctl plan`, not something to apply).
    files = sorted(p for p in EXAMPLES.glob("*.yaml") if "kind: ShardedModel" in p.read_text())
    assert len(files) >= 3
    args = [arg for path in files for arg in ("-f", str(path))]
    out = await kubectl("apply", *args)
    models = await kubectl("get", "shardedmodels", "-A", "-o", "name")
    assert sorted(models.split()) == sorted(
        f"shardedmodel.sharding.dev/{doc['metadata']['name']}" for path in files
        for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "ShardedModel"), out


async def test_sizing_with_shardctl_and_kubectl_get_nodes(cluster, tmp_path):
    """The guide's `shardctl plan --nodes <(kubectl get nodes -o yaml)`, against nodes the kubelets registered."""
    emulator, kubectl = cluster
    for node in yaml.safe_load((EXAMPLES / "nodes.yaml").read_text())["items"]:
        await emulator.k8s_create("v1/nodes", None, node)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "kubectl").symlink_to(binary("kubectl"))
    (bindir / "shardctl").symlink_to(Path(sys.executable).with_name("shardctl"))
    command = SIZING_COMMAND.replace("my-model.yaml", "examples/llama-70b.yaml")
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**kubectl.env, "PATH": f"{bindir}:{os.environ['PATH']}"})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "ShardedModel llama-70b" in text and "gpu-h100-a" in text and "gpu-h100-b" in text
    assert "skipped gpu-l40s-b: cordoned" in text  # the nodes' spec and status came through kubectl
