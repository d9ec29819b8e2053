"""The pure builders: the objects the operator creates for given plans."""

from __future__ import annotations

import base64
import math
import re

import kubernetes_validate
import pytest

from shard_contract.env import API_KEY_MOUNT, MODEL_MOUNT, PLAN_MOUNT, SECRET_KEY, SECRET_MOUNT, WorkerEnv
from shard_contract.plan import Plan
from shard_contract.units import quantity
from shard_operator import planning as planner
from shard_operator.api import SpecError
from shard_operator.objects.manifests import (
    GROUP_LABEL,
    MODEL_LABEL,
    PLAN_LABEL,
    RANK_LABEL,
    RANKS_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    Context,
    Owner,
    check,
    desired_objects,
    drift_patch,
    group_objects,
    group_revision,
    model_objects,
    pod_name,
    profiling_pod,
)
from shard_operator.objects.names import base_name
from shard_operator.planning.inventory import parse_devices
from tests.operator.conftest import make_plan, make_spec, tiny_profile

OWNER = Owner(name="llama", namespace="serving", uid="uid-1")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def ctx_for(owner=OWNER, **spec):
    return Context(owner=owner, spec=make_spec(**spec), default_image="img:1")


def env_of(pod) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def pods(objects):
    return [o for o in objects if o["kind"] == "Pod"]


@pytest.mark.parametrize("tensor,pipeline,replicas,devices", [
    (1, 1, 1, "a:24GiB*1"),
    (2, 1, 2, "a:24GiB*2,b:24GiB*2"),
    (2, 2, 1, "a:24GiB*2,b:24GiB*2"),
    (1, 4, 2, "a:24GiB*4,b:24GiB*4"),
])
def test_one_pod_per_rank_with_the_worker_environment(tensor, pipeline, replicas, devices):
    spec = dict(parallelism={"tensor": tensor, "pipeline": pipeline}, replicas=replicas,
                placement={"podLayout": "perRank"})
    plan = make_plan(devices, **spec)
    ctx = ctx_for(**spec)
    objects = desired_objects(ctx, plan)
    world = tensor * pipeline
    assert len(pods(objects)) == world * replicas
    assert len(objects) == 3 + replicas * (3 + world)  # endpoint, metrics, plan record; svc + cm + secret + pods
    for pod in pods(objects):
        labels = pod["metadata"]["labels"]
        replica, rank = int(labels[GROUP_LABEL]), int(labels[RANK_LABEL])
        rank_plan = plan.rank_plan(replica, rank)
        env = WorkerEnv.from_env(env_of(pod))  # the worker's own parser accepts it
        leader = pod_name("llama", replica, labels[REVISION_LABEL], 0)
        assert (env.rank, env.world_size, env.local_rank) == (rank, world, 0)
        assert (env.tp_size, env.pp_size, env.replica) == (tensor, pipeline, replica)
        assert env.master_addr == f"{leader}.{pod['spec']['subdomain']}.serving.svc"
        assert env.master_port == 29500 and env.port == 8000
        assert env.plan_file == PLAN_MOUNT and env.model_dir == f"{MODEL_MOUNT}/tiny"
        assert env.model_name == "llama"
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [rank_plan.node]
        assert labels[ROLE_LABEL] == ("leader" if rank == 0 else "worker")
        assert labels[PLAN_LABEL] == plan.group_hash(replica)
        assert labels[MODEL_LABEL] == "llama"
        assert pod["metadata"]["ownerReferences"] == [{
            "apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "name": "llama", "uid": "uid-1",
            "controller": True, "blockOwnerDeletion": True}]
        assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "shard_worker"]


@pytest.mark.parametrize("layout, pods_per_group", [("perRank", 2), ("perTensorGroup", 1)])
def test_each_group_has_a_key_of_its_own_in_a_secret_its_pods_mount(layout, pods_per_group):
    spec = dict(replicas=2, placement={"podLayout": layout})
    plan = make_plan("a:24GiB*2,b:24GiB*2", **spec)
    keys = iter([b"0" * 32, b"1" * 32])
    objects = desired_objects(ctx_for(**spec), plan, new_key=lambda: next(keys))
    assert len(pods(objects)) == 2 * pods_per_group
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert [base64.b64decode(s["data"][SECRET_KEY]) for s in secrets.values()] == [b"0" * 32, b"1" * 32]
    for secret in secrets.values():
        assert secret["type"] == "Opaque" and secret["immutable"] is True
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        kubernetes_validate.validate(secret, "1.33", strict=True)
    for pod in pods(objects):
        group = pod["spec"]["subdomain"]
        assert objects.index(secrets[group]) < objects.index(pod)  # created before the pods that mount it
        assert secrets[group]["metadata"]["labels"][GROUP_LABEL] == pod["metadata"]["labels"][GROUP_LABEL]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["group-key"] == {"name": "group-key", "secret": {"secretName": group, "defaultMode": 0o444}}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["group-key"] == {"name": "group-key", "mountPath": SECRET_MOUNT, "readOnly": True}
        env = pod["spec"]["containers"][0]["env"]
        assert env_of(pod)["SHARD_GROUP_SECRET_FILE"] == f"{SECRET_MOUNT}/{SECRET_KEY}"
        # Rank 0's store binds the pod's own address, which the downward API gives it.
        assert {"name": "SHARD_BIND_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env


@pytest.mark.parametrize("tensor,pipeline,replicas,devices,layout", [
    (2, 1, 1, "a:24GiB*2", "auto"),  # GPUs at tensor > 1: a pod per tensor-parallel group
    (2, 2, 2, "a:24GiB*4,b:24GiB*4", "perTensorGroup"),
    (4, 1, 1, "a:24GiB*4", "perTensorGroup"),
])
def test_one_pod_per_tensor_parallel_group_runs_a_rank_per_gpu(tensor, pipeline, replicas, devices, layout):
    spec = dict(parallelism={"tensor": tensor, "pipeline": pipeline}, replicas=replicas,
                placement={"podLayout": layout})
    plan = make_plan(devices, **spec)
    objects = desired_objects(ctx_for(**spec), plan)
    assert len(pods(objects)) == pipeline * replicas
    for pod in pods(objects):
        labels, c = pod["metadata"]["labels"], pod["spec"]["containers"][0]
        replica, first = int(labels[GROUP_LABEL]), int(labels[RANK_LABEL])
        held = [plan.rank_plan(replica, r) for r in range(first, first + tensor)]
        assert first % tensor == 0 and labels[RANKS_LABEL] == str(tensor)
        assert {r.stage for r in held} == {first // tensor} and len({r.node for r in held}) == 1
        assert labels[ROLE_LABEL] == ("leader" if first == 0 else "worker")
        assert c["command"] == ["python", "-m", "shard_worker.launch", "--local-ranks", str(tensor)]
        env = WorkerEnv.from_env(env_of(pod))  # the pod's first rank; the launcher derives the others
        assert (env.rank, env.local_rank, env.port) == (first, 0, 8000)
        leader = pod_name('llama', replica, labels[REVISION_LABEL], 0)
        assert env.master_addr == f"{leader}.{pod['spec']['subdomain']}.serving.svc"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == str(tensor)
        assert [p["containerPort"] for p in c["ports"] if p["name"].startswith("http")] == \
            [8000 + i for i in range(tensor)]
        assert c["livenessProbe"]["httpGet"]["port"] == "http"  # the first rank answers for the group
        assert pod["metadata"]["annotations"]["sharding.dev/device"] == ",".join(r.device for r in held)
        dshm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{tensor * 1024}Mi"}
        kubernetes_validate.validate(pod, "1.33", strict=True)


def test_the_pod_layout_is_part_of_the_revision():
    per_rank = dict(placement={"podLayout": "perRank"})
    plan = make_plan(**per_rank)
    assert group_revision(ctx_for(**per_rank), plan, 0) != group_revision(ctx_for(), plan, 0)


def test_tensor_parallel_peers_share_a_node_and_groups_spread():
    plan = make_plan("a:24GiB*2,b:24GiB*2", replicas=2)
    nodes = {}
    for pod in pods(desired_objects(ctx_for(replicas=2), plan)):
        node = pod["metadata"]["annotations"]["sharding.dev/node"]
        nodes.setdefault(pod["metadata"]["labels"][GROUP_LABEL], set()).add(node)
    assert all(len(n) == 1 for n in nodes.values())  # TP peers on one node
    assert nodes["0"] != nodes["1"]  # replicas spread


def test_pod_resources_probes_security_and_volumes():
    spec = dict(worker={"resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
                        "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}], "port": 9000},
                placement={"gpuResource": "amd.com/gpu", "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    ctx = ctx_for(**spec)
    pod = pods(desired_objects(ctx, make_plan(**spec)))[0]
    c = pod["spec"]["containers"][0]
    # a pod of the tensor=2 group (GPUs): the spec's resources are per rank
    assert c["resources"] == {"requests": {"cpu": "8", "memory": "32Gi", "amd.com/gpu": "2"},
                              "limits": {"memory": "32Gi", "amd.com/gpu": "2"}}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert {"name": "http", "containerPort": 9000, "protocol": "TCP"} in c["ports"]
    assert env_of(pod)["NCCL_SOCKET_IFNAME"] == "eth0" and env_of(pod)["SHARD_PORT"] == "9000"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The spec's tolerations, then the GPU resource's own taint (as ExtendedResourceToleration adds it)
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"},
                                          {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["spec"]["restartPolicy"] == "Never"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"] == {"name": "model", "hostPath": {"path": "/models", "type": "Directory"}}
    assert volumes["plan"]["configMap"]["name"] == pod["spec"]["subdomain"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"]["readOnly"] and mounts["plan"]["mountPath"] + "/plan.json" == PLAN_MOUNT


@pytest.mark.parametrize("resources", [{}, {"requests": {"cpu": "4", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}])
@pytest.mark.parametrize("host_memory", [None, "1B"])  # host copies; the files (through a bounce buffer)
def test_a_streaming_rank_asks_for_the_host_memory_of_what_it_streams_on_top(resources, host_memory):
    """On top of the default request, or of the spec's request and limit (which cannot know it)."""
    offload = {"policy": "always", **({"hostMemory": host_memory} if host_memory else {})}
    spec = dict(parallelism={"tensor": 1, "pipeline": 2}, placement={"offload": offload},
                worker={"resources": resources})
    plan = make_plan("a:24GiB*2", **spec)
    resident = plan.model_copy(update={"ranks": [r.model_copy(update={"offload": None}) for r in plan.ranks]})
    ctx = ctx_for(**spec)
    for streaming, holding, rank in zip(pods(desired_objects(ctx, plan)), pods(desired_objects(ctx, resident)),
                                        plan.ranks, strict=False):
        host = rank.offload.host_bytes
        assert host >= rank.offload.streamed_bytes > 0
        got, without = (p["spec"]["containers"][0]["resources"] for p in (streaming, holding))
        for kind in ("requests", "limits") if "limits" in resources else ("requests",):
            extra = quantity(got[kind]["memory"]) - quantity(without[kind]["memory"])
            assert host <= extra < host + 2**20, (kind, extra, host)  # rounded up to MiB
            assert {k: v for k, v in got[kind].items() if k != "memory"} == \
                {k: v for k, v in without[kind].items() if k != "memory"}
        assert "memory" not in got["limits"] or "limits" in resources  # no limit of its own


def test_the_api_key_secret_is_mounted_into_each_leader_only():
    """The kubelet mounts the Secret: the operator neither reads it nor may (no secrets in its
    RBAC). Only rank 0 serves the OpenAI routes."""
    spec = dict(parallelism={"tensor": 2, "pipeline": 1}, replicas=2, placement={"podLayout": "perRank"},
                worker={"apiKeySecret": {"name": "llama-api", "key": "token"}})
    ranks = pods(desired_objects(ctx_for(**spec), make_plan("a:24GiB*2,b:24GiB*2", **spec)))
    for pod in ranks:
        c = pod["spec"]["containers"][0]
        if pod["metadata"]["labels"][RANK_LABEL] == "0":
            assert env_of(pod)["SHARD_API_KEY_FILE"] == API_KEY_MOUNT
            assert {"name": "api-key", "secret": {"secretName": "llama-api", "items": [
                {"key": "token", "path": API_KEY_MOUNT.rsplit("/", 1)[1]}]}} in pod["spec"]["volumes"]
            assert {"name": "api-key", "mountPath": API_KEY_MOUNT.rsplit("/", 1)[0], "readOnly": True} \
                in c["volumeMounts"]
        else:
            assert "SHARD_API_KEY_FILE" not in env_of(pod)
            assert "api-key" not in {v["name"] for v in pod["spec"]["volumes"]}
        kubernetes_validate.validate(pod, "1.33", strict=True)
    assert not any(p["metadata"]["labels"][RANK_LABEL] == "0" and "SHARD_API_KEY_FILE" in env_of(p)
                   for p in pods(desired_objects(ctx_for(), make_plan())))


def test_a_pod_per_tensor_group_gives_every_rank_the_group_key_and_rank_0s_pod_the_api_key():
    """A pod of several ranks: each rank process reads the group key; the pod holding rank 0 (the
    leader pod) also mounts the API key, and its SHARD_BIND_ADDR (the pod IP) is the address
    MASTER_ADDR names, the pod's own DNS name, so rank 0's store is reachable by the pod's other
    ranks and the other pods' alike. The launcher hands the pod's environment to each rank."""
    spec = dict(parallelism={"tensor": 2, "pipeline": 2}, placement={"podLayout": "perTensorGroup"},
                worker={"apiKeySecret": {"name": "llama-api", "key": "token"}})
    objects = desired_objects(ctx_for(**spec), make_plan("a:24GiB*2,b:24GiB*2", **spec))
    leader, other = sorted(pods(objects), key=lambda p: int(p["metadata"]["labels"][RANK_LABEL]))
    assert [p["metadata"]["labels"][RANK_LABEL] for p in (leader, other)] == ["0", "2"]
    for pod in (leader, other):
        c = pod["spec"]["containers"][0]
        env = WorkerEnv.from_env(env_of(pod))
        assert c["command"][-2:] == ["--local-ranks", "2"]
        assert env.group_secret_file == f"{SECRET_MOUNT}/{SECRET_KEY}"
        assert {"name": "group-key", "mountPath": SECRET_MOUNT, "readOnly": True} in c["volumeMounts"]
        assert {"name": "SHARD_BIND_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
        assert env.master_addr == f"{leader['spec']['hostname']}.{leader['spec']['subdomain']}.serving.svc"
        kubernetes_validate.validate(pod, "1.33", strict=True)
    assert WorkerEnv.from_env(env_of(leader)).api_key_file == API_KEY_MOUNT
    assert "api-key" in {m["name"] for m in leader["spec"]["containers"][0]["volumeMounts"]}
    assert "SHARD_API_KEY_FILE" not in env_of(other)
    assert "api-key" not in {v["name"] for v in other["spec"]["volumes"]}


@pytest.mark.parametrize("devices, kind, layout, ranks, cpu", [
    ("a:24GiB*2", "gpu", "perRank", 1, "2"),
    ("a:24GiB*2", "gpu", "perTensorGroup", 2, "4"),
    ("a:1GiB*2", "cpu", "perRank", 1, "1"),
    ("a:1GiB*2", "cpu", "perTensorGroup", 2, "2"),
])
def test_rank_pods_request_cpu_and_memory_sized_from_the_plan(devices, kind, layout, ranks, cpu):
    """Not BestEffort: a GPU rank asks for the host memory of its process (2 GiB), a CPU rank also
    for everything its plan predicts (it is host memory), each with 25% headroom; no limits."""
    spec = dict(placement={"podLayout": layout})
    plan = plan_on(devices, kind, **spec)
    pod = pods(desired_objects(ctx_for(**spec), plan))[0]
    resources = pod["spec"]["containers"][0]["resources"]
    held = [plan.rank_plan(0, r) for r in range(ranks)]
    host = [2 * 2**30 if kind == "gpu" else 512 * 2**20 + r.predicted_bytes.total for r in held]
    assert resources["requests"] == {"cpu": cpu, "memory": f"{math.ceil(sum(h * 1.25 for h in host) / 2**20)}Mi",
                                     "nvidia.com/gpu": str(ranks)}
    assert resources["limits"] == {"nvidia.com/gpu": str(ranks)}


def plan_on(devices: str, kind: str, **spec):
    return planner.plan(tiny_profile(), make_spec(**spec), parse_devices(devices, kind=kind))


@pytest.mark.parametrize("quantity, n, scaled", [
    ("4", 2, "8"), ("500m", 2, "1000m"), ("1.5", 2, "3"), ("16Gi", 4, "64Gi"), ("16G", 2, "32G"),
    ("1e3", 2, "2e3"), ("0.5Gi", 1, "0.5Gi"), (".5", 2, "1"),
])
def test_per_rank_quantities_scale_to_the_pods_ranks(quantity, n, scaled):
    from shard_operator.objects.resources import times

    assert times(quantity, n, "f") == scaled


@pytest.mark.parametrize("quantity", ["-1", "lots", "1.5.2Gi", "", "16GB"])  # 16GB: the API server refuses it
def test_a_quantity_that_cannot_scale_is_refused_with_the_field(quantity):
    with pytest.raises(SpecError, match=r"spec.worker.resources.requests.memory: .* is not a quantity"):
        check(ctx_for(worker={"resources": {"requests": {"memory": quantity}}}))


def test_runtime_class_name_is_set_on_rank_pods_when_given():
    plan = make_plan()
    assert "runtimeClassName" not in pods(desired_objects(ctx_for(), plan))[0]["spec"]
    spec = dict(worker={"runtimeClassName": "nvidia"})
    for pod in pods(desired_objects(ctx_for(**spec), plan)):
        assert pod["spec"]["runtimeClassName"] == "nvidia"
    assert group_revision(ctx_for(**spec), plan, 0) != group_revision(ctx_for(), plan, 0)


ADMIN = {"imagePullSecrets": [{"name": "registry"}], "serviceAccountName": "llm-workers",
         "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net", "sidecar.istio.io/inject": "false"},
         "podLabels": {"cost-center": "ml-42"}, "priorityClassName": "inference-high",
         "capabilities": ["IPC_LOCK"], "resources": {"requests": {"rdma/hca_shared_devices_a": "1"}},
         "nccl": {"socketIfname": "eth0", "ibHca": "mlx5_0,mlx5_1", "debug": "WARN"}}


def test_what_a_cluster_admin_sets_reaches_every_pod_of_the_worker_image():
    """Pull secrets, service account, priority, labels and annotations on rank and profiling pods;
    the capability and the RDMA device on rank pods (in limits too: not overcommittable), NCCL's
    settings in their environment; and all of it in the revision."""
    spec = dict(worker=ADMIN)
    ctx = ctx_for(**spec)
    plan = make_plan(**spec)
    for pod in [*pods(desired_objects(ctx, plan)), profiling_pod(ctx, 60)]:
        assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
        assert (pod["spec"]["serviceAccountName"], pod["spec"]["priorityClassName"]) == ("llm-workers",
                                                                                        "inference-high")
        assert pod["spec"]["automountServiceAccountToken"] is False  # the account's token stays out
        assert pod["metadata"]["labels"]["cost-center"] == "ml-42" and pod["metadata"]["labels"][MODEL_LABEL] == "llama"
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    for pod in pods(desired_objects(ctx, plan)):
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        resources = container["resources"]
        ranks = pod["metadata"]["labels"][RANKS_LABEL]  # per rank, as every spec.worker.resources
        rdma = "rdma/hca_shared_devices_a"
        assert resources["requests"][rdma] == resources["limits"][rdma] == ranks
        env = env_of(pod)
        assert (env["NCCL_SOCKET_IFNAME"], env["NCCL_IB_HCA"], env["NCCL_DEBUG"]) == ("eth0", "mlx5_0,mlx5_1", "WARN")
    assert "capabilities" not in profiling_pod(ctx, 60)["spec"]["containers"][0]["securityContext"] or \
        "add" not in profiling_pod(ctx, 60)["spec"]["containers"][0]["securityContext"]["capabilities"]
    assert group_revision(ctx, plan, 0) != group_revision(ctx_for(), plan, 0)
    kubernetes_validate.validate(pods(desired_objects(ctx, plan))[0], "1.33", strict=True)
    kubernetes_validate.validate(profiling_pod(ctx, 60), "1.33", strict=True)


@pytest.mark.parametrize("devices, requests, kind, threads", [
    ("a:24GiB*2", {}, "gpu", "2"),                  # a GPU rank asks for 2 CPUs by default
    ("a:24GiB*2", {"cpu": "6"}, "gpu", "6"),
    ("a:24GiB*2", {"cpu": "500m"}, "gpu", "1"),     # at least one
    ("a:24GiB*2", {}, "cpu", "1"),                  # a CPU rank computes on its core
])
def test_every_rank_gets_its_threads_and_gpus_their_device_order_and_nccl_policy(devices, requests, kind, threads):
    spec = dict(worker={"resources": {"requests": requests}})
    plan = planner.plan(tiny_profile(), make_spec(**spec), parse_devices(devices, kind=kind))
    for pod in pods(desired_objects(ctx_for(**spec), plan)):
        env = env_of(pod)
        assert env["OMP_NUM_THREADS"] == threads  # per rank: a pod's launcher gives it to each of its ranks
        gpu = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_NVLS_ENABLE": "0"}
        assert {k: env.get(k) for k in gpu} == (gpu if kind == "gpu" else {k: None for k in gpu})


def test_the_spec_env_may_replace_the_defaults_but_not_what_the_planner_budgets():
    spec = dict(worker={"env": [{"name": "OMP_NUM_THREADS", "value": "3"}]})
    (pod, *_) = pods(desired_objects(ctx_for(**spec), make_plan(**spec)))
    assert [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "OMP_NUM_THREADS"] == ["3"]
    with pytest.raises(SpecError, match=r"NCCL_NVLS_ENABLE set by the operator .* spec\.worker\.nccl"):
        check(ctx_for(worker={"env": [{"name": "NCCL_NVLS_ENABLE", "value": "1"}]}))
    with pytest.raises(SpecError, match="NCCL_SOCKET_IFNAME set by the operator"):
        check(ctx_for(worker={"env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth1"}],
                              "nccl": {"socketIfname": "eth0"}}))
    check(ctx_for(worker={"env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth1"}]}))  # without the field: fine


def added_overhead(plan, baseline):
    """Each rank's overhead beyond the same rank's in `baseline` (a plan of the same shape)."""
    return [r.predicted_bytes.overhead - b.predicted_bytes.overhead
            for r, b in zip(plan.ranks, baseline.ranks, strict=True)]


def test_nvls_on_is_in_the_environment_and_budgeted_by_the_planner():
    off, on = make_plan(), make_plan(worker={"nccl": {"nvls": True}})
    # tensor=2 x pipeline=1: one communicator (the group's, which is its tensor-parallel group)
    assert added_overhead(on, off) == [300 * 2**20] * 2
    assert on.nvls and not off.nvls
    (pod, *_) = pods(desired_objects(ctx_for(worker={"nccl": {"nvls": True}}), on))
    assert env_of(pod)["NCCL_NVLS_ENABLE"] == "1"
    two_stages = make_plan("a:24GiB*2,b:24GiB*2", parallelism={"tensor": 2, "pipeline": 2},
                           worker={"nccl": {"nvls": True}})
    flat = make_plan("a:24GiB*2,b:24GiB*2", parallelism={"tensor": 2, "pipeline": 2})
    assert set(added_overhead(two_stages, flat)) == {600 * 2**20}  # the group's and its stage's tensor-parallel group


def test_on_the_node_network_each_pod_serves_on_its_own_ports():
    spec = dict(parallelism={"tensor": 1, "pipeline": 2}, worker={"hostNetwork": True})
    plan = make_plan("a:24GiB*2", **spec)  # both stages on node a
    leader, follower = pods(desired_objects(ctx_for(**spec), plan))
    for pod, port in ((leader, 8000), (follower, 8001)):
        assert (pod["spec"]["hostNetwork"], pod["spec"]["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
        assert env_of(pod)["SHARD_PORT"] == str(port)
        assert [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http"] == [port]
    assert [p["name"] for p in leader["spec"]["containers"][0]["ports"]] == ["http", "rendezvous"]
    assert [p["name"] for p in follower["spec"]["containers"][0]["ports"]] == ["http"]  # only rank 0 listens there
    with pytest.raises(SpecError, match="rendezvousPort 8001 is one of the serving ports of the group"):
        desired_objects(ctx_for(parallelism={"tensor": 1, "pipeline": 2},
                                worker={"hostNetwork": True, "rendezvousPort": 8001}), plan)


@pytest.mark.parametrize("worker, message", [
    ({"podLabels": {"sharding.dev/group": "9"}}, "sharding.dev/group: sharding.dev/ keys"),
    ({"podAnnotations": {"app.kubernetes.io/managed-by": "me"}}, "are the operator's"),
    ({"podLabels": {"team": "ml platform"}}, "spec.worker.podLabels.team"),
    ({"podAnnotations": {"bad key": "x"}}, "not a label or annotation key"),
    ({"capabilities": ["SYS_ADMIN"]}, "spec.worker.capabilities.0: should be 'IPC_LOCK'"),
    ({"imagePullSecrets": [{"name": "Registry_Creds"}]}, "spec.worker.imagePullSecrets.0.name"),
    ({"nccl": {"socketIfname": "eth0; rm -rf /"}}, "spec.worker.nccl.socketIfname"),
])
def test_pod_template_fields_are_validated(worker, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        make_spec(worker=worker)


@pytest.mark.parametrize("tolerations, expected", [
    ([], [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
    ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],  # given: not twice
     [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
    ([{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
     [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
      {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
])
def test_rank_and_profiling_pods_tolerate_the_gpu_resources_taint(tolerations, expected):
    spec = dict(placement={"tolerations": tolerations})
    ctx = ctx_for(**spec)
    for pod in [*pods(desired_objects(ctx, make_plan(**spec))), profiling_pod(ctx, 60)]:
        assert pod["spec"]["tolerations"] == expected


@pytest.mark.parametrize("model,volume,expected_dir", [
    ({"path": "llama"}, {"pvc": {"claimName": "weights"}},
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ({"path": "llama"}, {"image": {"reference": "reg/llama:1"}},
     {"name": "model", "image": {"reference": "reg/llama:1", "pullPolicy": "IfNotPresent"}}),
    ({"path": "/data/llama"}, None, {"name": "model", "hostPath": {"path": "/data/llama", "type": "Directory"}}),
])
def test_model_volumes(model, volume, expected_dir):
    m = {**model, **({"volume": volume} if volume else {"volume": None})}
    spec = make_spec(model=m)
    ctx = Context(owner=OWNER, spec=spec, default_image="img")
    pod = pods(desired_objects(ctx, make_plan()))[0]
    assert pod["spec"]["volumes"][0] == expected_dir
    assert env_of(pod)["SHARD_MODEL_DIR"] == ("/models" if volume is None else "/models/llama")


@pytest.mark.parametrize("spec,message", [
    ({"model": {"path": "relative/dir", "volume": None}}, "must be absolute"),
    ({"worker": {"env": [{"name": "RANK", "value": "3"}]}}, "RANK set by the operator"),
    ({"worker": {"env": [{"name": "SHARD_GROUP_SECRET_FILE", "value": "/k"}]}}, "SHARD_GROUP_SECRET_FILE set by"),
])
def test_specs_no_pod_can_be_built_from(spec, message):
    with pytest.raises(SpecError, match=message):
        check(Context(owner=OWNER, spec=make_spec(**spec), default_image="img"))


def test_group_configmap_holds_only_its_group():
    plan = make_plan("a:24GiB*2,b:24GiB*2", replicas=2)
    ctx = ctx_for(replicas=2)
    for replica in (0, 1):
        cm = [o for o in group_objects(ctx, plan, replica) if o["kind"] == "ConfigMap"][0]
        mounted = Plan.from_json(cm["data"]["plan.json"])
        assert {r.replica for r in mounted.ranks} == {replica}
        assert mounted.group_hash(replica) == plan.group_hash(replica)
        assert mounted.rank_plan(replica, 1) == plan.rank_plan(replica, 1)


def test_services_select_ready_leaders_and_name_every_rank():
    plan = make_plan()
    ctx = ctx_for()
    endpoint, metrics, record = model_objects(ctx, plan)
    assert endpoint["spec"]["selector"] == {MODEL_LABEL: "llama", ROLE_LABEL: "leader"}
    assert metrics["spec"]["clusterIP"] == "None" and metrics["spec"]["selector"] == {MODEL_LABEL: "llama"}
    assert Plan.from_json(record["data"]["plan.json"]).hash == plan.hash
    service = group_objects(ctx, plan, 0)[0]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == group_objects(ctx, plan, 0)[2]["spec"]["subdomain"]


def test_revision_follows_placement_and_pod_template_only():
    plan = make_plan("a:24GiB*2,b:24GiB*2", replicas=2)
    moved = make_plan("a:24GiB*2,c:24GiB*2", replicas=2)  # group 1 moves to c
    ctx = ctx_for(replicas=2)
    assert group_revision(ctx, plan, 0) == group_revision(ctx, moved, 0)
    assert group_revision(ctx, plan, 1) != group_revision(ctx, moved, 1)
    assert group_revision(ctx, plan, 0) == group_revision(ctx_for(replicas=2), plan, 0)  # stable
    new_image = Context(owner=OWNER, spec=make_spec(replicas=2, worker={"image": "img:2"}), default_image="img:1")
    assert group_revision(new_image, plan, 0) != group_revision(ctx, plan, 0)
    scaled = ctx_for(replicas=5)  # replicas are not part of a group's pods
    assert group_revision(scaled, plan, 0) == group_revision(ctx, plan, 0)


@pytest.mark.parametrize("name", ["llama", "Llama.3.70b", "7b", "a" * 63, "very-long-model-name-" * 10])
def test_names_are_dns_labels(name):
    meta_name = name.lower() if len(name) <= 253 else name
    ctx = Context(owner=Owner(name=meta_name, namespace="ns", uid="u"), spec=make_spec(), default_image="i")
    for obj in desired_objects(ctx, make_plan()):
        if obj["kind"] in ("Pod", "Service"):
            name = obj["metadata"]["name"]
            assert len(name) <= 63 and DNS_LABEL.match(name), name
        assert len(obj["metadata"]["labels"][MODEL_LABEL]) <= 63
    assert base_name("a.b") != base_name("a-b")


def test_manifests_without_an_owner_uid_have_no_owner_references():
    ctx = Context(owner=Owner(name="m", namespace="default"), spec=make_spec(), default_image="i")
    assert all("ownerReferences" not in o["metadata"] for o in desired_objects(ctx, make_plan()))


def test_objects_pass_the_kubernetes_schemas():
    spec = dict(parallelism={"tensor": 2, "pipeline": 2}, replicas=1,
                worker={"resources": {"requests": {"cpu": "2"}}})
    ctx = ctx_for(**spec)
    objects = desired_objects(ctx, make_plan(**spec)) + [profiling_pod(ctx, 600)]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_drift_patch_ignores_server_defaults_and_restores_what_we_own():
    service = model_objects(ctx_for(), make_plan())[0]
    served = {**service, "metadata": {**service["metadata"], "uid": "x", "resourceVersion": "7"},
              "spec": {**service["spec"], "clusterIP": "10.0.0.7", "sessionAffinity": "None"}}
    assert drift_patch(service, served) is None
    edited = {**served, "spec": {**served["spec"], "selector": {"sharding.dev/model": "other"}}}
    assert drift_patch(service, edited) == {"spec": service["spec"]}
    widened = {**served, "spec": {**served["spec"], "selector": {**service["spec"]["selector"], "app": "x"}}}
    assert drift_patch(service, widened) == {"spec": {**service["spec"], "selector": {
        "app": None, **service["spec"]["selector"]}}}
    relabelled = {**served, "metadata": {**served["metadata"], "labels": {"x": "y"}}}
    assert drift_patch(service, relabelled) == {"metadata": {"labels": service["metadata"]["labels"]}}
    record = model_objects(ctx_for(), make_plan())[2]
    stale = {**record, "data": {"plan.json": "{}"}}
    assert drift_patch(record, stale) == {"data": record["data"]}


def test_the_network_policy_opens_the_ranks_ports_to_their_own_model_only():
    ctx = Context(owner=Owner(name="Llama.3", namespace="ns", uid="u"), spec=make_spec(), default_image="i",
                  network_policy=True)
    (policy,) = [o for o in desired_objects(ctx, make_plan()) if o["kind"] == "NetworkPolicy"]
    ranks = {"matchLabels": {MODEL_LABEL: "Llama.3"}}
    assert policy["spec"] == {"podSelector": ranks, "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": ranks}]}]}
    assert DNS_LABEL.match(policy["metadata"]["name"]) and policy["metadata"]["ownerReferences"][0]["uid"] == "u"
    pods = [o for o in desired_objects(ctx, make_plan()) if o["kind"] == "Pod"]
    assert all(o["metadata"]["labels"][MODEL_LABEL] == "Llama.3" for o in pods)
    kubernetes_validate.validate(policy, "1.33", strict=True)
    assert not [o for o in desired_objects(ctx_for(), make_plan()) if o["kind"] == "NetworkPolicy"]
