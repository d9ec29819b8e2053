"""FakeKubelet: the kubelets of an emulated cluster for the operator's tests, without processes.

It plays the kubelet of every Node (the emulator's scheduler binds the pods):
* heartbeats: renews every Node's Lease and names its own endpoint in the Node's status, but
  leaves the Node's conditions to the test;
* a pod bound to a Node becomes Running and Ready (`ready` decides, per pod), or with
  `run_processes` (a predicate of the pod) its first container's command+args runs as a local
  process ("python" is this interpreter; env `value`s and `mounts` honoured: a container path under
  a mount is mapped to the local directory), Running, then Succeeded/Failed with the exit code; its
  output is the container log, served to pods/log by a KubeletServer;
* a deleted pod's process is stopped and the pod deleted with grace 0, as a kubelet does;
* when a Node turns Ready again, its pods are Ready again (the node lifecycle controller marked
  them not Ready when it went);
* fail(): a rank dies (phase Failed, container terminated with an exit code).

It uses the emulator's in-process API: it is a test double, not a kubelet that runs anywhere else
(that is shard_devcluster.processkubelet).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from shard_devcluster.apirules import ApiError
from shard_devcluster.kubeletserver import KubeletServer, LogBuffer

PODS, NODES, LEASES = "v1/pods", "v1/nodes", "coordination.k8s.io/v1/leases"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ready(obj: dict) -> str | None:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)


class FakeKubelet:
    def __init__(self, emu, *, run_processes: Callable[[dict], bool] = lambda pod: False,
                 mounts: dict[str, str] | None = None, ready: Callable[[dict], bool] = lambda pod: True,
                 renew_seconds: float = 5.0):
        self.emu, self.run_processes, self.ready = emu, run_processes, ready
        self.mounts = dict(mounts or {})
        self.renew_seconds = renew_seconds
        self.logs: dict[tuple[str, str], LogBuffer] = {}
        self.procs: dict[tuple[str, str], asyncio.subprocess.Process] = {}
        self.started: dict[tuple[str, str], str] = {}  # pod -> uid, once started
        self.addresses = itertools.count(10)  # pod IPs: 10.244.0.10, .11, ...
        self._pki = tempfile.TemporaryDirectory(prefix="fake-kubelet-")
        self.server = KubeletServer(lambda ns, name, container: self.logs.get((ns, name)), Path(self._pki.name))
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> FakeKubelet:
        await self.server.start()
        for coro in (self._pods(), self._nodes(), self._leases()):
            self._spawn(coro)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        for proc in list(self.procs.values()):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await self.server.stop()
        self._pki.cleanup()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what tests do to pods -------------------------------------------------------------
    async def fail(self, namespace: str, name: str, exit_code: int = 1, reason: str = "Error") -> None:
        pod = await self.emu.k8s_get(PODS, namespace, name)
        c = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        await self._set_status(namespace, name, {
            "phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            "containerStatuses": [self._cstatus(c, False, {"terminated": {
                "exitCode": exit_code, "reason": reason, "finishedAt": _now()}})]})

    async def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        await self._set_status(namespace, name, {"conditions": [
            {"type": "Ready", "status": str(ready), "lastTransitionTime": _now()}]})

    # ---- the kubelet ---------------------------------------------------------------------------
    @staticmethod
    def _cstatus(c: dict, ready: bool, state: dict) -> dict:
        # The kubernetes client validates V1ContainerStatus: name, image, imageID, ready and
        # restartCount are required, or listing pods fails.
        image = c.get("image") or "local"
        return {"name": c.get("name", "c"), "image": image, "imageID": "fake://" + image,
                "ready": ready, "started": ready, "restartCount": 0, "state": state}

    async def _set_status(self, ns: str, name: str, status: dict) -> None:
        try:
            await self.emu.k8s_patch(PODS, ns, name, {"status": status}, subresource="status",
                                     content_type="application/strategic-merge-patch+json")
        except ApiError:
            pass  # the pod may be gone already

    async def _nodes(self) -> None:
        async for event in self.emu.k8s_watch(NODES):
            node = event["object"]
            name = node["metadata"]["name"]
            if event["type"] == "ADDED":
                await self.emu.k8s_patch(NODES, None, name, {"status": {
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": self.server.port}}}}, subresource="status")
                await self._renew(name)
            elif event["type"] == "MODIFIED" and _ready(node) == "True" and _ready(event.get("_old") or {}) != "True":
                for pod in await self.emu.k8s_list(PODS, field_selector=f"spec.nodeName={name}"):
                    running = (pod.get("status") or {}).get("phase") == "Running"
                    if running and not pod["metadata"].get("deletionTimestamp"):
                        await self.set_ready(pod["metadata"]["namespace"], pod["metadata"]["name"],
                                             bool(self.ready(pod)))

    async def _renew(self, name: str) -> None:
        try:
            await self.emu.k8s_patch(LEASES, "kube-node-lease", name, {"spec": {"renewTime": _micro()}})
        except ApiError:
            await self.emu.k8s_create(LEASES, "kube-node-lease", {"metadata": {"name": name}, "spec": {
                "holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro()}})

    async def _leases(self) -> None:
        while True:
            await asyncio.sleep(self.renew_seconds)
            for node in await self.emu.k8s_list(NODES):
                try:
                    await self._renew(node["metadata"]["name"])
                except ApiError:
                    pass  # deleted meanwhile

    async def _pods(self) -> None:
        async for event in self.emu.k8s_watch(PODS):
            pod = event["object"]
            meta, spec = pod["metadata"], pod.get("spec") or {}
            key = (meta["namespace"], meta["name"])
            if event["type"] == "DELETED":
                proc = self.procs.pop(key, None)
                if proc is not None and proc.returncode is None:
                    proc.kill()
                if self.started.get(key) == meta["uid"]:
                    del self.started[key]
            elif meta.get("deletionTimestamp"):
                self._spawn(self._stop(pod))
            elif spec.get("nodeName") and self.started.get(key) != meta["uid"] \
                    and (pod.get("status") or {}).get("phase") not in ("Running", "Succeeded", "Failed"):
                self.started[key] = meta["uid"]
                self._spawn(self._start(pod))

    async def _stop(self, pod: dict) -> None:
        meta = pod["metadata"]
        proc = self.procs.pop((meta["namespace"], meta["name"]), None)
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
        if await self.emu.k8s_get(NODES, None, pod["spec"].get("nodeName") or "") is None:
            return  # its node is gone: so is its kubelet
        try:
            await self.emu.k8s_delete(PODS, meta["namespace"], meta["name"], grace=0)
        except ApiError:
            pass

    def _local(self, value: str) -> str:
        for inside, outside in self.mounts.items():
            if value == inside or value.startswith(inside.rstrip("/") + "/"):
                return outside.rstrip("/") + value[len(inside.rstrip("/")):]
        return value

    async def _start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        c = (spec.get("containers") or [{}])[0]
        ip = next(self.addresses)
        base = {"hostIP": "127.0.0.1", "podIP": f"10.244.{ip // 250}.{ip % 250}", "startTime": _now()}
        if not self.run_processes(pod):
            ready = bool(self.ready(pod))
            await self._set_status(ns, name, {**base, "phase": "Running", "conditions": [
                {"type": "Ready", "status": str(ready), "lastTransitionTime": _now()},
                {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": _now()}],
                "containerStatuses": [self._cstatus(c, ready, {"running": {"startedAt": _now()}})]})
            return
        argv = [self._local(a) for a in list(c.get("command") or []) + list(c.get("args") or [])]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        env = {**os.environ,
               **{e["name"]: self._local(str(e.get("value", ""))) for e in c.get("env") or [] if "name" in e},
               "HOSTNAME": name, "POD_NAME": name, "POD_NAMESPACE": ns}
        logs = self.logs[(ns, name)] = LogBuffer()
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=c.get("workingDir") or None,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except (OSError, ValueError) as e:
            await self._set_status(ns, name, {**base, "phase": "Failed", "reason": "StartError", "message": str(e)})
            return
        self.procs[(ns, name)] = proc
        started = _now()
        await self._set_status(ns, name, {**base, "phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": started}],
            "containerStatuses": [self._cstatus(c, True, {"running": {"startedAt": started}})]})
        while line := await proc.stdout.readline():
            logs.data += line
        code = await proc.wait()
        logs.ended = True
        self.procs.pop((ns, name), None)
        await self._set_status(ns, name, {"phase": "Succeeded" if code == 0 else "Failed", "conditions": [
            {"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            "containerStatuses": [self._cstatus(c, False, {"terminated": {
                "exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}})]})
