"""The Helm chart: lint, render, and validate every manifest against the Kubernetes schemas."""

from __future__ import annotations

import dataclasses
import re
import tarfile

import kubernetes_validate
import pytest
import yaml

from shard_operator.settings import PREFIX, Settings

from .chart import (
    CHART,
    CUSTOM_VALUES,
    MONITORING_API,
    NAMESPACE,
    REPO,
    find,
    helm,
    one,
    operator_objects,
    render,
    selects,
    template_args,
)

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ["1.28", kubernetes_validate.latest_version()]
# Objects whose schemas are CRDs rather than built-in types: checked elsewhere.
NOT_BUILT_IN = {"monitoring.coreos.com/v1"}


def test_lint_default_and_custom_values(custom_values_file):
    for args in ([], ["--values", str(custom_values_file)]):
        result = helm("lint", "--strict", str(CHART), *args, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_packaged_chart_carries_crd_dashboard_and_schema(tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("shard-operator-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for path in ("crds/shardedmodels.yaml", "dashboards/shard-operator.json", "values.schema.json",
                 "templates/NOTES.txt", "templates/rbac.yaml"):
        assert f"shard-operator/{path}" in names, path


def test_chart_crd_is_the_generated_crd():
    generated = (REPO / "crds" / "shardedmodels.yaml").read_text()
    packaged = (CHART / "crds" / "shardedmodels.yaml").read_text()
    assert packaged == generated, "helm/shard-operator/crds/ is stale: run `make crd`"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_manifest_validates_strictly(rendered, version):
    _, objects = rendered
    checked = 0
    for obj in objects:
        if obj["apiVersion"] in NOT_BUILT_IN:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, err.path))}: {err.message}")
        checked += 1
    assert checked >= 8


def test_default_render_has_the_expected_objects(default_objects):
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                            "Deployment", "Service", "ConfigMap", "NetworkPolicy", "NetworkPolicy"])
    for obj in default_objects:
        if obj["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_pod_monitor_only_when_its_api_exists(custom_values_file):
    without_api = render(custom_values_file)  # asked for, but the Prometheus Operator is absent
    assert not find(without_api, "PodMonitor")
    pod_monitor = one(render(custom_values_file, api_versions=MONITORING_API), "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": CUSTOM_VALUES["watchNamespaces"]}
    assert pod_monitor["spec"]["selector"]["matchExpressions"] == [{"key": "sharding.dev/model", "operator": "Exists"}]


def test_pod_monitor_scrapes_every_rank_of_every_pod_the_operator_builds(custom_values_file):
    """One target per rank: a pod per tensor-parallel group (the example's, on GPUs) serves its
    ranks' /metrics on ports http, http-1, ...; the rendezvous port is no target."""
    pod_monitor = one(render(custom_values_file, api_versions=MONITORING_API), "PodMonitor")
    selector = pod_monitor["spec"]["selector"]
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint and "targetPort" not in endpoint  # a target per container port ...
    (keep,) = endpoint["relabelings"]                               # ... kept by port name
    assert (keep["action"], keep["sourceLabels"]) == ("keep", ["__meta_kubernetes_pod_container_port_name"])
    rank_pods = find(operator_objects(), "Pod")
    assert rank_pods and {p["metadata"]["labels"]["sharding.dev/ranks"] for p in rank_pods} == {"2"}
    for pod in rank_pods:
        assert selects(selector, pod["metadata"]["labels"])
        ports = pod["spec"]["containers"][0]["ports"]
        scraped = [p["containerPort"] for p in ports if re.fullmatch(keep["regex"], p["name"])]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        first = int(env["SHARD_PORT"])
        assert scraped == [first + i for i in range(int(pod["metadata"]["labels"]["sharding.dev/ranks"]))]


@pytest.mark.parametrize("which", ["default", "custom"])
def test_the_metrics_service_and_service_monitor_reach_the_operator_metrics_port(which, custom_values_file):
    objects = render() if which == "default" else render(custom_values_file, api_versions=MONITORING_API)
    pod = one(objects, "Deployment")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    service = one(objects, "Service")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics"
    assert ports["metrics"] == port["port"] == int(env["SHARD_OPERATOR_METRICS_PORT"])
    assert ports["metrics"] == (8081 if which == "default" else CUSTOM_VALUES["metrics"]["port"])
    if which == "custom":
        monitor = one(objects, "ServiceMonitor")
        assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
    else:
        assert not find(objects, "ServiceMonitor")


def test_no_operator_metrics_without_a_port():
    objects = render(sets=["metrics.port=0", "metrics.serviceMonitor.enabled=true"], api_versions=MONITORING_API)
    assert not find(objects, "Service") and not find(objects, "ServiceMonitor")
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["health"]


def test_notes_warn_when_monitors_cannot_be_created(custom_values_file):
    # `helm template` does not print NOTES.txt; `helm install --dry-run` renders it offline.
    out = helm("install", "so", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
               "--values", str(custom_values_file)).stdout
    assert "no PodMonitor was created" in out and "no ServiceMonitor was created" in out
    assert "shardctl plan -f shardedmodel.yaml --nodes <(kubectl get nodes -o yaml)" in out
    # (`helm install` cannot announce extra APIs; with monitors off there is nothing to warn about.)
    quiet = helm("install", "so", str(CHART), "--dry-run=client", "--namespace", NAMESPACE).stdout
    assert "WARNING" not in quiet and "every namespace" in quiet
    assert "grafana.sidecar.dashboards.searchNamespace=ALL" in quiet  # how Grafana finds the dashboard


@pytest.mark.parametrize("bad, complaint", [
    ("settings.standalone=false", "settings"),
    ("settings.Restart-Budget=3", "Restart-Budget"),
    ("image.tag=latest", "image/tag"),
    ("watchNamespaces[0]=Not_A_Namespace", "watchNamespaces"),
    ("networkPolicy.servingPorts[0]=70000", "servingPorts"),
    ("imgae.tag=x", "imgae"),
])
def test_values_schema_rejects_mistakes(bad, complaint):
    result = helm(*template_args(sets=[bad]), check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


def operator_env(objects) -> dict[str, str]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_every_operator_variable_is_a_setting_it_reads(rendered):
    _, objects = rendered
    env = operator_env(objects)
    fields = {f.name for f in dataclasses.fields(Settings)}
    ours = {name for name in env if name.startswith(PREFIX)}
    assert ours and {name.removeprefix(PREFIX).lower() for name in ours} <= fields, ours
    Settings.from_env(env)  # and every value parses


def test_values_reach_the_operator_settings(default_objects, custom_objects):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    default = Settings.from_env(operator_env(default_objects))
    assert default.namespaces == () and default.standalone is True
    assert default.worker_image == f"shard-operator-worker:{chart['appVersion']}"
    custom = Settings.from_env(operator_env(custom_objects))
    assert custom.namespaces == ("inference", "research")
    assert custom.worker_image == "registry.example/ml/shard-operator-worker:0.1.0-cu128"
    assert (custom.status_poll_seconds, custom.restart_budget, custom.settle_seconds) == (15.0, 5, 0.5)
    assert custom.host_path_prefix == "/host" and custom.health_port == CUSTOM_VALUES["healthPort"]
    overhead = custom.planner_options.runtime_overhead["gpu"]
    assert overhead == 3 * 2**30 != default.planner_options.runtime_overhead["gpu"]
    assert (default.log_level, custom.log_level) == ("INFO", "DEBUG")
    assert (default.metrics_port, custom.metrics_port) == (8081, CUSTOM_VALUES["metrics"]["port"])
    assert default.network_policies is True


def test_the_default_allow_lists_admit_the_chart_s_worker_and_the_examples_and_refuse_the_rest(default_objects):
    """allow.* (docs/operations.md, Trust model): the default worker image, the examples' hostPath
    and an API key Secret pass; another image, the node's root and another Secret are refused."""
    from shard_operator.api import load_sharded_models
    from shard_operator.policy import refusals

    settings = Settings.from_env(operator_env(default_objects))
    lists = (settings.allowed_images, settings.allowed_host_paths, settings.allowed_api_key_secrets)
    for example in ("examples/shardedmodel.yaml", "examples/dev-cluster/shardedmodel.yaml"):
        (model,) = load_sharded_models(CHART.parent.parent / example)
        assert refusals(model.spec, settings.worker_image, *lists) == [], example
    spec = load_sharded_models(CHART.parent.parent / "examples/shardedmodel.yaml")[0].spec
    hostile = spec.model_copy(update={"model": spec.model.model_copy(update={
        "volume": spec.model.volume.model_copy(update={"host_path": spec.model.volume.host_path.model_copy(
            update={"path": "/"})})})})
    reasons = refusals(hostile, "evil.example/miner:1", *lists)
    assert len(reasons) == 2 and "evil.example/miner:1" in reasons[0] and "hostPath '/'" in reasons[1]


def test_images_follow_the_values(default_objects, custom_objects):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    deployment = one(default_objects, "Deployment")["spec"]["template"]["spec"]
    assert deployment["containers"][0]["image"] == f"shard-operator:{chart['appVersion']}"
    custom = one(custom_objects, "Deployment")["spec"]["template"]["spec"]
    assert custom["containers"][0]["image"] == "registry.example/ml/shard-operator@sha256:" + "ab" * 32
    assert custom["containers"][0]["imagePullPolicy"] == "Always"
    assert custom["imagePullSecrets"] == [{"name": "registry"}]


def test_operator_pod_is_locked_down(rendered):
    _, objects = rendered
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    # The probes reach the liveness endpoint on the port the operator is told to serve it on.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    health_port = Settings.from_env(operator_env(objects)).health_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ports["health"] == health_port
