"""Conformance of the emulated control plane (shard_devcluster/controlplane.py): the scheduler and
the controllers a real cluster runs beside its API server, probed through the API as their real
counterparts are seen; each test says what the real component does. Timings are shortened."""

from __future__ import annotations

import asyncio

import pytest

from shard_devcluster.apiserver import serve
from shard_devcluster.controlplane import ControlPlane
from tests.support.cluster import gpu_node
from tests.support.operator import eventually

PODS, NODES, LEASES = "v1/pods", "v1/nodes", "coordination.k8s.io/v1/leases"
EVENTS, ENDPOINTS, SLICES = "v1/events", "v1/endpoints", "discovery.k8s.io/v1/endpointslices"


@pytest.fixture
async def cluster(request):
    """(emulator, control plane): a node lives 40 s without a heartbeat, or as long as a test asks."""
    grace = getattr(request, "param", 40.0)
    async with serve(control_plane=False) as (emu, _):
        # A quarantine long enough that a busy machine (a test stalled for seconds) still sees the
        # pods it keeps.
        async with ControlPlane(emu, node_monitor_grace=grace, pod_gc_quarantine=8.0) as plane:
            yield emu, plane


def pod(name: str, gpus: int = 1, labels: dict | None = None, **spec) -> dict:
    container = {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
                 "ports": [{"name": "http", "containerPort": 8000}]}
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": {"containers": [container], **spec}}


def pinned(node: str) -> dict:  # the operator's required node affinity
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


async def node_of(emu, name: str) -> str | None:
    return ((await emu.k8s_get(PODS, "default", name)) or {}).get("spec", {}).get("nodeName")


async def scheduled(emu, name: str) -> dict:
    pod = await emu.k8s_get(PODS, "default", name)
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), {})


async def test_the_scheduler_binds_within_affinity_selectors_taints_and_extended_resources(cluster):
    """kube-scheduler binds each unscheduled pod through pods/binding to a node its filters admit --
    NodeUnschedulable, TaintToleration (NoSchedule/NoExecute), NodeAffinity (nodeSelector and
    required node affinity), NodeResourcesFit (extended resources such as nvidia.com/gpu against
    allocatable less what bound pods request) -- with a Scheduled Event; a pod that fits nowhere
    stays Pending with PodScheduled=False, reason Unschedulable and the scheduler's count of reasons
    ("0/3 nodes are available: ..."), and a FailedScheduling Event; it is bound as soon as room
    appears."""
    emu, _ = cluster
    await emu.k8s_create(NODES, None, gpu_node("a", gpus=2, labels={"pool": "x"}))
    await emu.k8s_create(NODES, None, gpu_node("b", gpus=2, labels={"pool": "y"}))
    tainted = gpu_node("c", gpus=2, labels={"pool": "x"})
    tainted["spec"]["taints"] = [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]
    await emu.k8s_create(NODES, None, tainted)
    await emu.k8s_create(PODS, "default", pod("r0", affinity=pinned("a")))
    await emu.k8s_create(PODS, "default", pod("r1", affinity=pinned("a")))
    await emu.k8s_create(PODS, "default", pod("sel", nodeSelector={"pool": "y"}))
    await emu.k8s_create(PODS, "default", pod("tol", nodeSelector={"pool": "x"}, affinity=pinned("c"), tolerations=[
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}]))
    for name, node in (("r0", "a"), ("r1", "a"), ("sel", "b"), ("tol", "c")):
        assert await eventually(lambda: node_of(emu, name)) == node, name
    assert (await scheduled(emu, "r0"))["status"] == "True"

    # No room to surge: a third GPU on node a, and a pod no node tolerates.
    await emu.k8s_create(PODS, "default", pod("surge", affinity=pinned("a")))
    not_a = {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["a"]}]}]}
    await emu.k8s_create(PODS, "default", pod("nowhere", gpus=0, nodeSelector={"pool": "x"},
                                              affinity={"nodeAffinity": {
                                                  "requiredDuringSchedulingIgnoredDuringExecution": not_a}}))
    surge = await eventually(lambda: _unschedulable(emu, "surge"))
    assert surge["message"] == ("0/3 nodes are available: 1 Insufficient nvidia.com/gpu, "
                                "2 node(s) didn't match Pod's node affinity/selector.")  # (pinned by name: a PreFilter)
    nowhere = await eventually(lambda: _unschedulable(emu, "nowhere"))
    assert nowhere["message"] == ("0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: training}, "
                                  "2 node(s) didn't match Pod's node affinity/selector.")
    assert (await emu.k8s_get(PODS, "default", "surge"))["status"]["phase"] == "Pending"
    reasons = {(e["reason"], e["involvedObject"]["name"]) for e in await emu.k8s_list(EVENTS, "default")}
    assert {("Scheduled", "r0"), ("FailedScheduling", "surge")} <= reasons

    await emu.k8s_patch(PODS, "default", "r0", {"status": {"phase": "Succeeded"}}, subresource="status")
    assert await eventually(lambda: node_of(emu, "surge")) == "a"  # a finished pod holds nothing


async def test_a_node_holds_no_more_pods_than_it_declares(cluster):
    """NodeResourcesFit counts each pod against the node's allocatable `pods` (a kubelet declares
    110 by default), whatever it requests: a Node that declares none, or is full, gets no pod, with
    the scheduler's "Too many pods"; a pod that finishes frees its place."""
    emu, _ = cluster
    bare = gpu_node("bare")
    for part in ("allocatable", "capacity"):
        del bare["status"][part]["pods"]
    one = gpu_node("one")
    one["status"]["allocatable"]["pods"] = "1"
    await emu.k8s_create(NODES, None, bare)
    await emu.k8s_create(NODES, None, one)
    await emu.k8s_create(PODS, "default", pod("first", gpus=0))
    assert await eventually(lambda: node_of(emu, "first")) == "one"
    await emu.k8s_create(PODS, "default", pod("second", gpus=0))
    second = await eventually(lambda: _unschedulable(emu, "second"))
    assert second["message"] == "0/2 nodes are available: 2 Too many pods."
    await emu.k8s_patch(PODS, "default", "first", {"status": {"phase": "Succeeded"}}, subresource="status")
    assert await eventually(lambda: node_of(emu, "second")) == "one"


async def _unschedulable(emu, name):
    condition = await scheduled(emu, name)
    return condition if condition.get("reason") == "Unschedulable" else None


@pytest.mark.parametrize("cluster", [5.0], indirect=True)  # a grace a stalled renewal loop still meets
async def test_a_node_without_lease_renewals_turns_unknown_tainted_and_its_pods_not_ready(cluster):
    """The node lifecycle controller: a Node whose Lease (kube-node-lease/<node>) has not been
    renewed for the node monitor grace period gets Ready=Unknown (NodeStatusUnknown, "Kubelet
    stopped posting node status."), the node.kubernetes.io/unreachable NoSchedule and NoExecute
    taints (which keep the scheduler off it) and its pods' Ready condition False; a Node that is
    Ready again loses the taints. A cordoned node carries node.kubernetes.io/unschedulable."""
    emu, _ = cluster
    await emu.k8s_create(NODES, None, gpu_node("a"))
    await emu.k8s_create(PODS, "default", {**pod("p"), "spec": {**pod("p")["spec"], "nodeName": "a"}})
    await emu.k8s_patch(PODS, "default", "p", {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}}, subresource="status")
    renewed = asyncio.create_task(_renew(emu, "a"))
    await asyncio.sleep(6.0)  # longer than the grace: only the renewals keep it Ready
    node = await emu.k8s_get(NODES, None, "a")
    assert _ready(node)["status"] == "True" and not node["spec"].get("taints")  # the lease kept it alive
    renewed.cancel()
    await asyncio.gather(renewed, return_exceptions=True)

    async def unknown():
        node = await emu.k8s_get(NODES, None, "a")
        return node if _ready(node)["status"] == "Unknown" else None
    node = await eventually(unknown, timeout=60)
    assert (_ready(node)["reason"], _ready(node)["message"]) == ("NodeStatusUnknown",
                                                                 "Kubelet stopped posting node status.")
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} == {
        ("node.kubernetes.io/unreachable", "NoSchedule"), ("node.kubernetes.io/unreachable", "NoExecute")}
    assert _ready(await eventually(lambda: _not_ready_pod(emu, "p")))["status"] == "False"

    renewed = asyncio.create_task(_renew(emu, "a"))  # the kubelet is back, and says so
    await emu.k8s_patch(NODES, None, "a", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                        subresource="status")
    await emu.k8s_patch(NODES, None, "a", {"spec": {"unschedulable": True}})

    async def cordoned():
        taints = (await emu.k8s_get(NODES, None, "a"))["spec"].get("taints") or []
        return [(t["key"], t["effect"]) for t in taints] == [("node.kubernetes.io/unschedulable", "NoSchedule")]
    await eventually(cordoned, timeout=60)
    renewed.cancel()
    await asyncio.gather(renewed, return_exceptions=True)


def _ready(obj):
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


async def _not_ready_pod(emu, name):
    p = await emu.k8s_get(PODS, "default", name)
    return p if _ready(p)["status"] == "False" else None


async def _renew(emu, node: str) -> None:
    """A kubelet's heartbeat, until cancelled."""
    if await emu.k8s_get(LEASES, "kube-node-lease", node) is None:
        await emu.k8s_create(LEASES, "kube-node-lease", {"metadata": {"name": node}, "spec": {
            "holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": _micro()}})
    while True:
        await emu.k8s_patch(LEASES, "kube-node-lease", node, {"spec": {"renewTime": _micro()}})
        await asyncio.sleep(0.1)


def _micro() -> str:
    import datetime
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def test_the_pod_gc_force_deletes_pods_of_a_deleted_node_after_a_quarantine(cluster):
    """The pod garbage collector: pods bound to a Node that no longer exists are marked Failed
    with a DisruptionTarget condition (DeletionByPodGC) and deleted with grace 0, once the node has
    been missing for the quarantine (40 s on a real cluster); until then they stay, Terminating if
    someone deleted them (no kubelet is left to confirm)."""
    emu, plane = cluster
    await emu.k8s_create(NODES, None, gpu_node("a"))
    await emu.k8s_create(PODS, "default", {**pod("p"), "spec": {**pod("p")["spec"], "nodeName": "a"}})
    await emu.k8s_delete(PODS, "default", "p")  # graceful: it waits for a kubelet
    await emu.k8s_delete(NODES, None, "a")
    await asyncio.sleep(0.2)
    assert (await emu.k8s_get(PODS, "default", "p"))["metadata"]["deletionTimestamp"]  # quarantined

    async def gone():
        return await emu.k8s_get(PODS, "default", "p") is None
    await eventually(gone, timeout=60)
    assert plane.pod_gc.deleted == 1


async def test_services_get_endpoints_and_endpoint_slices_of_the_pods_they_select(cluster):
    """The endpoints and EndpointSlice controllers: a Service with a selector gets an Endpoints
    object (ready pods' IPs as addresses, others as notReadyAddresses; all ready with
    publishNotReadyAddresses; terminating pods left out) and EndpointSlices labelled
    kubernetes.io/service-name and owned by the Service (ports resolved per pod, named target ports
    included; conditions ready/serving/terminating; each pod's hostname where its subdomain is the
    Service's name), both updated as pods change and gone with the Service."""
    emu, _ = cluster
    for name in ("w0", "w1"):
        await emu.k8s_create(PODS, "default", {**pod(name, gpus=0, labels={"app": "web"}),
                                               "spec": {**pod(name)["spec"], "nodeName": "a", "hostname": name,
                                                        "subdomain": "grp"}})
    await emu.k8s_patch(PODS, "default", "w0", {"status": {"phase": "Running", "podIP": "10.244.0.5",
                                                           "conditions": [{"type": "Ready", "status": "True"}]}},
                        subresource="status")
    await emu.k8s_patch(PODS, "default", "w1", {"status": {"phase": "Running", "podIP": "10.244.0.6",
                                                           "conditions": [{"type": "Ready", "status": "False"}]}},
                        subresource="status")
    web = await emu.k8s_create("v1/services", "default", {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"name": "api", "port": 80, "targetPort": "http"}]}})
    await emu.k8s_create("v1/services", "default", {"metadata": {"name": "grp"}, "spec": {
        "clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "web"}}})

    async def endpoints(name):
        return ((await emu.k8s_get(ENDPOINTS, "default", name)) or {}).get("subsets")
    subsets = await eventually(lambda: endpoints("web"))
    assert [[a["ip"] for a in s.get("addresses") or []] for s in subsets] == [["10.244.0.5"]]
    assert [a["targetRef"]["name"] for a in subsets[0]["notReadyAddresses"]] == ["w1"]
    assert subsets[0]["ports"] == [{"name": "api", "port": 8000, "protocol": "TCP"}]
    (slice_,) = await emu.k8s_list(SLICES, "default", "kubernetes.io/service-name=web")
    assert slice_["ports"] == [{"name": "api", "port": 8000, "protocol": "TCP"}]
    assert slice_["metadata"]["ownerReferences"][0]["uid"] == web["metadata"]["uid"]
    assert [(e["addresses"], e["conditions"]["ready"]) for e in slice_["endpoints"]] == [
        (["10.244.0.5"], True), (["10.244.0.6"], False)]
    grp = await eventually(lambda: endpoints("grp"))
    assert [(a["ip"], a["hostname"]) for a in grp[0]["addresses"]] == [("10.244.0.5", "w0"), ("10.244.0.6", "w1")]

    await emu.k8s_delete(PODS, "default", "w0")  # bound: graceful, so it lingers, terminating

    async def terminating():
        (s,) = await emu.k8s_list(SLICES, "default", "kubernetes.io/service-name=web")
        ends = {e["targetRef"]["name"]: e["conditions"] for e in s["endpoints"]}
        return ends if ends.get("w0", {}).get("terminating") else None
    assert (await eventually(terminating))["w0"] == {"ready": False, "serving": True, "terminating": True}
    assert not [s for s in await endpoints("web") if s.get("addresses")]
    await emu.k8s_delete("v1/services", "default", "web")

    async def cleaned():
        return not await emu.k8s_get(ENDPOINTS, "default", "web") and \
            not await emu.k8s_list(SLICES, "default", "kubernetes.io/service-name=web")
    await eventually(cleaned)
