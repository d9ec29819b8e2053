"""The Kubernetes objects of a ShardedModel, built from its spec and Plan. Pure: no API calls.

Per model: a ClusterIP Service selecting the ready leaders (the inference endpoint), a headless
Service over every rank (metrics scraping), the plan record (a ConfigMap with the current Plan)
and, when enabled, a NetworkPolicy that opens the ranks' ports to the ranks of the same model.
Per group (replica): a headless Service that gives each pod a DNS name, a ConfigMap with the
group's plan, a Secret with the group's key (which seals its ranks' heartbeat records), and the
pods (`transport.pod_layout`): one per rank running `python -m shard_worker`, or one per
tensor-parallel group holding its GPUs and running one rank per GPU through
`python -m shard_worker.launch`; either way configured only by the environment of
`shard_contract.env.WorkerEnv` (the pod's first rank's), the mounted plan and the mounted key.

A group is identified by its replica index and its *revision*: a digest of its placement
(`Plan.group_hash`) and of everything in the pod template. Any change to either gives new pod
names, so a replacement group can run beside the old one while it loads.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shard_contract.env import (
    API_KEY_MOUNT,
    ENV_NAMES,
    LAUNCH_COMMAND,
    MODEL_MOUNT,
    PLAN_MOUNT,
    SECRET_KEY,
    SECRET_MOUNT,
    WORKER_COMMAND,
    WorkerEnv,
    new_group_key,
)
from shard_contract.plan import Plan

from ..api import API_VERSION, KIND, ShardedModelSpec, SpecError
from ..planning.transport import pod_layout, pod_ranks
from . import podtemplate, resources
from .names import (  # also the names the manifests' callers import from here
    _digest,
    endpoint_name,
    group_name,
    metrics_name,
    model_label,
    network_policy_name,
    plan_record_name,
    pod_name,
    profile_name,
)

MODEL_LABEL = "sharding.dev/model"
GROUP_LABEL = "sharding.dev/group"
RANK_LABEL = "sharding.dev/rank"  # the pod's first rank
RANKS_LABEL = "sharding.dev/ranks"  # how many ranks the pod runs: RANK_LABEL, RANK_LABEL + 1, ...
ROLE_LABEL = "sharding.dev/role"
PLAN_LABEL = "sharding.dev/plan"
REVISION_LABEL = "sharding.dev/revision"
COMPONENT_LABEL = "sharding.dev/component"
NODE_ANNOTATION = "sharding.dev/node"
DEVICE_ANNOTATION = "sharding.dev/device"
SOURCE_ANNOTATION = "sharding.dev/model-source"
MANAGED_BY = {"app.kubernetes.io/managed-by": "shard-operator"}

PLAN_KEY = "plan.json"
SPEC_KEY = "spec.json"  # in the plan record: the spec the plan was made for (the last one accepted)
PROFILE_KEY = "profile.json"
PROFILER_COMMAND = ["python", "-m", "shard_contract.checkpoint"]
CONTAINER = "worker"
# A rank loads its weights only after the whole group has met; a 70B checkpoint can take many
# minutes to read, so the startup probe allows the rendezvous timeout plus this long.
LOAD_ALLOWANCE_SECONDS = 3600


# ---------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Owner:
    """The ShardedModel every object belongs to. uid "" leaves ownerReferences out (shardctl)."""

    name: str
    namespace: str
    uid: str = ""

    @classmethod
    def of(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid") or "")

    def meta(self, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                "labels": {**MANAGED_BY, MODEL_LABEL: model_label(self.name), **labels}}
        if annotations:
            meta["annotations"] = annotations
        if self.uid:
            meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": self.name,
                                        "uid": self.uid, "controller": True, "blockOwnerDeletion": True}]
        return meta


@dataclass(frozen=True)
class Context:
    """Everything the builders need besides the plan."""

    owner: Owner
    spec: ShardedModelSpec
    default_image: str
    network_policy: bool = False  # Settings.network_policies

    @property
    def image(self) -> str:
        return self.spec.worker.image or self.default_image


def model_source(spec: ShardedModelSpec) -> str:
    """Where the checkpoint lives, as one string (the profile cache key)."""
    return json.dumps({"path": spec.model.path,
                       "volume": spec.model.volume.dump() if spec.model.volume else None}, sort_keys=True)


def template_digest(ctx: Context) -> str:
    """Everything that shapes a group's pods apart from its placement."""
    spec = ctx.spec
    return _digest(ctx.owner.name, ctx.image, spec.worker.dump(), spec.model.dump(),
                   [t.dump() for t in spec.placement.tolerations], spec.placement.gpu_resource,
                   spec.placement.pod_layout, n=16)


def group_revision(ctx: Context, plan: Plan, replica: int) -> str:
    return _digest(plan.group_hash(replica), template_digest(ctx))


def group_plan(plan: Plan, replica: int) -> Plan:
    """The Plan a group's pods mount: only that group, so it changes exactly with the group."""
    return plan.model_copy(update={
        "groups": [g for g in plan.groups if g.replica == replica],
        "ranks": plan.group(replica)})


# ---------------------------------------------------------------- per model
def model_objects(ctx: Context, plan: Plan) -> list[dict[str, Any]]:
    """The endpoint Service, the metrics Service, the plan record and, when enabled, the NetworkPolicy."""
    owner, port = ctx.owner, ctx.spec.worker.port
    endpoint = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": owner.meta(endpoint_name(owner.name), {COMPONENT_LABEL: "endpoint"}),
        "spec": {"type": "ClusterIP",
                 # Only ready leaders get traffic: a replacement group takes over when it is ready.
                 "selector": {MODEL_LABEL: model_label(owner.name), ROLE_LABEL: "leader"},
                 "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }
    metrics = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": owner.meta(metrics_name(owner.name), {COMPONENT_LABEL: "metrics"}),
        "spec": {"clusterIP": "None", "selector": {MODEL_LABEL: model_label(owner.name)},
                 "ports": [{"name": "metrics", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }
    policy = [rank_network_policy(owner)] if ctx.network_policy else []
    return [*policy, endpoint, metrics, plan_record(ctx.owner, plan, ctx.spec)]


def rank_network_policy(owner: Owner) -> dict[str, Any]:
    """Every port of the model's ranks open to the ranks of the same model, in its namespace.

    A rank meets its group on the rendezvous port, then NCCL and gloo connect on ephemeral ports,
    so the rule opens every port, to the model's own ranks only. Policies add up: the serving port
    is opened to clients by the chart's policy for all ranks; nothing else reaches these ports.
    """
    ranks = {"matchLabels": {MODEL_LABEL: model_label(owner.name)}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": owner.meta(network_policy_name(owner.name), {COMPONENT_LABEL: "network"}),
        "spec": {"podSelector": ranks, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": ranks}]}]},
    }


def plan_record(owner: Owner, plan: Plan, spec: ShardedModelSpec) -> dict[str, Any]:
    """The current Plan and the spec it was made for: when the planner refuses a later spec, the
    groups keep running as this one shaped them (same revisions, so nothing restarts)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": owner.meta(plan_record_name(owner.name), {COMPONENT_LABEL: "plan"}),
            "data": {PLAN_KEY: plan.to_json(), SPEC_KEY: json.dumps(spec.dump(), sort_keys=True)}}


# ---------------------------------------------------------------- per group
def group_labels(plan: Plan, replica: int, revision: str) -> dict[str, str]:
    return {GROUP_LABEL: str(replica), REVISION_LABEL: revision, PLAN_LABEL: plan.group_hash(replica)}


def group_objects(ctx: Context, plan: Plan, replica: int) -> list[dict[str, Any]]:
    """The headless Service, the plan ConfigMap and the pods of one group, in creation order."""
    owner, worker = ctx.owner, ctx.spec.worker
    revision = group_revision(ctx, plan, replica)
    name = group_name(owner.name, replica, revision)
    labels = group_labels(plan, replica, revision)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": owner.meta(name, {**labels, COMPONENT_LABEL: "group"}),
        "spec": {"clusterIP": "None",
                 # Ranks must resolve each other before any is ready: readiness needs the group.
                 "publishNotReadyAddresses": True,
                 "selector": {MODEL_LABEL: model_label(owner.name), GROUP_LABEL: str(replica),
                              REVISION_LABEL: revision},
                 "ports": [{"name": "rendezvous", "port": worker.rendezvous_port, "targetPort": "rendezvous",
                            "protocol": "TCP"},
                           {"name": "http", "port": worker.port, "targetPort": "http", "protocol": "TCP"}]},
    }
    config = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": owner.meta(name, {**labels, COMPONENT_LABEL: "group"}),
        "data": {PLAN_KEY: group_plan(plan, replica).to_json()},
    }
    ranks = plan.group(replica)
    layout = pod_layout(ctx.spec.placement.pod_layout, ranks[0].kind, plan.tensor_parallel)
    pods = [rank_pod(ctx, plan, replica, held, revision)
            for held in pod_ranks([r.rank for r in ranks], plan.tensor_parallel, layout)]
    return [service, config, *pods]


def group_secret(owner: Owner, plan: Plan, replica: int, revision: str, key: bytes) -> dict[str, Any]:
    """The Secret holding a group's key, named as the group. Its key is random, so it is created
    with the group's pods and never compared or patched (the operator cannot even read it back)."""
    labels = {**group_labels(plan, replica, revision), COMPONENT_LABEL: "group"}
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": owner.meta(group_name(owner.name, replica, revision), labels),
            "type": "Opaque", "immutable": True, "data": {SECRET_KEY: base64.b64encode(key).decode()}}


def _model_volume(spec: ShardedModelSpec) -> tuple[dict[str, Any], str]:
    """The pod volume holding the checkpoint, and the model directory inside the pod."""
    model = spec.model
    volume = model.volume
    if volume is None:
        if not model.path.startswith("/"):
            raise SpecError(f"spec.model.path {model.path!r}: without spec.model.volume the path must be "
                            "absolute (a directory on every node of the pool)")
        return {"name": "model", "hostPath": {"path": model.path, "type": "Directory"}}, MODEL_MOUNT
    inside = f"{MODEL_MOUNT}/{model.path.strip('/')}"
    if volume.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": volume.pvc.claim_name,
                                                           "readOnly": True}}, inside
    if volume.host_path is not None:
        return {"name": "model", "hostPath": {"path": volume.host_path.path, "type": "Directory"}}, inside
    assert volume.image is not None
    return {"name": "model", "image": {"reference": volume.image.reference,
                                       "pullPolicy": volume.image.pull_policy}}, inside


def _api_key(spec: ShardedModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The leader pod's volume and mount of `spec.worker.apiKeySecret`, if any: the kubelet mounts
    the Secret, so the operator needs no permission to read it."""
    ref = spec.worker.api_key_secret
    if ref is None:
        return [], []
    directory, name = API_KEY_MOUNT.rsplit("/", 1)
    return ([{"name": "api-key", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": name}]}}],
            [{"name": "api-key", "mountPath": directory, "readOnly": True}])


def rank_pod(ctx: Context, plan: Plan, replica: int, ranks: list[int], revision: str) -> dict[str, Any]:
    """The pod of `ranks` (consecutive, on one node): one rank, or a tensor-parallel group."""
    owner, spec, worker = ctx.owner, ctx.spec, ctx.spec.worker
    held = [plan.rank_plan(replica, rank) for rank in ranks]
    rank, rp = ranks[0], held[0]
    group = group_name(owner.name, replica, revision)
    leader = pod_name(owner.name, replica, revision, 0)
    name = pod_name(owner.name, replica, revision, rank)
    volume, model_dir = _model_volume(spec)
    # On the node's network every pod serves on its own ports (port + its first rank), and only
    # the leader pod's rank 0 listens on the rendezvous port.
    port = worker.port + rank if worker.host_network else worker.port
    rendezvous = [{"name": "rendezvous", "containerPort": worker.rendezvous_port, "protocol": "TCP"}] \
        if rank == 0 or not worker.host_network else []
    # Only rank 0 serves the OpenAI routes, so only the pod holding it (the leader pod) gets the
    # API key; every rank reads the group key.
    key_volumes, key_mounts = _api_key(spec) if rank == 0 else ([], [])
    env = WorkerEnv(
        rank=rank, world_size=plan.world_size,
        # The container sees its GPUs as devices 0.. whatever their indices on the node; the
        # launcher gives the pod's i-th rank LOCAL_RANK i (and RANK + i, SHARD_PORT + i).
        local_rank=0,
        master_addr=f"{leader}.{group}.{owner.namespace}.svc", master_port=worker.rendezvous_port,
        tp_size=plan.tensor_parallel, pp_size=plan.pipeline_parallel, replica=replica,
        plan_file=PLAN_MOUNT, model_dir=model_dir, model_name=owner.name, port=port,
        backend=worker.backend, rendezvous_timeout=worker.rendezvous_timeout_seconds,
        group_secret_file=f"{SECRET_MOUNT}/{SECRET_KEY}",
        api_key_file=API_KEY_MOUNT if key_mounts else None,
    ).to_env()
    # Rank 0's store listens on the pod's own address only (the downward API knows it at start,
    # before the group's DNS name of the pod answers); the pod's other ranks ignore it.
    bind = {"name": ENV_NAMES["bind_addr"], "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    serving = plan.world_size if worker.host_network else len(ranks)  # ports one node may see taken
    if worker.rendezvous_port in range(worker.port, worker.port + serving):
        raise SpecError(f"spec.worker.rendezvousPort {worker.rendezvous_port} is one of the serving ports of "
                        f"{'the group on the node network' if worker.host_network else f'a pod of {len(ranks)} ranks'}"
                        f" ({worker.port}-{worker.port + serving - 1}, spec.worker.port + rank)")
    pod_security, container_security = podtemplate.security(worker.capabilities)
    plan_dir = PLAN_MOUNT.rsplit("/", 1)[0]
    http = {"path": "/health", "port": "http"}
    labels = {**group_labels(plan, replica, revision), COMPONENT_LABEL: "rank", RANK_LABEL: str(rank),
              RANKS_LABEL: str(len(ranks)), ROLE_LABEL: "leader" if rank == 0 else "worker"}
    # Every rank serves HTTP on its own port; the pod's probes ask its first rank, which (like
    # any rank) answers for the whole group.
    http_ports = [{"name": "http" if i == 0 else f"http-{i}", "containerPort": port + i, "protocol": "TCP"}
                  for i in range(len(ranks))]
    runtime = {"runtimeClassName": worker.runtime_class_name} if worker.runtime_class_name else {}
    # The node's network; the cluster's DNS still resolves the group's names (MASTER_ADDR).
    network = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"} if worker.host_network else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": owner.meta(name, {**worker.pod_labels, **labels}, {
            **worker.pod_annotations, NODE_ANNOTATION: rp.node, DEVICE_ANNOTATION: ",".join(r.device for r in held)}),
        "spec": {
            **runtime,
            **network,
            **podtemplate.pod_extras(spec),
            "hostname": name,
            "subdomain": group,
            # A broken communicator cannot heal: a failed rank fails its pod, and the operator
            # recreates the whole group.
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,  # workers never call the Kubernetes API
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [rp.node]}]}]}}},
            "tolerations": [t.dump() for t in spec.placement.pod_tolerations],
            "securityContext": pod_security,
            "containers": [{
                "name": CONTAINER,
                "image": ctx.image,
                "imagePullPolicy": worker.image_pull_policy,
                "command": list(WORKER_COMMAND) if len(ranks) == 1 else [*LAUNCH_COMMAND, str(len(ranks))],
                # The tail of a failed rank's log becomes its termination message, which the
                # operator quotes in its Event: the failed pod is deleted with its group.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": [{"name": k, "value": v} for k, v in env.items()] + [bind] + podtemplate.rank_env(spec, held),
                "ports": [*http_ports, *rendezvous],
                "resources": resources.pod_resources(held, worker.resources.requests, worker.resources.limits,
                                                     spec.placement.gpu_resource),
                "startupProbe": {"httpGet": http, "periodSeconds": 10, "failureThreshold": math.ceil(
                    (worker.rendezvous_timeout_seconds + LOAD_ALLOWANCE_SECONDS) / 10)},
                "livenessProbe": {"httpGet": http, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                                   "timeoutSeconds": 5, "failureThreshold": 3},
                "securityContext": container_security,
                "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
                                 {"name": "plan", "mountPath": plan_dir, "readOnly": True},
                                 {"name": "group-key", "mountPath": SECRET_MOUNT, "readOnly": True},
                                 {"name": "dshm", "mountPath": "/dev/shm"},
                                 {"name": "tmp", "mountPath": "/tmp"}] + key_mounts,
            }],
            "volumes": [volume,
                        {"name": "plan", "configMap": {"name": group, "items": [{"key": PLAN_KEY, "path": PLAN_KEY}]}},
                        # Readable by the image's own non-root user (whose uid the pod does not
                        # name); nothing else runs in the container.
                        {"name": "group-key", "secret": {"secretName": group, "defaultMode": 0o444}},
                        # NCCL's shared memory needs more than a container's 64 MiB (resources.py)
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": resources.shm_size(len(ranks))}},
                        {"name": "tmp", "emptyDir": {}}] + key_volumes,
        },
    }


def desired_objects(ctx: Context, plan: Plan, new_key: Callable[[], bytes] = new_group_key) -> list[dict[str, Any]]:
    """Every object of a model whose groups all run `plan` (what `shardctl manifests` prints),
    each group's Secret, with a key from `new_key`, before its pods."""
    objects = model_objects(ctx, plan)
    for group in plan.groups:
        service, config, *pods = group_objects(ctx, plan, group.replica)
        secret = group_secret(ctx.owner, plan, group.replica, group_revision(ctx, plan, group.replica), new_key())
        objects.extend([service, config, secret, *pods])
    return objects


# ---------------------------------------------------------------- profiling
def profiling_pod(ctx: Context, timeout_seconds: int) -> dict[str, Any]:
    """A short pod that prints the model's profile (config.json + safetensors headers) as JSON."""
    owner, spec = ctx.owner, ctx.spec
    volume, model_dir = _model_volume(spec)
    pod_security, container_security = podtemplate.security()
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": owner.meta(profile_name(owner.name), {**spec.worker.pod_labels, COMPONENT_LABEL: "profiler"},
                               {**spec.worker.pod_annotations, SOURCE_ANNOTATION: model_source(spec)}),
        "spec": {
            **podtemplate.pod_extras(spec),
            "restartPolicy": "Never",
            "activeDeadlineSeconds": int(timeout_seconds),
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,  # workers never call the Kubernetes API
            "tolerations": [t.dump() for t in spec.placement.pod_tolerations],
            "nodeSelector": dict(spec.placement.node_selector),
            "securityContext": pod_security,
            "containers": [{
                "name": "profiler", "image": ctx.image, "imagePullPolicy": spec.worker.image_pull_policy,
                "command": [*PROFILER_COMMAND, model_dir],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                "securityContext": container_security,
                "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}],
            }],
            "volumes": [volume],
        },
    }


def profile_record(owner: Owner, source: str, profile_json: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": owner.meta(profile_name(owner.name), {COMPONENT_LABEL: "profile"},
                                   {SOURCE_ANNOTATION: source}),
            "data": {PROFILE_KEY: profile_json}}


# ---------------------------------------------------------------- drift
EXACT = ("selector",)  # maps where an extra key changes the meaning (a selector matching less)


def _covers(actual: Any, desired: Any) -> bool:
    """Does `actual` hold everything `desired` says? Extra server-set fields are fine."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return False
        return all(_covers(actual.get(k), v) if k not in EXACT else actual.get(k) == v for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and \
            all(_covers(a, d) for a, d in zip(actual, desired, strict=False))
    return actual == desired


def drift_patch(desired: dict[str, Any], actual: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch that brings `actual` back to `desired`, or None when nothing we own differs.

    Pods are never patched: anything that shapes them is in their revision, hence in their name.
    """
    patch: dict[str, Any] = {}
    for key in ("labels", "annotations"):
        want = desired["metadata"].get(key) or {}
        if not _covers(actual["metadata"].get(key) or {}, want):
            patch.setdefault("metadata", {})[key] = want
    for key in ("spec", "data"):
        if key in desired and not _covers(actual.get(key), desired[key]):
            patch[key] = dict(desired[key])
            for exact in EXACT:  # a merge patch must remove extra keys explicitly
                extra = set((actual.get(key) or {}).get(exact) or {}) - set(desired[key].get(exact) or {})
                if exact in desired[key] and extra:
                    patch[key][exact] = {**{k: None for k in sorted(extra)}, **desired[key][exact]}
    return patch or None


def check(ctx: Context) -> None:
    """Raise SpecError for a spec no pod could be built from (before anything is created)."""
    _model_volume(ctx.spec)
    podtemplate.check_env(ctx.spec)
    resources.check(ctx.spec.worker.resources.requests, ctx.spec.worker.resources.limits)
