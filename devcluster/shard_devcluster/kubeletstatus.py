"""What the process kubelet tells the API server, through the Kubernetes HTTP API only: each pod's
status (pods/status: phase, conditions with lastTransitionTime, the container's state with the start
time of its process), each Node's status (nodes/status: Ready, its address, the port of the
kubelet's HTTPS endpoint in `daemonEndpoints`) and the Node's Lease in kube-node-lease, renewed every
`renew_seconds`: the heartbeat without which the node lifecycle controller turns the Node
Ready=Unknown.

A write the API server fails is tried again (a pod's status) or at the next heartbeat (a Node's),
and logged; it never holds up the kubelet's watches.
"""

from __future__ import annotations

import asyncio
import logging
import platform
from typing import Any

import aiohttp

from .kubeapi import SMP, ApiStatusError, Informer, KubeApi, microtime, path, timestamp
from .kubeletserver import KubeletServer
from .podsetup import HOST_IP, Sandbox

log = logging.getLogger("shard_devcluster")

PODS, NODES, LEASES = "v1/pods", "v1/nodes", "coordination.k8s.io/v1/leases"
NODE_LEASE_NAMESPACE = "kube-node-lease"


def ready(obj: dict[str, Any]) -> str | None:
    """The status of an object's Ready condition ("True", "False", "Unknown"), if it has one."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)


def container_status(container: dict, ready: bool, state: dict, pid: int | None = None) -> dict:
    image = container.get("image") or "local"
    return {"name": container.get("name", "c"), "image": image, "imageID": "process://" + image,
            **({"containerID": f"process://{pid}"} if pid else {}), "ready": ready,
            "started": "running" in state, "restartCount": 0, "state": state}


def pod_status(sandbox: Sandbox) -> dict[str, Any]:
    """The pod's status as this kubelet sees it now (its conditions' transition times move only
    when their status does)."""
    running = sandbox.phase == "Running"
    return {"phase": sandbox.phase, "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
            "podIP": sandbox.ip, "podIPs": [{"ip": sandbox.ip}], "startTime": sandbox.start_time,
            "conditions": [sandbox.condition("PodReadyToStartContainers", True),
                           sandbox.condition("Initialized", True),
                           sandbox.condition("ContainersReady", running and sandbox.ready),
                           sandbox.condition("Ready", running and sandbox.ready)],
            "containerStatuses": [container_status(sandbox.container, running and sandbox.ready, sandbox.state,
                                                   sandbox.proc.pid if sandbox.proc else None)],
            **sandbox.reason}


def node_status(node: dict, port: int) -> dict[str, Any]:
    """The node's status as its kubelet reports it: Ready (since it last turned Ready), its address
    and the kubelet's endpoint on `port`."""
    conditions = (node.get("status") or {}).get("conditions") or []
    was: dict[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
    now = timestamp()
    since = was.get("lastTransitionTime") if was.get("status") == "True" else None  # (registered Ready: now)
    return {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                            "lastTransitionTime": since or now}],
            "addresses": [{"type": "InternalIP", "address": HOST_IP}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
            "nodeInfo": {"kubeletVersion": "shard-devcluster", "containerRuntimeVersion": "process://local",
                         "osImage": platform.platform(terse=True), "kernelVersion": platform.release(),
                         "operatingSystem": "linux", "architecture": platform.machine(),
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}


class StatusWriter:
    def __init__(self, api: KubeApi, server: KubeletServer, renew_seconds: float, lease_seconds: int):
        self.api, self.server = api, server
        self.renew_seconds, self.lease_seconds = renew_seconds, lease_seconds

    # ---------------------------------------------------------------- pods
    async def report(self, sandbox: Sandbox) -> None:
        """Post the pod's status as this kubelet sees it now (again, until the API server takes it)."""
        async with sandbox.lock:
            status = pod_status(sandbox)
            for _ in range(20):
                if sandbox.lost:
                    return
                if await self.patch_status(sandbox.namespace, sandbox.name, status) is not False:
                    return
                await asyncio.sleep(0.5)

    async def unknown(self, pod: dict) -> None:
        """A pod that ran under a kubelet before this one: its process is gone, so it Failed."""
        meta = pod["metadata"]
        container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        status = {"phase": "Failed",
                  "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": timestamp()}],
                  "containerStatuses": [container_status(container, False, {"terminated": {
                      "exitCode": 137, "reason": "ContainerStatusUnknown", "finishedAt": timestamp(),
                      "message": "The container could not be located when the pod was terminated"}})]}
        await self.patch_status(meta["namespace"], meta["name"], status)

    async def patch_status(self, ns: str, name: str, status: dict) -> bool | None:
        """True: written; None: the pod is gone; False: the API server failed (try again)."""
        try:
            return await self.api.patch(path(PODS, ns, name, "status"), {"status": status}, SMP) is not None or None
        except (TimeoutError, ApiStatusError, aiohttp.ClientError) as err:
            log.debug("pod %s/%s: status not written: %s", ns, name, err)
            return False

    # ---------------------------------------------------------------- nodes
    async def register(self, node: dict) -> None:
        await self.post_node(node)
        await self.renew(node)

    async def post_node(self, node: dict) -> None:
        """The node's status as its kubelet reports it: Ready, its address and endpoint."""
        name = node["metadata"]["name"]
        try:
            await self.api.patch(path(NODES, name=name, sub="status"),
                                 {"status": node_status(node, self.server.port)}, SMP)
        except (TimeoutError, ApiStatusError, aiohttp.ClientError) as err:
            log.warning("node %s: status not posted: %s", name, err)

    async def renew(self, node: dict) -> None:
        """The node's Lease renewed, or created; owned by its Node (as the kubelet sets it), so the
        garbage collector deletes it with the Node."""
        name = node["metadata"]["name"]
        url = path(LEASES, NODE_LEASE_NAMESPACE, name)
        owner = {"ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                      "uid": node["metadata"]["uid"]}]}
        try:
            if await self.api.patch(url, {"metadata": owner, "spec": {"renewTime": microtime()}}) is None:
                await self.api.create(path(LEASES, NODE_LEASE_NAMESPACE), {
                    "metadata": {"name": name, **owner}, "spec": {
                        "holderIdentity": name, "renewTime": microtime(), "leaseDurationSeconds": self.lease_seconds}})
        except (TimeoutError, ApiStatusError, aiohttp.ClientError) as err:
            log.warning("node %s: lease not renewed: %s", name, err)

    async def heartbeat(self, nodes: Informer) -> None:
        """Renew every node's lease; report a node Ready again where someone said otherwise."""
        while True:
            await asyncio.sleep(self.renew_seconds)
            for node in list(nodes.objects.values()):
                await self.renew(node)
                if ready(node) != "True":
                    await self.post_node(node)
