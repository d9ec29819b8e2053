"""The real kubectl against an emulated Kubernetes API (shard_devcluster.apiserver) on loopback:
the rendered chart applies, re-applies without changes, the examples apply, and the guide's
sizing command works end to end."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
    assert len(lines) == count and all(line.endswith(("(dry run)", "(server dry run)"))
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
    # The ShardedModel examples (nodes.yaml describes a node pool for `shardctl plan`, not something to
    # apply); local-demo.yaml is `shardctl run`'s, whose path leads out of its directory ('..'), which
    # the CRD's pattern refuses, as the file says.
    files = sorted(p for p in EXAMPLES.glob("*.yaml") if "kind: ShardedModel" in p.read_text())
    local = EXAMPLES / "local-demo.yaml"
    files.remove(local)
    assert len(files) >= 3
    proc = await asyncio.create_subprocess_exec(str(binary("kubectl")), "apply", "-f", str(local), env=kubectl.env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    refused = (await proc.communicate())[0].decode()
    assert proc.returncode == 1 and 'The ShardedModel "demo" is invalid: spec.model.path: Invalid value: ' \
        '"../.cache/demo-model"' in refused, refused
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


@pytest.mark.parametrize("dry_run", ["client", "server"])
async def test_the_model_store_and_the_70b_example_apply_with_dry_run(cluster, tmp_path, dry_run):
    """The guide's GPU walkthrough: the model store's PVC and download Job, the 70B ShardedModel,
    and every object the operator would create for it (`shardctl manifests`)."""
    emulator, kubectl = cluster
    emulator.add_crd(yaml.safe_load((CHART / "crds" / "shardedmodels.yaml").read_text()))
    await create_namespace(kubectl, "inference")
    rendered = tmp_path / "llama-70b-objects.yaml"
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("shardctl")), "manifests", "-f", "examples/llama-70b.yaml",
        "--nodes", "examples/nodes.yaml", cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    rendered.write_bytes(out)
    files = [*sorted((EXAMPLES / "model-store").glob("*.yaml")), EXAMPLES / "llama-70b.yaml", rendered]
    count = sum(1 for path in files for doc in yaml.safe_load_all(path.read_text()) if doc)
    applied = await kubectl("apply", f"--dry-run={dry_run}", *[arg for path in files for arg in ("-f", str(path))])
    lines = applied.strip().splitlines()
    assert len(lines) == count and all(line.endswith("dry run)") for line in lines), applied
    assert "job.batch/download-llama-70b created" in applied and "persistentvolumeclaim/model-store created" in applied


def installed_closure(names: list[str]) -> set[str]:
    """The distributions `names` need, themselves included, as this environment has them installed
    (requirements without an extra marker, whose markers hold here)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def bare_environment(tmp_path: Path) -> Path:
    """A new virtual environment holding only shard-operator as `pip install` builds it from the
    repository's tracked files (what `pip install git+URL` or `pip install ./` does), with no
    extra: its base dependencies are linked in from this environment, and nothing else is there."""
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = [Requirement(r).name for r in project["dependencies"]]
    for name in installed_closure(base):
        dist = importlib.metadata.distribution(name)
        for file in dist.files or []:
            if file.parts[0] != ".." and Path(dist.locate_file(file)).is_file():
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                (site / file).symlink_to(dist.locate_file(file))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("shard_operator-*.whl")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return venv


@pytest.mark.slow
async def test_the_notes_shardctl_commands_work_with_shardctl_installed_without_extras(cluster, tmp_path):
    """What the chart's NOTES tell users to run, with shardctl from a plain `pip install` of the
    repository (no extra: no torch, no Kubernetes client) in a directory of the user's own,
    against nodes that the real kubectl reads from the API."""
    emulator, kubectl = cluster
    venv = bare_environment(tmp_path)  # slow: a pip install
    # The nodes come after it: no kubelet posts their status, so the node controller turns them
    # Unknown 40 s after their creation, as a real one would (node-monitor-grace-period).
    for node in yaml.safe_load((EXAMPLES / "nodes.yaml").read_text())["items"]:
        await emulator.k8s_create("v1/nodes", None, node)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLES / "llama-70b.yaml", work / "shardedmodel.yaml")  # its model's config beside it
    shutil.copytree(EXAMPLES / "models" / "llama-3-70b", work / "models" / "llama-3-70b")
    (venv / "bin" / "kubectl").symlink_to(binary("kubectl"))
    notes = helm("install", "so", str(CHART), "--dry-run=client", "--namespace", NAMESPACE).stdout
    commands = [line.strip() for line in notes.splitlines() if line.strip().startswith("shardctl ")]
    assert [c.split()[1] for c in commands] == ["plan", "manifests"]
    env = {**kubectl.env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    outputs = []
    for command in commands:
        proc = await asyncio.create_subprocess_exec("bash", "-c", command, cwd=work, env=env,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, f"{command}: {err.decode()}"
        outputs.append(out.decode())
    plan, manifests = outputs
    assert "ShardedModel llama-70b" in plan and "skipped gpu-l40s-b: cordoned" in plan
    pods = [o for o in yaml.safe_load_all(manifests) if o and o["kind"] == "Pod"]
    assert len(pods) == 2 and {p["spec"]["containers"][0]["image"] for p in pods} == {"shard-operator-worker:0.1.0"}
    # Nothing but the base install was there: no torch, no kopf, no Kubernetes client.
    probe = await asyncio.to_thread(
        subprocess.run, [str(venv / "bin" / "python"), "-c", "import importlib.util as u; print("
                         "[m for m in ('torch', 'kopf', 'kubernetes', 'numpy', 'fastapi') if u.find_spec(m)])"],
        capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"
