"""The emulated cluster's control plane besides the API server: kube-scheduler and the parts of
kube-controller-manager the dev cluster relies on, each an in-process component that watches the
emulator and writes through its API, as the real ones do over HTTP.

* Scheduler: binds each unscheduled pod through pods/binding to a node its filters admit
  (scheduling.py), or marks it PodScheduled=False/Unschedulable with the scheduler's message and a
  FailedScheduling Event; tries again when nodes or pods change.
* NodeLifecycle: a Node whose kubelet stopped renewing its Lease (kube-node-lease) for
  `node_monitor_grace` seconds turns Ready=Unknown ("Kubelet stopped posting node status."); the
  pods of a node whose Ready turns from True are marked not Ready; NotReady, unreachable and
  cordoned nodes carry the matching `node.kubernetes.io/*` taints (TaintNodesByCondition), which
  keep the scheduler off them.
* PodGC: pods bound to a Node that no longer exists are marked Failed (DisruptionTarget,
  DeletionByPodGC) and force-deleted (grace 0) once the node has been gone `pod_gc_quarantine`
  seconds (40 s on a real cluster).
* Endpoints: every Service with a selector gets an Endpoints object and EndpointSlices of the pods
  it selects that have an IP: ready ones as addresses, others as notReadyAddresses (all ready with
  publishNotReadyAddresses), terminating ones only in the slices (terminating=true); ports resolved
  per pod (named target ports); each pod's hostname when its subdomain is the Service's name.

Not emulated: taint-based eviction (NoExecute after tolerationSeconds), preemption, scoring beyond
the least allocated node, Endpoints/EndpointSlices of Services without a selector.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import string
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .apirules import ApiError, now
from .emulator import FidelityEmulator
from .scheduling import holds_resources, place, requests
from .tables import dig

PODS, NODES, LEASES, SERVICES = "v1/pods", "v1/nodes", "coordination.k8s.io/v1/leases", "v1/services"
ENDPOINTS, SLICES, EVENTS = "v1/endpoints", "discovery.k8s.io/v1/endpointslices", "v1/events"
SMP = "application/strategic-merge-patch+json"
NODE_LEASE_NAMESPACE = "kube-node-lease"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
CONDITION_TAINTS = {"False": "node.kubernetes.io/not-ready", "Unknown": "node.kubernetes.io/unreachable"}
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
MANAGED_TAINTS = {*CONDITION_TAINTS.values(), UNSCHEDULABLE_TAINT}


def key_of(obj: dict[str, Any]) -> tuple[str | None, str]:
    return obj["metadata"].get("namespace"), obj["metadata"]["name"]


def parse_time(text: str | None) -> float | None:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


def ready_condition(obj: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})


async def record(emu: FidelityEmulator, about: dict[str, Any], type_: str, reason: str, message: str,
                 component: str, action: str) -> None:
    """A core/v1 Event about an object, as a component's event recorder posts it."""
    meta = about["metadata"]
    stamp = now()
    await emu.k8s_create(EVENTS, meta.get("namespace") or "default", {
        "metadata": {"generateName": f"{meta['name']}."},
        "involvedObject": {"apiVersion": about.get("apiVersion", "v1"), "kind": about.get("kind", ""),
                           "namespace": meta.get("namespace"), "name": meta["name"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message, "action": action, "count": 1,
        "source": {"component": component}, "reportingComponent": component, "reportingInstance": component,
        "firstTimestamp": stamp, "lastTimestamp": stamp})


class Cache:
    """One resource as an in-process watch shows it: key -> object; `changed` is set on every event."""

    def __init__(self, emu: FidelityEmulator, resource: str,
                 on_event: Callable[[str, dict, dict | None], None] | None = None):
        self.emu, self.resource, self.on_event = emu, resource, on_event
        self.objects: dict[tuple[str | None, str], dict[str, Any]] = {}
        self.changed = asyncio.Event()

    async def run(self) -> None:
        async for event in self.emu.k8s_watch(self.resource):
            obj = event["object"]
            key = key_of(obj)
            old = self.objects.get(key)
            if event["type"] == "DELETED":
                self.objects.pop(key, None)
            else:
                self.objects[key] = obj
            if self.on_event is not None:
                self.on_event(event["type"], obj, old)
            self.changed.set()


# ---------------------------------------------------------------- the scheduler
class Scheduler:
    def __init__(self, emu: FidelityEmulator):
        self.emu = emu
        self.wake = asyncio.Event()
        self.pods = Cache(emu, PODS, self._pod_event)
        self.nodes = Cache(emu, NODES, lambda *_: self.wake.set())
        self.used: dict[str, Counter] = {}                    # node -> what the pods bound there request
        self.assumed: dict[tuple[str | None, str], str] = {}  # bound by us, not yet seen bound
        self.said: dict[tuple[str | None, str], str] = {}     # the last Unschedulable message of each pod

    def _pod_event(self, type_: str, pod: dict, old: dict | None) -> None:
        """Keep `used` as the pods come, bind, finish and go (the scheduler cache's job)."""
        for obj, sign in ((old, -1), (pod if type_ != "DELETED" else None, 1)):
            if obj is not None and holds_resources(obj):
                usage = self.used.setdefault(obj["spec"]["nodeName"], Counter())
                for name, amount in requests(obj).items():
                    usage[name] += sign * amount
        if type_ == "DELETED" or self.pending(pod) or (old is not None and holds_resources(old)
                                                       and not holds_resources(pod)):
            self.wake.set()

    def tasks(self) -> list:
        return [self.pods.run(), self.nodes.run(), self._loop()]

    @staticmethod
    def pending(pod: dict[str, Any]) -> bool:
        spec = pod.get("spec") or {}
        return not spec.get("nodeName") and not pod["metadata"].get("deletionTimestamp") \
            and spec.get("schedulerName", "default-scheduler") == "default-scheduler" \
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")

    async def _loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.schedule()

    async def schedule(self) -> None:
        pods = self.pods.objects
        for key in [k for k in self.assumed if k not in pods or (pods[k].get("spec") or {}).get("nodeName")]:
            del self.assumed[key]
        used = {node: Counter(usage) for node, usage in self.used.items()}
        for key, node in self.assumed.items():
            used.setdefault(node, Counter()).update(requests(pods[key]))
        nodes = sorted(self.nodes.objects.values(), key=lambda n: n["metadata"]["name"])
        waiting = sorted((p for k, p in pods.items() if self.pending(p) and k not in self.assumed),
                         key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
        for pod in waiting:
            key = key_of(pod)
            target, why = place(pod, nodes, used)
            if target is not None:
                try:
                    await self.emu.k8s_bind(key[0], key[1], target)
                except ApiError:
                    continue  # deleted or bound meanwhile: the watch will tell
                self.assumed[key] = target
                self.said.pop(key, None)
                used.setdefault(target, Counter()).update(requests(pod))
                await record(self.emu, pod, "Normal", "Scheduled",
                             f"Successfully assigned {key[0]}/{key[1]} to {target}",
                             "default-scheduler", "Binding")
            elif self.said.get(key) != why:
                self.said[key] = why
                try:
                    await self.emu.k8s_patch(PODS, key[0], key[1], {"status": {"phase": "Pending", "conditions": [
                        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why,
                         "lastProbeTime": None, "lastTransitionTime": now()}]}}, subresource="status", content_type=SMP)
                except ApiError:
                    continue
                await record(self.emu, pod, "Warning", "FailedScheduling", why, "default-scheduler", "Scheduling")
        for key in [k for k in self.said if k not in pods]:
            del self.said[key]


# ---------------------------------------------------------------- node lifecycle
def node_taints(node: dict[str, Any], ready: str | None) -> list[dict[str, Any]]:
    """The node's taints with the node.kubernetes.io/* ones its conditions call for."""
    own = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") not in MANAGED_TAINTS]
    keys = [CONDITION_TAINTS[ready]] if ready in CONDITION_TAINTS else []
    managed = [{"key": k, "effect": effect} for k in keys for effect in ("NoSchedule", "NoExecute")]
    if (node.get("spec") or {}).get("unschedulable"):
        managed.append({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
    old = {(t.get("key"), t.get("effect")): t for t in (node.get("spec") or {}).get("taints") or []}
    return own + [old.get((t["key"], t["effect"]), {**t, "timeAdded": now()}) for t in managed]


class NodeLifecycle:
    def __init__(self, emu: FidelityEmulator, grace: float):
        self.emu, self.grace = emu, grace
        self.period = min(5.0, grace / 4)
        self.nodes = Cache(emu, NODES)
        self.leases = Cache(emu, LEASES)
        self.ready_before: dict[str, str | None] = {}

    def tasks(self) -> list:
        return [self.nodes.run(), self.leases.run(), self._loop()]

    def heartbeat(self, node: dict[str, Any]) -> float:
        name = node["metadata"]["name"]
        lease = self.leases.objects.get((NODE_LEASE_NAMESPACE, name)) or {}
        times = [parse_time(dig(lease, "spec.renewTime")), parse_time(ready_condition(node).get("lastHeartbeatTime")),
                 parse_time(node["metadata"].get("creationTimestamp"))]
        return max(t for t in times if t is not None)

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.nodes.changed.wait(), self.period)
            except TimeoutError:
                pass
            self.nodes.changed.clear()
            for node in list(self.nodes.objects.values()):
                try:
                    await self.monitor(node)
                except ApiError:
                    pass  # deleted meanwhile

    async def monitor(self, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        ready = ready_condition(node)
        status: str | None = ready.get("status")
        if ready and status != "Unknown" and time.time() - self.heartbeat(node) > self.grace:
            stamp = now()
            conditions = [{**c, "status": "Unknown", "reason": "NodeStatusUnknown",
                           "message": "Kubelet stopped posting node status.", "lastTransitionTime": stamp}
                          for c in (node.get("status") or {}).get("conditions") or []]
            node = await self.emu.k8s_patch(NODES, None, name, {"status": {"conditions": conditions}},
                                            subresource="status", content_type=SMP)
            status = "Unknown"
        if self.ready_before.get(name) == "True" and status != "True":
            await self.mark_pods_not_ready(node)
        self.ready_before[name] = status
        taints = node_taints(node, status)
        if taints != ((node.get("spec") or {}).get("taints") or []):
            await self.emu.k8s_patch(NODES, None, name, {"spec": {"taints": taints or None}})

    async def mark_pods_not_ready(self, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        await record(self.emu, {**node, "kind": "Node"}, "Normal", "NodeNotReady",
                     f"Node {name} status is now: NodeNotReady",
                     "node-controller", "NodeNotReady")
        for pod in await self.emu.k8s_list(PODS, field_selector=f"spec.nodeName={name}"):
            if ready_condition(pod).get("status") != "True":
                continue
            try:
                await self.emu.k8s_patch(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": {
                    "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now()}]}},
                    subresource="status", content_type=SMP)
            except ApiError:
                pass


# ---------------------------------------------------------------- pod garbage collection
class PodGC:
    def __init__(self, emu: FidelityEmulator, quarantine: float):
        self.emu, self.quarantine = emu, quarantine
        self.period = min(20.0, max(quarantine / 4, 0.05))
        self.nodes = Cache(emu, NODES)
        self.pods = Cache(emu, PODS)
        self.missing_since: dict[str, float] = {}
        self.deleted = 0  # pods force-deleted, for tests

    def tasks(self) -> list:
        return [self.nodes.run(), self.pods.run(), self._loop()]

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.collect()

    async def collect(self) -> None:
        nodes = {name for _, name in self.nodes.objects}
        clock = time.monotonic()
        orphans = [p for p in self.pods.objects.values() if (p.get("spec") or {}).get("nodeName") not in (None, *nodes)]
        missing = {p["spec"]["nodeName"] for p in orphans}
        self.missing_since = {n: self.missing_since.get(n, clock) for n in missing}
        for pod in orphans:
            if clock - self.missing_since[pod["spec"]["nodeName"]] < self.quarantine:
                continue
            ns, name = key_of(pod)
            try:
                await self.emu.k8s_patch(PODS, ns, name, {"status": {"phase": "Failed", "conditions": [
                    {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
                     "message": "PodGC: node no longer exists", "lastTransitionTime": now()}]}},
                    subresource="status", content_type=SMP)
                await self.emu.k8s_delete(PODS, ns, name, grace=0)
                self.deleted += 1
            except ApiError:
                pass


# ---------------------------------------------------------------- endpoints
def _target_port(pod: dict[str, Any], port: dict[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or str(target).isdigit():
        return int(str(target))
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def _selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = (service.get("spec") or {}).get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_endpoints(service: dict[str, Any],
                      pods: list[dict[str, Any]]) -> tuple[list[dict], list[tuple[list, list]]]:
    """(Endpoints subsets, [(slice ports, slice endpoints)]) of a Service over the pods it selects."""
    spec, name = service.get("spec") or {}, service["metadata"]["name"]
    publish = bool(spec.get("publishNotReadyAddresses"))
    subsets: dict[tuple, dict[str, list]] = {}
    slices: dict[tuple, list] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status, pspec, meta = pod.get("status") or {}, pod.get("spec") or {}, pod["metadata"]
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ports = tuple((p.get("name", ""), n, p.get("protocol", "TCP"))
                      for p in spec.get("ports") or [] if (n := _target_port(pod, p)) is not None)
        ready = ready_condition(pod).get("status") == "True"
        terminating = bool(meta.get("deletionTimestamp"))
        address = {"ip": ip, "targetRef": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                                            "uid": meta.get("uid")}}
        if pspec.get("nodeName"):
            address["nodeName"] = pspec["nodeName"]
        if pspec.get("hostname") and pspec.get("subdomain") == name:
            address["hostname"] = pspec["hostname"]
        if not terminating or publish:
            group = subsets.setdefault(ports, {"addresses": [], "notReadyAddresses": []})
            group["addresses" if ready or publish else "notReadyAddresses"].append(address)
        endpoint: dict[str, Any] = {
            "addresses": [ip],
            "conditions": {"ready": (ready or publish) and not terminating, "serving": ready,
                           "terminating": terminating},
            "targetRef": address["targetRef"],
            **{k: address[k] for k in ("nodeName", "hostname") if k in address}}
        slices.setdefault(ports, []).append(endpoint)
    out_subsets = [{**{k: v for k, v in group.items() if v},
                    **({"ports": [{"name": n, "port": port,
                                   "protocol": proto} for n, port, proto in ports]} if ports else {})}
                   for ports, group in sorted(subsets.items()) if group["addresses"] or group["notReadyAddresses"]]
    out_slices = [([{"name": n, "port": port, "protocol": proto} for n, port, proto in ports], endpoints)
                  for ports, endpoints in sorted(slices.items())]
    return out_subsets, out_slices


class EndpointsController:
    def __init__(self, emu: FidelityEmulator):
        self.emu = emu
        self.dirty: set[tuple[str | None, str]] = set()
        self.wake = asyncio.Event()
        # Indexes, so a pod's change costs the Services that select it, not all of them.
        self.services_by_label: dict[tuple, set[tuple[str | None, str]]] = {}  # (ns, key, value) -> Services
                                                                                 # whose selector has it
        self.pods_by_label: dict[tuple, set[tuple[str | None, str]]] = {}      # (ns, key, value) -> pods
        self.slices_of: dict[tuple[str | None, str], dict[str, dict]] = {}    # Service -> its slices by name
        self.services = Cache(emu, SERVICES, self._service_event)
        self.pods = Cache(emu, PODS, self._pod_event)
        self.slices = Cache(emu, SLICES, self._slice_event)

    def tasks(self) -> list:
        return [self.slices.run(), self.services.run(), self.pods.run(), self._loop()]

    @staticmethod
    def _selector_items(service: dict) -> list[tuple]:
        selector = (service.get("spec") or {}).get("selector") or {}
        return [(service["metadata"]["namespace"], k, v) for k, v in sorted(selector.items())]

    def _service_event(self, type_: str, service: dict, old: dict | None) -> None:
        key = key_of(service)
        for item in self._selector_items(old) if old is not None else ():
            self.services_by_label.get(item, set()).discard(key)
        for item in self._selector_items(service) if type_ != "DELETED" else ():
            self.services_by_label.setdefault(item, set()).add(key)
        self.dirty.add(key)
        self.wake.set()

    def _pod_event(self, type_: str, pod: dict, old: dict | None) -> None:
        ns, key = pod["metadata"]["namespace"], key_of(pod)
        labels = [pod["metadata"].get("labels") or {}, ((old or {}).get("metadata") or {}).get("labels") or {}]
        for item in labels[1].items():
            self.pods_by_label.get((ns, *item), set()).discard(key)
        if type_ != "DELETED":
            for item in labels[0].items():
                self.pods_by_label.setdefault((ns, *item), set()).add(key)
        for lbls in labels:  # the Services whose every selector item the pod has (had)
            hits = Counter(s for item in lbls.items() for s in self.services_by_label.get((ns, *item), ()))
            for service_key, n in hits.items():
                service = self.services.objects.get(service_key)
                if service is not None and n == len((service.get("spec") or {}).get("selector") or {}):
                    self.dirty.add(service_key)
                    self.wake.set()

    def _slice_event(self, type_: str, endpoint_slice: dict, old: dict | None) -> None:
        meta = endpoint_slice["metadata"]
        owner = (meta["namespace"], (meta.get("labels") or {}).get(SERVICE_NAME_LABEL) or "")
        if type_ == "DELETED":
            self.slices_of.get(owner, {}).pop(meta["name"], None)
        else:
            self.slices_of.setdefault(owner, {})[meta["name"]] = endpoint_slice

    async def _loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            dirty, self.dirty = self.dirty, set()
            for key in sorted(dirty, key=str):
                try:
                    await self.sync(*key)
                except ApiError:
                    self.dirty.add(key)  # a write raced with another: again
                    self.wake.set()

    async def sync(self, ns: str | None, name: str) -> None:
        service = self.services.objects.get((ns, name))
        if service is None or not (service.get("spec") or {}).get("selector"):
            if service is None and await self.emu.k8s_get(ENDPOINTS, ns, name) is not None:
                await self.emu.k8s_delete(ENDPOINTS, ns, name)
            return  # (the slices go with the Service: they are owned by it)
        first, *_ = self._selector_items(service)
        pods = [p for key in self.pods_by_label.get(first, set()) if (p := self.pods.objects.get(key)) is not None
                and _selects(service, p["metadata"].get("labels") or {})]
        subsets, slices = service_endpoints(service, pods)
        endpoints = {"metadata": {"name": name, "labels": dict(service["metadata"].get("labels") or {})},
                     "subsets": subsets}
        current = await self.emu.k8s_get(ENDPOINTS, ns, name)
        if current is None:
            await self.emu.k8s_create(ENDPOINTS, ns, endpoints)
        elif current.get("subsets") != subsets:
            await self.emu.k8s_patch(ENDPOINTS, ns, name, {"subsets": subsets or None})
        await self._slices(service, slices, sorted(self.slices_of.get((ns, name), {}).values(),
                                                   key=lambda s: s["metadata"]["name"]))

    async def _slices(self, service: dict, wanted: list[tuple[list, list]], existing: list[dict]) -> None:
        """One slice per port mapping: the existing ones updated, more created, the rest deleted."""
        meta = service["metadata"]
        ns, name = meta["namespace"], meta["name"]
        wanted = wanted or [([], [])]  # (a Service with no endpoints still has an empty slice)
        for (ports, endpoints), current in zip(wanted, existing, strict=False):
            if (current.get("ports") or [], current.get("endpoints") or []) != (ports, endpoints):
                await self.emu.k8s_patch(SLICES, ns, current["metadata"]["name"],
                                         {"ports": ports or None, "endpoints": endpoints or None})
        for ports, endpoints in wanted[len(existing):]:
            await self.emu.k8s_create(SLICES, ns, {
                "metadata": {"name": f"{name}-{''.join(random.choices(string.ascii_lowercase + string.digits, k=5))}",
                             "labels": {SERVICE_NAME_LABEL: name, **MANAGED_BY},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": name,
                                                  "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
                "addressType": "IPv4", "ports": ports, "endpoints": endpoints})
        for stale in existing[len(wanted):]:
            await self.emu.k8s_delete(SLICES, ns, stale["metadata"]["name"])


# ---------------------------------------------------------------- all of it
class ControlPlane:
    """The scheduler and controllers, running against `emu` until stopped."""

    def __init__(self, emu: FidelityEmulator, *, node_monitor_grace: float = 40.0, pod_gc_quarantine: float = 40.0):
        self.scheduler = Scheduler(emu)
        self.node_lifecycle = NodeLifecycle(emu, node_monitor_grace)
        self.pod_gc = PodGC(emu, pod_gc_quarantine)
        self.endpoints = EndpointsController(emu)
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> ControlPlane:
        for component in (self.scheduler, self.node_lifecycle, self.pod_gc, self.endpoints):
            self._tasks += [asyncio.create_task(coro) for coro in component.tasks()]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
