"""ProcessKubelet: the dev cluster's kubelet, which runs every Pod as a local process.

It is the kubelet of every Node it serves (all Nodes, or those `node_selector` picks), and talks
to the API server only through the Kubernetes HTTP API (kubeapi.py), so it runs against the
emulated server or any other:

* nodes: it registers each Node's status (Ready, its address 127.0.0.1, the port of its HTTPS
  endpoint in `daemonEndpoints`) and renews the Node's Lease in kube-node-lease every
  `renew_seconds`, the heartbeat without which the node lifecycle controller turns the Node
  Ready=Unknown (`kubeletstatus.py`, which writes the pods' status too); a Node that is deleted
  is a machine that disappeared: its processes are killed and nothing more is reported about its
  pods (the pod GC, or the operator, deletes them);
* pods: it runs the pods bound to its Nodes (it never schedules: the scheduler binds pods through
  pods/binding), reports their status through pods/status (phase, conditions with
  lastTransitionTime, container state with the start time of the process), and when a pod is
  deleted stops its process (SIGTERM, then SIGKILL after the grace period, at most `grace`
  seconds) and deletes it for good with grace 0, as the kubelet does;
* network: a pod gets a cluster address from the node's podCIDR (else from the network's pod
  CIDR), which the API shows, and listens on its loopback mapping (network.py); `SHARD_HOST` (the
  worker's bind address) and the downward API's `status.podIP` are that local address, because
  here "every address" would collide with the other pods. `MASTER_ADDR` (a DNS name) is resolved
  before the process starts, waiting for it to exist as a resolver retries;
* volumes: hostPath lies under `host_root` (the "node's" filesystem), configMap and secret
  volumes are read from the API and written out, emptyDirs are fresh directories; env values and
  arguments under a mount path point there;
* devices: a container that requests a GPU gets its node's GPU memory (label
  `nvidia.com/gpu.memory`) as `SHARD_MEMORY_BUDGET`, which the worker enforces (per rank: each
  rank of a pod holding several GPUs has one);
* /dev/shm: a pod's own, shared by its processes only: with `shm_env`, that variable names the
  directory of the pod's volume mounted at /dev/shm (the processes here share the machine's);
* runs the first container's command (`python` is this interpreter; `$(VAR)` references to its
  env expanded); its output is the container log, served to the API server's pods/log on this
  kubelet's HTTPS endpoint (kubeletserver.py);
* probes over HTTP (`probes.py`): startup and readiness (the pod's Ready condition) every
  `probe_period` seconds at most, so pods serve soon; liveness (a failing rank is killed) at the
  pod's own period;
* a container that cannot be created (a missing volume, a name that does not resolve) waits with
  its reason and is retried, as a kubelet retries; a pod this kubelet finds running without a
  process (the dev cluster restarted) is Failed with ContainerStatusUnknown.

Not done: restarting containers (restartPolicy Always), init containers, containers after the
first, resource limits other than the GPU memory, exec/tcp probes, pods of other kubelets.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import aiohttp

from shard_contract.env import HOST_ENV

from .kubeapi import ApiStatusError, Informer, KubeApi, path, timestamp
from .kubeletserver import KubeletServer, LogBuffer
from .kubeletstatus import NODES, PODS, StatusWriter, ready
from .network import ClusterNetwork, taken_ports
from .podsetup import PodError, PodSetup, Sandbox, expand
from .probes import Prober

log = logging.getLogger("shard_devcluster")

LOG_TAIL_BYTES = 2048  # what FallbackToLogsOnError keeps of the log as the termination message
RETRY_SECONDS = (1, 2, 4, 8, 10)  # a container that cannot be created is tried again after these


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the kubelet's process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ProcessKubelet:
    def __init__(self, api: KubeApi, network: ClusterNetwork, workdir: str | os.PathLike[str], *, host_root: str = "/",
                 probe_period: float = 1.0, grace: float = 5.0, dns_wait: float = 120.0,
                 extra_env: dict[str, str] | None = None, bind_env: tuple[str, ...] = (HOST_ENV,),
                 node_selector: str = "", renew_seconds: float = 10.0, lease_seconds: int = 40,
                 shm_env: str | None = None):
        self.api, self.network = api, network
        self.workdir, self.host_root = Path(workdir), Path(host_root)
        self.probe_period, self.grace, self.dns_wait = probe_period, grace, dns_wait
        self.extra_env = dict(extra_env or {})
        # Env vars set to the pod's address: what a process binds instead of "every address",
        # which in a pod means its own network namespace and here would collide with other pods.
        self.bind_env = bind_env
        # Env var set to the directory of the pod's /dev/shm volume: what a process uses instead of
        # the machine's /dev/shm, which here every pod would share.
        self.shm_env = shm_env
        self.renew_seconds, self.lease_seconds = renew_seconds, lease_seconds
        self.setup = PodSetup(api, network, self.host_root, self.extra_env, bind_env, shm_env, dns_wait)
        self.sandboxes: dict[tuple[str, str], Sandbox] = {}
        self.server = KubeletServer(self._find_logs, self.workdir / ".kubelet")
        self.status = StatusWriter(api, self.server, renew_seconds, lease_seconds)  # pods/status, the Nodes'
        self.probes = Prober(network, self.status, probe_period)
        self.nodes = Informer(api, NODES, self._on_node, label_selector=node_selector)
        self.pods = Informer(api, PODS, self._on_pod)
        self._tasks: list[asyncio.Task] = []
        self._finalized: set[str] = set()  # uids of pods deleted for good by this kubelet
        self._writes: set[asyncio.Task] = set()  # what the watch handlers asked for, under way

    def _spawn(self, coro) -> None:
        """Run API writes beside the watches, so a slow or failing API server holds up no event."""
        task = asyncio.create_task(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        await self.probes.start()
        await self.server.start()
        self._tasks = [asyncio.create_task(self.nodes.run())]
        await self.nodes.synced.wait()  # its nodes first: their pods are recognised as theirs
        self._tasks += [asyncio.create_task(self.pods.run()), asyncio.create_task(self.status.heartbeat(self.nodes))]
        await self.pods.synced.wait()

    async def stop(self) -> None:
        for task in [*self._tasks, *self._writes]:
            task.cancel()
        for sandbox in list(self.sandboxes.values()):
            for left in [*sandbox.tasks, sandbox.main, sandbox.stopper]:
                if left is not None:
                    left.cancel()
            await sandbox.kill(signal.SIGKILL)
        await self.server.stop()
        await self.probes.close()

    async def __aenter__(self) -> ProcessKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------- what tests and users do
    def process(self, namespace: str, name: str) -> asyncio.subprocess.Process | None:
        sandbox = self.sandboxes.get((namespace, name))
        return sandbox.proc if sandbox else None

    async def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Send a signal to a pod's process (a rank crashes); returns its pid."""
        proc = self.process(namespace, name)
        if proc is None or proc.returncode is not None:
            raise LookupError(f"pod {namespace}/{name} runs no process")
        proc.send_signal(sig)
        return proc.pid

    def logs(self, namespace: str, name: str) -> bytes:
        sandbox = self.sandboxes.get((namespace, name))
        return bytes(sandbox.logs.data) if sandbox else b""

    def _find_logs(self, namespace: str, name: str, container: str) -> LogBuffer | None:
        sandbox = self.sandboxes.get((namespace, name))
        return sandbox.logs if sandbox and sandbox.container.get("name") == container else None

    # ---------------------------------------------------------------- nodes
    async def _on_node(self, kind: str, node: dict, old: dict | None) -> None:
        name = node["metadata"]["name"]
        if kind == "DELETED":
            await self._node_gone(name)
        elif old is None:
            self._spawn(self.status.register(node))

    async def _node_gone(self, node: str) -> None:
        for sandbox in [s for s in self.sandboxes.values() if s.node == node and not s.lost]:
            sandbox.lost = True
            for task in [*sandbox.tasks, sandbox.stopper, sandbox.main if sandbox.proc is None else None]:
                if task is not None:
                    task.cancel()
            await sandbox.kill(signal.SIGKILL)

    # ---------------------------------------------------------------- pods
    async def _on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        key, uid = (meta["namespace"], meta["name"]), meta.get("uid", "")
        sandbox = self.sandboxes.get(key)
        if sandbox is not None and sandbox.uid != uid:
            await self._forget(sandbox)  # a pod of the same name replaced it
            sandbox = None
        if kind == "DELETED":
            if sandbox is not None:
                await self._forget(sandbox)
            self._finalized.discard(uid)
            return
        if (spec.get("nodeName") or "") not in {n for _, n in self.nodes.objects} or uid in self._finalized:
            return
        if meta.get("deletionTimestamp"):
            if sandbox is None:
                self._finalized.add(uid)
                self._spawn(self._final_delete(pod))
            elif not sandbox.deleting and not sandbox.lost:
                sandbox.deleting = True
                grace = min(float(meta.get("deletionGracePeriodSeconds") or 0), self.grace)
                sandbox.stopper = asyncio.create_task(self._terminate(sandbox, grace, pod))
            return
        if sandbox is None:
            status = pod.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                return
            if status.get("phase") == "Running" or any((c.get("state") or {}).get("running")
                                                        for c in status.get("containerStatuses") or []):
                self._finalized.add(uid)  # (nothing more to do for it)
                self._spawn(self.status.unknown(pod))  # it ran under a kubelet before this one: its process is gone
                return
            self._start(pod)
        elif sandbox.phase == "Running" and not sandbox.lost and ready(pod) != str(sandbox.ready):
            self._spawn(self.status.report(sandbox))  # someone else changed its readiness: the kubelet says again

    def _start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = self.nodes.objects[(None, spec["nodeName"])]
        ip = self.network.pod_address((node.get("spec") or {}).get("podCIDR"))
        sandbox = Sandbox(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], node=spec["nodeName"],
                          ip=ip, local=self.network.local(ip), container=(spec.get("containers") or [{}])[0],
                          directory=self.workdir / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}")
        self.sandboxes[(sandbox.namespace, sandbox.name)] = sandbox
        sandbox.main = asyncio.create_task(self._run_pod(sandbox, pod, node))

    async def _run_pod(self, sandbox: Sandbox, pod: dict, node: dict) -> None:
        await self.status.report(sandbox)
        container = sandbox.container
        taken = taken_ports(sandbox.local, container)
        if taken:  # on a real node each pod has its own ports; here one stray listener blocks them all
            message = (f"port {', '.join(map(str, taken))} is taken on every address of this machine by another "
                       f"process; stop it: the dev cluster's pods listen on their own addresses ({sandbox.local})")
            sandbox.phase, sandbox.reason = "Failed", {"reason": "PortInUse", "message": message}
            sandbox.state = {"terminated": {"exitCode": 1, "reason": "PortInUse", "message": message,
                                            "finishedAt": timestamp()}}
            sandbox.logs.ended = True
            await self.status.report(sandbox)
            return
        for attempt in itertools.count():
            try:
                mounts = await self.setup.volumes(pod, sandbox)
                env = await self.setup.environment(pod, container, node, sandbox, mounts)
                break
            except PodError as err:
                sandbox.state = {"waiting": {"reason": err.reason, "message": err.message}}
                await self.status.report(sandbox)
                await asyncio.sleep(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)])
        defined = {e["name"]: env[e["name"]] for e in container.get("env") or [] if e.get("name") in env}
        argv = [PodSetup.path(expand(a, defined), mounts)
                for a in list(container.get("command") or []) + list(container.get("args") or [])]
        if not argv:
            sandbox.state = {"waiting": {"reason": "CreateContainerConfigError",
                                         "message": "the container has no command (no image to run here)"}}
            await self.status.report(sandbox)
            return
        if argv[0] == "python":
            argv[0] = sys.executable
        try:
            sandbox.proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=PodSetup.path(container.get("workingDir") or "", mounts) or str(sandbox.directory),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent)
        except (OSError, ValueError) as err:
            sandbox.phase, sandbox.reason = "Failed", {"reason": "StartError", "message": str(err)}
            sandbox.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(err),
                                            "finishedAt": timestamp()}}
            sandbox.logs.ended = True
            await self.status.report(sandbox)
            return
        probed = any(container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        sandbox.phase, sandbox.ready, sandbox.started_at = "Running", not probed, timestamp()
        sandbox.state = {"running": {"startedAt": sandbox.started_at}}
        await self.status.report(sandbox)
        if probed:
            sandbox.tasks.append(asyncio.create_task(self.probes.run(sandbox)))
        await self._collect(sandbox)

    async def _collect(self, sandbox: Sandbox) -> None:
        """The output until the process exits, then how it ended."""
        proc = sandbox.proc
        assert proc is not None and proc.stdout is not None
        while line := await proc.stdout.readline():
            sandbox.logs.data += line
        code = await proc.wait()
        sandbox.logs.ended = True
        for task in sandbox.tasks:
            task.cancel()
        shutil.rmtree(sandbox.directory, ignore_errors=True)  # its volumes; the log stays with the pod
        if sandbox.lost:
            return  # no kubelet left to tell
        message = sandbox.killed_by
        if not message and code != 0 and sandbox.container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = bytes(sandbox.logs.data[-LOG_TAIL_BYTES:]).decode(errors="replace")
        sandbox.phase, sandbox.ready = ("Succeeded" if code == 0 else "Failed"), False
        sandbox.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                        "startedAt": sandbox.started_at, "finishedAt": timestamp(),
                                        **({"message": message} if message else {})}}
        await self.status.report(sandbox)

    async def _terminate(self, sandbox: Sandbox, grace: float, pod: dict) -> None:
        """Stop a deleted pod's process within its grace period, then delete the pod for good."""
        if sandbox.proc is None:
            if sandbox.main is not None:
                sandbox.main.cancel()
        else:
            await sandbox.kill(signal.SIGTERM)
            try:
                await asyncio.wait_for(sandbox.proc.wait(), grace)
            except TimeoutError:
                await sandbox.kill(signal.SIGKILL)
        if sandbox.main is not None:
            await asyncio.gather(sandbox.main, return_exceptions=True)
        if not sandbox.lost:
            await self._final_delete(pod)

    async def _final_delete(self, pod: dict) -> None:
        """DELETE with grace 0, on condition that it is still this pod: what lets a deleted pod go."""
        meta = pod["metadata"]
        self._finalized.add(meta["uid"])
        for _ in range(20):  # (as long as the API server fails it: nothing else will)
            try:
                await self.api.delete(path(PODS, meta["namespace"], meta["name"]),
                                      {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
                return
            except (TimeoutError, ApiStatusError, aiohttp.ClientError) as err:
                log.warning("pod %s/%s: final delete failed: %s", meta["namespace"], meta["name"], err)
                await asyncio.sleep(0.5)
        self._finalized.discard(meta["uid"])  # the next event about it tries again

    async def _forget(self, sandbox: Sandbox) -> None:
        """The pod is gone from the API: its process and everything of it go."""
        del self.sandboxes[(sandbox.namespace, sandbox.name)]
        sandbox.lost = True
        for task in [*sandbox.tasks, sandbox.main, sandbox.stopper]:
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await sandbox.kill(signal.SIGKILL)
        self.network.release(sandbox.ip)
        shutil.rmtree(sandbox.directory, ignore_errors=True)
