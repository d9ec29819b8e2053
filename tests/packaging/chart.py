"""Render the Helm chart with the real `helm` binary and read the result (shared by the packaging tests)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from tests.support.k8s_binaries import binary

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "shard-operator"
RELEASE, NAMESPACE = "so", "shard-system"

# Values far from the defaults: a few watched namespaces, operator settings, a model mount,
# monitoring on, restricted serving ports, a digest-pinned image. Rendered with
# the Prometheus Operator's API announced, so the PodMonitor, ServiceMonitor and PrometheusRule appear.
CUSTOM_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/ml/shard-operator", "digest": "sha256:" + "ab" * 32,
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "watchNamespaces": ["inference", "research"],
    "healthPort": 9808,
    "logLevel": "debug",
    "settings": {"status_poll_seconds": 15, "restart_budget": 5, "settle_seconds": 0.5,
                 "host_path_prefix": "/host", "planner_options": '{"runtime_overhead": {"gpu": 3221225472}}'},
    "extraVolumes": [{"name": "models", "hostPath": {"path": "/var/lib/models", "type": "Directory"}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/host/var/lib/models", "readOnly": True}],
    "worker": {"image": {"repository": "registry.example/ml/shard-operator-worker", "tag": "0.1.0-cu128"}},
    "serviceAccount": {"name": "shard-op", "annotations": {"example.com/role": "operator"}},
    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
    "nodeSelector": {"node-role.kubernetes.io/control-plane-workloads": "true"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
    "metrics": {"port": 9090, "podMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prometheus"}},
                "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}, "communicationShare": 0.6}},
    "networkPolicy": {"servingPorts": [8000, 8080],
                      "servingFrom": [
                          {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]},
    "dashboard": {"namespace": "monitoring", "labels": {"grafana_dashboard": "1", "team": "ml"},
                  "annotations": {"grafana_folder": "LLM"}},
}
MONITORING_API = ["monitoring.coreos.com/v1"]
# docs/operations.md's sizing command; test_kubectl runs it against the emulated API.
SIZING_COMMAND = "shardctl plan -f my-model.yaml --nodes <(kubectl get nodes -o yaml)"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary("helm")), *args], capture_output=True, text=True, check=check,
                          timeout=120)


def template_args(values_file: Path | None = None, api_versions: Iterable[str] = (),
                  sets: Iterable[str] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds"]
    if values_file is not None:
        args += ["--values", str(values_file)]
    for api in api_versions:
        args += ["--api-versions", api]
    for s in sets:
        args += ["--set", s]
    return args


def render(values_file: Path | None = None, api_versions: Iterable[str] = (),
           sets: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every object `helm template` renders (the CRD included), parsed."""
    out = helm(*template_args(values_file, api_versions, sets)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def write_values(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a label set."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels,
              "In": labels.get(key) in values, "NotIn": key not in labels or labels[key] not in values}[op]
        if not ok:
            return False
    return True


def operator_objects(example: str = "pipeline-explicit.yaml", model: str = "llama-3-8b",
                     network_policy: bool = True) -> list[dict[str, Any]]:
    """What the operator would create for an example ShardedModel (its checkpoint in a PVC; the
    config of examples/models/<model> stands for it) on examples/nodes.yaml: the same profiler,
    planner and pure builders the operator runs (shard_operator.objects.manifests)."""
    from shard_operator.api import load_sharded_models
    from shard_operator.objects.manifests import Context, Owner, desired_objects
    from shard_operator.planning import plan
    from shard_operator.planning.inventory import inventory_from_nodes, load_nodes
    from shard_operator.planning.profile import profile_model

    path = REPO / "examples" / example
    (sharded,) = load_sharded_models(path)
    profile = profile_model(REPO / "examples" / "models" / model)
    inventory = inventory_from_nodes(load_nodes(REPO / "examples" / "nodes.yaml"), sharded.spec.placement)
    owner = Owner(name=sharded.metadata.name, namespace=sharded.metadata.namespace or NAMESPACE)
    ctx = Context(owner=owner, spec=sharded.spec, default_image="worker:test", network_policy=network_policy)
    return desired_objects(ctx, plan(profile, sharded.spec, inventory))
